"""The batch job's steps (pipelines/batch.py wires them): MatchJobs (match.py) -> AnalyzeJobs
(analyze_jobs.py: read_windows.py reads and validates, the engine analyses, outcomes.py records) ->
fleet statistics (fleet_stats.py) -> the journalled publish (commit.py); elements.py: what flows between
them; convert_raw.py: big raw Kineto windows converted rank by rank."""

"""The batch job's steps (pipelines/batch.py wires them): MatchJobs (match.py) -> AnalyzeJobs
(analyze_jobs.py: read_windows.py reads and validates, the engine analyses, outcomes.py records) ->
fleet statistics (job_facts.py reads each window's tables, fleet_stats.py accumulates them per date,
rollups.py rebuilds weeks, months and all dates) -> the journalled publish (commit.py); elements.py:
what flows between them; convert_raw.py: big raw Kineto windows converted rank by rank."""

"""The streaming monitor's steps (pipelines/streaming.py wires them): the landing area's poller
(landing.py) -> sessions assembled (sessions.py) -> analysed (analyze_sessions.py) -> live results and
alert events (results.py; what pages: paging.py) -> webhooks (alerting.py); tables.py and status.py are
read by `strag serve` without Beam, so this package's __init__ imports nothing."""

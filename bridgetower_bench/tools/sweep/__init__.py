"""The benchmark sweep under tools/bench.py's command line (plan, run, rows, resume, report), its costs and energy,
and the versions its rows ran; `compare` builds on the report too (the commands stay in tools/)."""

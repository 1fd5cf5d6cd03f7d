"""Command-line tools (run with `python -m bridgetower_bench.tools.NAME`): they may import the runtime modules, never the reverse."""

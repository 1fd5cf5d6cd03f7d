"""Command-line tools of the kit (each: python -m bridgetower_bench.tools.<name>)."""

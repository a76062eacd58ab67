"""Benchmarks. Each runs from the repository root as `python -m benchmarks.NAME`; results and
commands are in benchmarks/RESULTS.md. Library code only: nothing here imports tests/."""

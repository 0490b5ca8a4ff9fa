"""Benchmarks: `python -m bench.qps` (QPS and memory side by side) and pytest-benchmark micro-benchmarks."""

"""The benchmarks, each run from the repository root as ``python -m benchmarks.bench_NAME``; their shared
code is in ``benchmarks.common``."""

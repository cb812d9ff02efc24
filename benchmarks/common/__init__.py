"""What the benchmarks share, and the pieces of them the tests exercise: each benchmark script
(``benchmarks/bench_*.py``) keeps its command line and imports its pipeline from here."""

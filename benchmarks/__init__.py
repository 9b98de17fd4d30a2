"""k3lab benchmark suite: ``python -m benchmarks [--quick]`` (see benchmarks/README.md)."""

"""Evaluation: benchmarks that measure what eviction costs, on the bundled model or any other."""

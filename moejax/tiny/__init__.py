"""Tiny random-weight DeepSeek checkpoints, for demos, tests and benchmarks (not trained)."""

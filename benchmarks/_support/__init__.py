"""Helpers the benchmarks share with the tests (the daemon harness, tiny models, the test
stack, a Redis cluster); nothing here imports ``tests``."""

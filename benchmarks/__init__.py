"""Benchmarks of the bridge and of the bare clients it is compared with (see docs/development/benchmarks.md)."""

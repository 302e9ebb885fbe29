"""Helpers the benchmark scripts share (not benchmarks themselves)."""

"""Clockwork's test suite: unit tests (no root) and integration tests on the sandbox cluster."""

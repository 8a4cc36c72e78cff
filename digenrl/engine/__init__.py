"""Execution engine: the scheduling policy, Ray workers, weight sync, runtime and timeline."""

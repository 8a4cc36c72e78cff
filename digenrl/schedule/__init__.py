"""Scheduling: which unit each worker does next, and the one loop that asks (pure Python)."""

"""The run directory and its lifecycle: lock, metrics, cadence, Ctrl-C, resume checks, evaluation, media."""

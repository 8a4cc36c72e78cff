"""What ``digenrl profile`` measures, one concern per module:

- :mod:`~digenrl.planner.measure.timing`         warm-up, peak memory and round-robin timing of calls
- :mod:`~digenrl.planner.measure.model_times`    the model's calls and whole units on this device
- :mod:`~digenrl.planner.measure.contention`     CPU: other processes' load, slowdown of concurrent workers
- :mod:`~digenrl.planner.measure.ray_overheads`  Ray micro-benchmarks (call, transfer, put / get, all-reduce)
- :mod:`~digenrl.planner.measure.engine_run`     a calibration run of the engine and what its timeline shows
"""

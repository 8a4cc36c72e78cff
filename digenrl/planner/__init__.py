"""The planner (docs/architecture.md): measure (profile), cost model, simulator, placement search.

- :mod:`~digenrl.planner.profile`   ``digenrl profile``: per-call times, memory, engine overheads
- :mod:`~digenrl.planner.gpus`      accelerator table (datasheet numbers) and cluster files
- :mod:`~digenrl.planner.shapes`    transformer shapes, token counts, FLOPs, parameter counts
- :mod:`~digenrl.planner.costmodel` unit durations and memory per device type
- :mod:`~digenrl.planner.simulator` the engine's Scheduler in virtual time -> Timeline
- :mod:`~digenrl.planner.search`    enumerate, prune, simulate, rank placements
"""

"""The planner (docs/architecture.md): measure (profile), cost model, simulator, placement search.

Measurement
- :mod:`~digenrl.planner.profile`     ``digenrl profile``: the steps it takes, the profile.json format
- :mod:`~digenrl.planner.measure`     model times, CPU contention, Ray overheads, the calibration run
Cost model
- :mod:`~digenrl.planner.constants`   every fixed number, named
- :mod:`~digenrl.planner.params`      the cost model's assumptions (``CostParams`` and siblings)
- :mod:`~digenrl.planner.gpus`        accelerator table (datasheet numbers) and cluster files
- :mod:`~digenrl.planner.shapes`      model shapes from the family adapters' cost hooks, parameter counts
- :mod:`~digenrl.planner.workload`    a run config's per-iteration work
- :mod:`~digenrl.planner.call_times`  seconds per call (profiled or analytic), unit composition
- :mod:`~digenrl.planner.memory`      bytes per device, the setups that fit
- :mod:`~digenrl.planner.calibrate`   fitting the cost model to a profile
- :mod:`~digenrl.planner.costmodel`   unit durations and memory per device type (``CostModel``)
Simulation and search
- :mod:`~digenrl.planner.simulator`   the engine's Scheduler in virtual time -> Timeline
- :mod:`~digenrl.planner.search`      enumerate, prune, simulate, rank placements
"""

"""The planner (docs/architecture.md): measure (profile), cost model, simulator, placement search.

Details: docs/modules.md, `digenrl.planner`.
"""

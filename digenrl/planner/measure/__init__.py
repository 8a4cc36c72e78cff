"""What ``digenrl profile`` measures, one concern per module:

Details: docs/modules.md, `digenrl.planner.measure`.
"""

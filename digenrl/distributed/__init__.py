"""Scale components for sharded trainers and GB-scale weight sync, applied to an
unchanged diffusers transformer, torchtitan-style:

Details: docs/modules.md, `digenrl.distributed`.
"""

"""Scale components for sharded trainers and GB-scale weight sync, applied to an
unchanged diffusers transformer, torchtitan-style:

- :mod:`.blocks`: the repeated transformer blocks of each family (the unit of sharding and
  of activation checkpointing);
- :mod:`.precision`: fp32 master weights for every trained parameter, bf16 only for compute;
- :mod:`.checkpointing`: activation checkpointing per block;
- :mod:`.fsdp`: FSDP2 (``fully_shard``) per block, then the root, with a ``MixedPrecisionPolicy``;
- :mod:`.grad_sync`: DDP-style bucketed gradient all-reduce for replicated parameters;
- :mod:`.fingerprint`: a cheap per-tensor fingerprint computed on the tensor's device;
- :mod:`.broadcast`: bucketed weight broadcast over a standalone process group, with prefetch;
- :mod:`.dcp`: sharded checkpoints with ``torch.distributed.checkpoint`` (resharding on load);
- :mod:`.settings`: how ``train.fsdp`` / ``train.activation_checkpointing`` resolve.

docs/distributed.md says what the engine calls and what is wired today.
"""

"""The settings a process of a run runs with (every ``auto`` resolved): the part of the run's layout
(:mod:`digenrl.placement.layout`) a :class:`~digenrl.policy.model.Policy` reads, at the policy's layer."""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.adapters.vae_decode import tiling_mode
from digenrl.config.algorithm import rollout_reference_refusal


@dataclass(frozen=True)
class Settings:
    """Every ``auto`` of the config as the run's processes run it."""

    fsdp: int = 1  # trainer ranks per FSDP2 shard group (1: replicated)
    activation_checkpointing: bool = False  # trainer ranks checkpoint each transformer block
    micro_batch: int = 1  # samples per forward / backward inside a train unit
    rollout_batch: int | None = None  # samples per sampling forward of a rollout-only worker (None: the
    # train forwards' batches, the on-policy ratio exactly 1)
    colocated_batch: int | None = None  # ... of a worker that also trains (colocated, TAG); None as above
    cfg_batching_trainer: str = "sequential"  # two-pass CFG on workers that train (trainer / both)
    cfg_batching_rollout: str = "sequential"  # ... on rollout workers
    vae_tiling: str = "default"  # on | off | default (the VAE's own)
    weight_sync: str = "none"  # broadcast | object_store | none (no rollout workers)
    weight_sync_fallback: bool = False  # engine.weight_sync auto: the object store if no group forms
    gpu_device: str = "cuda"  # the torch device of a worker on a GPU pool (cpu: train.device cpu); a
    # worker on a logical CPU pool runs on cpu (RunLayout.worker: each worker's device, never re-resolved)
    memory_device: str = ""  # the trainer device type the memory model checked ("" when none)
    memory_need_gib: float = 0.0  # what a trainer rank needs there, by the memory model
    memory_have_gib: float = 0.0
    kl_reference: str = "train"  # where the KL reference's step mean is computed: train | rollout

    def cfg_batching(self, trainable: bool) -> str:
        return self.cfg_batching_trainer if trainable else self.cfg_batching_rollout

    def sampling_batch(self, role: str) -> int | None:
        """Samples per sampling forward of a worker of ``role`` (None: the train forwards' batches):
        ``engine.rollout_batch`` on a rollout-only worker, ``engine.colocated_batch`` on one that trains."""
        return self.rollout_batch if role == "rollout" else self.colocated_batch


def single_process_settings(cfg) -> Settings:
    """A process that knows no device memory (a local run; a policy built outside a run): explicit
    values as written, ``auto`` off / sequential, the VAE's tiling by the adapters' own rule."""

    t, cfg_batching = cfg.train, cfg.sampling.cfg_batching
    cfg_batching = "sequential" if cfg_batching == "auto" else cfg_batching
    return Settings(
        activation_checkpointing=t.activation_checkpointing == "on",
        micro_batch=t.micro_batch,
        cfg_batching_trainer=cfg_batching,
        cfg_batching_rollout=cfg_batching,
        vae_tiling=tiling_mode(cfg.model, cfg.sampling),
        kl_reference=kl_reference(cfg, gpu=False),
    )


def kl_reference(cfg, gpu: bool) -> str:
    """``algorithm.kl_reference`` as the run computes it: ``rollout`` or ``train`` (also whenever there
    is no KL term). ``auto``: rollout where it applies (LoRA, a Flow-GRPO-family loss, unbranched) on
    GPU pools (``gpu``), train elsewhere -- every CPU run bit for bit as before."""
    value, alg = cfg.algorithm.kl_reference, cfg.algorithm
    if alg.kl_beta <= 0 or value == "train":
        return "train"
    if value == "rollout":
        return value
    return "rollout" if gpu and rollout_reference_refusal(cfg) is None else "train"

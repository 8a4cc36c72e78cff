"""What ``digenrl train`` would reject, checked in seconds and without training: the preflight that
``digenrl config validate`` runs, built from the checks the drivers themselves make (no second copy).

- the host: logical CPU devices against this machine's cores, GPU devices against the visible GPUs
  (a local run; a ``--ray-address`` cluster is checked by the engine when it reserves the devices);
- the placement: the engine's worker plan and scheduler settings;
- the model: the adapter's shape checks, the preset or checkpoint directory, the LoRA targets (a
  checkpoint's transformer is built on the meta device from its config: no weights are read);
- the files and the reward: the engine's own preflight (prompts, reward arguments and weights, a
  dry-run of the reward on a decoded sample of the tiny preset).
"""

from __future__ import annotations

import os
from pathlib import Path

from digenrl.config import RunConfig
from digenrl.errors import UserError

#: logical CPU devices (one worker process each) a host may run per core: the engine's own tests
#: run 3 workers on 2 cores; 16 on 2 cores only crawl
CPU_DEVICES_PER_CORE = 2


def check_resources(cfg: RunConfig, ray_address: str | None = None) -> None:
    """The pools against this host (skipped for a local placement and for an existing Ray cluster)."""
    if cfg.placement.mode == "local" or ray_address is not None:
        return
    cores = os.cpu_count() or 1
    cpu = sum(p.count for p in cfg.cluster.pools if p.device.lower() == "cpu")
    if cpu > CPU_DEVICES_PER_CORE * cores:
        raise UserError(f"cluster.pools: {cpu} logical CPU devices on a host with {cores} cores (at most "
                        f"{CPU_DEVICES_PER_CORE * cores}: each is a worker process); use fewer, or join a larger "
                        "cluster with --ray-address")
    gpu = sum(p.count for p in cfg.cluster.pools if p.device.lower() != "cpu")
    if gpu:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpu > visible:
            raise UserError(f"cluster.pools: {gpu} GPU devices, but this host has {visible} visible GPUs; "
                            "join a GPU cluster with --ray-address or change the pools")


def check_config(cfg: RunConfig, ray_address: str | None = None) -> list[str]:
    """Everything train would reject, in the order train meets it; returns what was checked."""
    from digenrl.engine.runtime import preflight
    from digenrl.placement import engine_scheduler_config, engine_workers

    checked = []
    check_resources(cfg, ray_address)
    if cfg.placement.mode != "local":
        engine_workers(cfg)
        engine_scheduler_config(cfg)
        pools = ", ".join(f"{p.count}x {p.device}" for p in cfg.cluster.pools)
        checked.append(f"placement {cfg.placement.mode} on {pools}")
    check_model(cfg)
    checked.append(f"model {cfg.model.adapter} ({cfg.model.preset or cfg.model.pretrained}) "
                   f"{cfg.model.height}x{cfg.model.width}" + (f"x{cfg.model.frames}" if cfg.model.frames else ""))
    preflight(cfg)  # prompts, reward, and (tiny preset) the model with its LoRA targets
    checked.append(f"prompts, reward ({', '.join(t.name for t in cfg.reward.components)})")
    return checked


def check_model(cfg: RunConfig) -> None:
    """Shapes, preset / checkpoint directory and LoRA targets, without loading any weights."""
    from digenrl.adapters import adapter_class

    cls = adapter_class(cfg.model.adapter)
    probe = cls.__new__(cls)  # only the config: check_shapes reads nothing else
    probe.cfg, probe.sampling = cfg.model, cfg.sampling
    probe.check_shapes()
    if cfg.model.pretrained is None:
        return  # the tiny preset is built (cheaply, for real) by the engine's preflight
    root = Path(cfg.model.pretrained)
    if not root.is_dir():
        raise UserError(f"model.pretrained: checkpoint directory not found: {root}")
    if not (root / "model_index.json").is_file():
        raise UserError(f"model.pretrained: {root} is not a diffusers checkpoint (no model_index.json)")
    if (root / "transformer" / "config.json").is_file() and cfg.model.lora is not None:
        from digenrl.planner.shapes import model_shape, param_counts

        param_counts(model_shape(cfg.model), cfg.model.lora, cls.default_lora_targets)  # on the meta device

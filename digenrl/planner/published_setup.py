"""One published setup: the workload and cluster a peer's published figure ran, and the figure."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from digenrl.config.run import load_config
from digenrl.planner.gpus import load_cluster

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PublishedSetup:
    name: str
    config: str  # under configs/
    overrides: tuple[str, ...]
    cluster: str  # configs/clusters/<cluster>.yaml
    peer: str  # peers.MODELS key
    published_step_s: float
    published_images_per_gpu_s: float | None
    source: str  # where the number is published
    model_reward: bool = True  # the reward is a model on the GPUs (its per-image cost applies)
    settings: dict = field(default_factory=dict)  # peer_verl_omni.PUBLISHED overrides (veRL-Omni setups)
    caveat: str = ""

    def workload(self):
        from digenrl.planner.workload import Workload

        w = Workload.from_config(load_config(ROOT / "configs" / self.config, list(self.overrides)))
        return replace(w, reward_kind="model") if self.model_reward else w

    def load_cluster(self):
        return load_cluster(ROOT / "configs" / "clusters" / f"{self.cluster}.yaml")

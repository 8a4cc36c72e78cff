"""The adapter protocol: step-level hooks over one model family's real diffusers classes.

Details: docs/modules.md, `digenrl.adapters.base`.
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch
from torch import nn

from digenrl.adapters.attention import attention_kernels
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import CostHooks, PublishedModel
from digenrl.adapters.edit import image_key, split_key
from digenrl.adapters.prompt_cache import PromptEmbeddingCache
from digenrl.adapters.text_offload import (
    TEXT_ENCODER_PARTS,
    attach_offload_hooks,
    detach_offload_hooks,
    offload_all,
)
from digenrl.adapters.vae_decode import configure_vae, tiling_mode
from digenrl.config.model import ModelConfig, SamplingConfig
from digenrl.errors import UserError

#: diffusers' default LoRA weight file (``save_lora_weights`` / ``load_lora_weights``)
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


class Adapter(CostHooks, ABC):
    """One model family. Subclasses set ``name``, ``default_lora_targets``, the cost attributes
    (``transformer_class``, ``published``, ``presets``) and implement the hooks."""

    name: str = ""
    default_lora_targets: tuple[str, ...] = ()
    transformer_class: str = ""  # the diffusers transformer class
    published: PublishedModel  # the family's reference model
    presets: dict[str, tuple[dict, dict]] = {}  # preset name -> (transformer, VAE) configs
    preview = None  # LatentRGBDecoder for tiny presets, None = decode with the real VAE
    edits = False  # an edit family: every prompt row has an input image (adapters/edit.py)
    trims_text = False  # a forward runs its rows' longest valid text, not model.max_text_len (masked)

    def __init__(
        self,
        model: ModelConfig,
        sampling: SamplingConfig,
        device: torch.device | str = "cpu",
        generates: bool = True,
        host_transformer: bool = False,
    ):
        """``generates=False``: a trainer rank that never encodes nor decodes; from a checkpoint it
        loads the transformer alone. ``host_transformer``: a rank that will shard leaves the
        transformer in host memory; sharding moves it to ``device`` a block at a time, so the device
        never holds the whole model (``distributed.fsdp.parallelize``)."""
        self.host_transformer = host_transformer
        self.cfg = model
        self.sampling = sampling
        self.device = torch.device(device)
        self.dtype = getattr(torch, model.dtype)
        self.transformer: nn.Module
        self.scheduler = None  # FlowMatchEulerDiscreteScheduler
        self.prompt_cache = PromptEmbeddingCache(model.prompt_cache)
        self.check_shapes()
        if model.pretrained is not None:
            path = Path(model.pretrained)
            if not path.is_dir():
                raise UserError(f"model.pretrained: checkpoint directory not found: {path}")
            self.build_pretrained(path) if generates else self.build_transformer_alone(path)
        else:
            self.build_preset(model.preset)
        if not host_transformer:
            self.transformer.to(self.device)
        if isinstance(getattr(self, "vae", None), nn.Module):
            self.vae.to(self.device)
            configure_vae(
                self.vae, tiling_mode(model, sampling)
            )  # one sample at a time; tiled if asked / needed
        self.offload_hooks = []  # model.offload_text_encoders: the encoders live on the CPU between encodes
        if model.offload_text_encoders:
            self.offload_hooks = attach_offload_hooks(getattr(self, "pipe", None), self.device)

    # ------------------------------------------------------------------ lean trainer ranks
    GENERATION_PIPE_PARTS = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")

    def generation_modules(self) -> dict[str, object]:
        """What only generation needs -- the text encoder(s) and the VAE -- that this adapter holds."""
        held = {name: getattr(self, name, None) for name in ("vae", "text")}
        held = {name: m for name, m in held.items() if not isinstance(m, ReleasedVAE)}
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            held.update({f"pipe.{n}": getattr(pipe, n, None) for n in self.GENERATION_PIPE_PARTS})
        return {name: m for name, m in held.items() if m is not None}

    def release_generation_modules(self) -> None:
        """Drop the text encoder(s) and the VAE (a trainer rank that never generates: prompt
        embeddings and latents travel with the samples). Encoding or decoding afterwards fails."""
        if getattr(self, "vae", None) is not None:
            self.vae = ReleasedVAE(self.vae.config)  # latent shapes still read the VAE's config
        self.text = self.preview = None
        self.prompt_cache.clear()
        pipe = getattr(self, "pipe", None)
        if (
            self.offload_hooks
        ):  # break the hooks' reference cycles: the encoders die with their last reference
            detach_offload_hooks(pipe)
        self.offload_hooks = []
        if pipe is not None:
            for name in self.GENERATION_PIPE_PARTS:
                if getattr(pipe, name, None) is not None:
                    setattr(pipe, name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ build
    @abstractmethod
    def build_preset(self, preset: str) -> None:
        """Tiny (or named) preset of the real classes, random init, no download."""

    @abstractmethod
    def build_pretrained(self, path: Path) -> None:
        """Load a local ``from_pretrained`` checkpoint directory (no hub access)."""

    def build_transformer_alone(self, path: Path) -> None:
        """The checkpoint's transformer and scheduler only: no text encoder or VAE weights are read
        (the VAE's config.json stays, for latent shapes)."""
        import diffusers
        from diffusers.configuration_utils import FrozenDict

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers {self.name} checkpoint (no model_index.json)"
            )
        net = getattr(diffusers, self.transformer_class)
        self.transformer = net.from_pretrained(path, subfolder="transformer", torch_dtype=self.dtype)
        self.vae = ReleasedVAE(FrozenDict(json.loads((path / "vae" / "config.json").read_text())))
        self.scheduler = self.checkpoint_scheduler(path)
        self.pipe = self.text = self.preview = None

    def place_pipe(self) -> None:
        """Move a loaded checkpoint's pipeline (``from_pretrained`` builds it in host memory) to the
        adapter's device -- all but its text encoders when ``model.offload_text_encoders`` is on:
        they stay in host memory, never materialised on the device first (the offload hooks move
        them there only to encode)."""

        kept = TEXT_ENCODER_PARTS if self.cfg.offload_text_encoders else ()
        for name, part in self.pipe.components.items():
            if self.host_transformer and name.startswith("transformer"):
                continue  # a rank that will shard: FSDP2 moves it, a block at a time
            if isinstance(part, nn.Module) and name not in kept:
                part.to(self.device)

    def checkpoint_scheduler(self, path: Path):
        """The scheduler a checkpoint ships, as its pipeline loads it."""
        import diffusers

        name = json.loads((path / "scheduler" / "scheduler_config.json").read_text())["_class_name"]
        return getattr(diffusers, name).from_pretrained(path, subfolder="scheduler")

    def check_shapes(self) -> None:
        """Reject resolutions / frame counts the model cannot take, with a clear message."""

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> Cond:
        """Text conditioning for each prompt (with negative-prompt tensors when the family uses CFG)."""

    def cond_for(self, prompts: list[str], images: list[str | None] | None = None) -> Cond:
        """:meth:`encode_prompts` through this worker's prompt cache (``model.prompt_cache``): each
        distinct prompt (an edit family: each distinct (prompt, input image) pair) is encoded once
        per run. On the adapter's device."""
        keys = [image_key(p, i) for p, i in zip(prompts, images or [None] * len(prompts))]
        return self.prompt_cache.lookup(keys, self._encode_then_offload).to(self.device)

    def _encode_then_offload(self, keys: list[str]) -> Cond:
        texts, images = (list(x) for x in zip(*map(split_key, keys)))
        cond = self.encode_prompts(texts, images) if self.edits else self.encode_prompts(texts)
        if self.offload_hooks:
            offload_all(self.offload_hooks)
        return cond

    @abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """Shape of one sample's latents in the transformer's native layout."""

    def initial_noise(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn((n, *self.latent_shape()), generator=generator, dtype=torch.float32).to(
            self.device
        )

    @abstractmethod
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """N+1 fp32 sigmas from 1 to 0, as the family's own pipeline computes them."""

    @abstractmethod
    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Guided model output at (latents, sigma) for a batch; fp32 in, fp32 out. ``sigma`` is (B,),
        as :meth:`sigma_input` gives it."""

    #: the family reads ``sigma`` on the host (it moves it to the device itself): Wan2.2 picks experts
    host_sigma = False

    def sigma_input(self, sigma: torch.Tensor) -> torch.Tensor:
        """A host ``sigma`` (B,) as :meth:`velocity` takes it: on the device, or left on the host for a
        family that reads it there (``host_sigma``), so that no forward waits for the device."""
        return sigma if self.host_sigma else sigma.to(self.device)

    @contextlib.contextmanager
    def lockstep(self, on: bool = True):
        """Forwards inside run the same modules whatever their rows hold (a sharded group's ranks each
        run their own rows: the same collectives on every rank). A family of one transformer always does."""
        yield

    def to_spatial(self, latents: torch.Tensor) -> torch.Tensor:
        """Native latents -> the VAE's layout (N,C,H,W) / (N,C,F,H,W); packed families unpack here."""
        return latents

    @abstractmethod
    def vae_decode(self, x: torch.Tensor) -> torch.Tensor:
        """Spatial latents -> pixels in [0,1] through the family's real VAE."""

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [0,1]: images (N,C,H,W), videos (N,C,F,H,W). Tiny presets use ``preview``
        (adapters/preview.py: a random-init VAE decoder makes colour nearly independent of latents)."""
        x = self.to_spatial(latents.float())
        if self.preview is not None:
            return self.preview(x)
        return self.vae_decode(x)

    # ------------------------------------------------------------------ LoRA files
    lora_weight_names: tuple[str, ...] = (LORA_WEIGHT_NAME,)  # the files :meth:`lora_files` may write

    def lora_files(self, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The trained LoRA tensors by diffusers weight file, each file for one of the pipeline's
        transformers (``load_lora_weights``); a model of two experts writes one file per expert."""
        return {LORA_WEIGHT_NAME: state}

    def lora_from_files(self, files: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`lora_files`: the tensors as ``adapter.transformer`` names them."""
        return files[LORA_WEIGHT_NAME]

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def autocast(self):
        """Every transformer call's numerics: mixed precision when the model dtype is not fp32
        (trainable LoRA params stay fp32), and the attention kernels ``model.cudnn_attention`` allows."""
        fp32 = self.dtype == torch.float32
        mixed = contextlib.nullcontext() if fp32 else torch.autocast(self.device.type, dtype=self.dtype)
        with attention_kernels(self.cfg.cudnn_attention), mixed:
            yield

    def model_signature(self) -> dict:
        n = sum(p.numel() for p in self.transformer.parameters())
        # FSDP2 swaps the class for FSDP<class>: the signature names the model's own class
        cls = next(c for c in type(self.transformer).__mro__ if not c.__name__.startswith("FSDP"))
        return {
            "adapter": self.name,
            "class": cls.__name__,
            "params": n,
            "config": {k: v for k, v in dict(self.transformer.config).items() if not k.startswith("_")},
        }

    def flow_scheduler(self, config: dict | None = None):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(**(config or {}))

    def _set_timesteps(self, num_steps: int, mu: float | None = None) -> torch.Tensor:
        """Fixed-shift or dynamic-shift sigmas from the scheduler (which appends the final 0)."""
        sched = self.scheduler
        if self.sampling.shift is not None:  # user-fixed shift overrides the model's own schedule
            sched = self.flow_scheduler({"shift": self.sampling.shift, "use_dynamic_shifting": False})
            sched.set_timesteps(num_steps)
        elif sched.config.use_dynamic_shifting:
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        else:
            sched.set_timesteps(num_steps)
        return sched.sigmas.to(torch.float32).clone()


class ReleasedVAE:
    """What a lean trainer rank keeps of the VAE: its config (latent shapes), no weights."""

    def __init__(self, config):
        self.config = config

    RELEASED = "this worker released its VAE: it does not decode"

    @property
    def dtype(self):  # read first by the families' vae_decode
        raise RuntimeError(self.RELEASED)

    def decode(self, *args, **kwargs):
        raise RuntimeError(self.RELEASED)


@contextlib.contextmanager
def seeded(seed: int):
    """Deterministic random init of a tiny preset without touching the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield

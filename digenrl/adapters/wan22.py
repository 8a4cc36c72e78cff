"""Wan2.2 (``WanTransformer3DModel``): T2V-A14B's two experts by noise level, and TI2V-5B.

Everything Wan2.1 does (adapters/wan.py: UMT5 prompts, two-pass CFG, fixed-shift flow schedule,
the VAE's mean / std) plus what ``diffusers.WanPipeline`` adds for Wan2.2:

- **T2V-A14B**: ``transformer`` runs the steps whose timestep ``1000 sigma`` is at or above
  ``boundary_ratio * num_train_timesteps`` (high noise), ``transformer_2`` the others, each with its
  own guidance scale (``sampling.guidance`` / ``sampling.guidance_2``); both experts are one trained
  module (adapters/experts.py), and ``model.train_experts`` may freeze one.
- **TI2V-5B**: one transformer over the Wan2.2 VAE's 48-channel latents (x16 spatial: a 2x2
  patchify in the VAE, then three downsamples); its timestep is given per token (``expand_timesteps``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from digenrl.adapters.base import seeded
from digenrl.adapters.cost_hooks import PublishedModel, hidden_size
from digenrl.adapters.experts import EXPERT_NAMES, Experts
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_text import HashTextEncoder
from digenrl.adapters.wan import TINY_TRANSFORMER, TINY_VAE, WAN21_T2V_14B, WanAdapter
from digenrl.errors import UserError

#: the Wan2.2 VAE's latent channels: a transformer over them is TI2V's, whose WanPipeline gives the
#: timestep per token (expand_timesteps)
TI2V_CHANNELS = 48
BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B-Diffusers' model_index.json (the I2V-A14B uses 0.9)
# TI2V-5B's tiny twin: 48 latent channels; the VAE patchifies 2x2 and downsamples twice (x8 here;
# the real one three times, x16)
TINY_5B_TRANSFORMER = {**TINY_TRANSFORMER, "in_channels": TI2V_CHANNELS, "out_channels": TI2V_CHANNELS}
TINY_5B_VAE = dict(
    base_dim=8,
    z_dim=TI2V_CHANNELS,
    in_channels=12,
    out_channels=12,
    is_residual=True,
    patch_size=2,
    dim_mult=[1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[True, True],
    scale_factor_spatial=8,
    scale_factor_temporal=4,
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)
TRAINED = {"both": EXPERT_NAMES, "high_noise": EXPERT_NAMES[:1], "low_noise": EXPERT_NAMES[1:]}

# Wan-AI/Wan2.2-T2V-A14B-Diffusers: each expert is Wan2.1-T2V-14B's architecture; the Wan2.1 VAE
WAN22_T2V_A14B = replace(WAN21_T2V_14B, label="Wan2.2-T2V-A14B")
# Wan-AI/Wan2.2-TI2V-5B-Diffusers: transformer/config.json; the Wan2.2 VAE (AutoencoderKLWan, base_dim
# 160, decoder_base_dim 256, z_dim 48, dim_mult [1, 2, 4, 4], is_residual, patch_size 2)
WAN22_TI2V_5B = PublishedModel(
    label="Wan2.2-TI2V-5B",
    transformer=dict(
        patch_size=[1, 2, 2],
        num_attention_heads=24,
        attention_head_dim=128,
        in_channels=48,
        out_channels=48,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=14336,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
    vae=dict(scale_factor_spatial=16, scale_factor_temporal=4, z_dim=48),
    vae_params=704.7e6,  # AutoencoderKLWan(**that config) on the meta device
    vae_decode_flops_per_px=19.3e6,  # FlopCounterMode over its decode on the meta device (5 x 64 x 64 px)
    text_encoder_params=WAN21_T2V_14B.text_encoder_params,
)


class Wan22Adapter(WanAdapter):
    name = "wan22"
    pipeline_class = "WanPipeline"
    published = WAN22_T2V_A14B
    lora_weight_names = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_2.safetensors")
    presets = {"tiny": (TINY_TRANSFORMER, TINY_VAE), "tiny_5b": (TINY_5B_TRANSFORMER, TINY_5B_VAE)}
    boundary_ratio: float | None = None  # None: one transformer (TI2V-5B)
    expand_timesteps = False
    host_sigma = True  # the experts are picked from the host's sigma: no forward waits for the device
    _high: torch.Tensor | None = None  # on the host: the current step's rows the high-noise expert runs
    _t: torch.Tensor | None = None  # the timestep (on the device) that ``_high`` belongs to
    _lockstep = False  # every forward runs both experts, high first (a sharded group's rank)

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel

        if preset not in self.presets:
            raise UserError(f"model.preset: unknown preset '{preset}' for wan22 (available: tiny, tiny_5b)")
        tcfg, vcfg = self.presets[preset]
        with seeded(1234):
            self.transformer = WanTransformer3DModel(**tcfg)
            self.vae = AutoencoderKLWan(**vcfg).eval()
        if preset == "tiny":  # T2V-A14B: a second expert (its own random init), the published boundary
            with seeded(1235):
                low = WanTransformer3DModel(**tcfg)
            self._set_experts(self.transformer, low, BOUNDARY_RATIO)
        else:
            self.expand_timesteps = True
        self.text = HashTextEncoder(tcfg["text_dim"], self.cfg.max_text_len)
        self.pipe = None
        self.scheduler = self.flow_scheduler({"shift": 3.0})
        vc = self.vae.config
        self.preview = LatentRGBDecoder(vc.z_dim, vc.scale_factor_spatial, vc.scale_factor_temporal)

    def build_pretrained(self, path: Path) -> None:
        from diffusers import AutoencoderKLWan, WanPipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers Wan2.2 checkpoint (no model_index.json)"
            )
        # a component saved as null (TI2V-5B: transformer_2) loads as None
        index = json.loads((path / "model_index.json").read_text())
        absent = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None}
        vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)  # as Wan2.1
        self.pipe = WanPipeline.from_pretrained(path, vae=vae, torch_dtype=self.dtype, **absent)
        self.place_pipe()
        self.transformer, self.vae, self.text = self.pipe.transformer, self.pipe.vae, None
        self.scheduler = self.pipe.scheduler = self._flow_scheduler_from(self.pipe.scheduler.config)
        self.expand_timesteps = bool(self.pipe.config.get("expand_timesteps"))
        if self.pipe.transformer_2 is not None:
            self._set_experts(self.pipe.transformer, self.pipe.transformer_2, self.pipe.config.boundary_ratio)

    def build_transformer_alone(self, path: Path) -> None:
        from diffusers import WanTransformer3DModel

        super().build_transformer_alone(path)
        index = json.loads((path / "model_index.json").read_text())
        self.expand_timesteps = bool(index.get("expand_timesteps"))
        if (index.get("transformer_2") or [None])[0] is not None:
            low = WanTransformer3DModel.from_pretrained(
                path, subfolder="transformer_2", torch_dtype=self.dtype
            )
            self._set_experts(self.transformer, low, index["boundary_ratio"])

    def _set_experts(self, high, low, boundary_ratio: float) -> None:
        self.transformer = Experts(high, low, TRAINED[self.cfg.train_experts])
        self.boundary_ratio = boundary_ratio

    def _component_configs(self) -> tuple[dict, dict] | None:
        if self.cfg.pretrained is None:
            return self.presets.get(self.cfg.preset, self.presets["tiny"])
        return super()._component_configs()

    @property
    def two_experts(self) -> bool:
        return isinstance(self.transformer, Experts)

    # ------------------------------------------------------------------ cost
    @classmethod
    def published_model(cls, model) -> PublishedModel:
        # Wan-AI/Wan2.2-TI2V-5B(-Diffusers) vs -T2V-A14B: the checkpoint directory's name
        small = model.pretrained is not None and "5b" in Path(model.pretrained).name.lower()
        return WAN22_TI2V_5B if small else WAN22_T2V_A14B

    @classmethod
    def experts_held(cls, model) -> int:
        """Transformers the model holds in memory (the planner's parameter count): 2 for A14B."""
        if model.pretrained is None:
            return 2 if model.preset == "tiny" else 1
        root = Path(model.pretrained)
        index = _read_json(root / "model_index.json") or {}
        if "transformer_2" in index:  # a Wan2.2 checkpoint names it (null for TI2V-5B)
            return 2 if index["transformer_2"][0] is not None else 1
        config = _read_json(root / "transformer" / "config.json") or cls.published_model(model).transformer
        return 1 if config.get("in_channels") == TI2V_CHANNELS else 2

    @classmethod
    def experts_trained(cls, model) -> int:
        held = cls.experts_held(model)
        return min(held, len(TRAINED[model.train_experts]))

    @classmethod
    def forward_flops(cls, transformer_config, tokens) -> float:
        c, flops = transformer_config, super().forward_flops(transformer_config, tokens)
        if c.get("in_channels") == TI2V_CHANNELS:  # TI2V: the time MLP and its 6d projection run per token
            d = hidden_size(c)
            flops += (tokens.x - 1) * (2 * (c.get("freq_dim", 256) * d + d * d) + 2 * d * 6 * d)
        return flops

    # ------------------------------------------------------------------ the step's expert and guidance
    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        t = super().timestep(sigma)  # 1000 sigma in fp32: the scheduler's timesteps (``sigma_input``: host)
        # WanPipeline: the high-noise expert while t >= boundary_ratio * num_train_timesteps; the rows are
        # read on the host and kept for forward_pass() and guide() (velocity and the sequential-CFG
        # backward both call timestep() first)
        self._high = (t >= self.boundary_ratio * 1000).cpu() if self.two_experts else None
        self._t = t.to(self.device)
        return self._t

    @contextlib.contextmanager
    def lockstep(self, on: bool = True):
        self._lockstep, before = on, self._lockstep
        try:
            yield
        finally:
            self._lockstep = before

    def guide(self, v_cond: torch.Tensor, v_unc: torch.Tensor) -> torch.Tensor:
        g = self.sampling.guidance
        if self._high is not None and not bool(self._high.all()):
            g2 = self.sampling.guidance_2 if self.sampling.guidance_2 is not None else g
            g = torch.where(self._high, g, g2).to(v_cond).view(-1, *[1] * (v_cond.ndim - 1))
        return v_unc + g * (v_cond - v_unc)

    def _rows_high(self, t: torch.Tensor) -> torch.Tensor:
        """On the host, the rows of ``t`` the high-noise expert runs: from timestep() (``t`` is its
        output, or twice it: batched CFG), else read from ``t``."""
        if self._t is not None and (t is self._t or len(t) == 2 * len(self._t)):
            return self._high if t is self._t else self._high.repeat(2)
        return (t >= self.boundary_ratio * 1000).cpu()

    def forward_pass(
        self, latents: torch.Tensor, t: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        if not self.two_experts:
            return self._run(self.transformer, latents, t, inputs["embeds"])
        experts, high = self.transformer, self._rows_high(t)
        n_high = int(high.sum())
        if not self._lockstep and n_high in (0, len(high)):  # one expert for the batch (every sampling step)
            net = experts.transformer if n_high else experts.transformer_2
            return self._run(net, latents, t, inputs["embeds"])
        # rows of both kinds (training on per-row levels), or a sharded rank: each expert on its rows,
        # high first; in lockstep an expert none of the rows needs runs on the first row, discarded, so
        # that every rank gathers (and a trained expert reduces) the same parameters in the same order
        out = latents.new_zeros(latents.shape)
        for rows, net in ((high, experts.transformer), (~high, experts.transformer_2)):
            idx = rows.nonzero().squeeze(1)
            if len(idx) == 0 and not self._lockstep:
                continue
            run = (idx if len(idx) else idx.new_zeros(1)).to(latents.device)
            v = self._run(net, latents[run], t[run], inputs["embeds"][run])
            out = out.index_copy(0, idx.to(latents.device), v[: len(idx)])
        return out

    def _run(self, net, latents: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        if self.expand_timesteps:  # TI2V-5B: one timestep per video token (all equal without an image)
            f, h, w = latents.shape[2:]
            t = t[:, None].expand(-1, f * ((h + 1) // 2) * ((w + 1) // 2))
        with self.autocast():
            out = net(
                hidden_states=latents.to(self.dtype),
                timestep=t,
                encoder_hidden_states=embeds.to(self.dtype),
                return_dict=False,
            )[0]
        return out.float()

    # ------------------------------------------------------------------ LoRA files
    def lora_files(self, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """One diffusers LoRA file per trained expert: ``pytorch_lora_weights.safetensors`` for
        ``transformer`` (``pipe.load_lora_weights(dir)``) and ``..._2.safetensors`` for ``transformer_2``
        (``load_lora_weights(dir, weight_name=..., load_into_transformer_2=True)``)."""
        if not self.two_experts:
            return super().lora_files(state)
        files = {}
        for name, weight_name in zip(EXPERT_NAMES, self.lora_weight_names):
            part = {k.removeprefix(f"{name}."): v for k, v in state.items() if k.startswith(f"{name}.")}
            if part:
                files[weight_name] = part
        return files

    def lora_from_files(self, files: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not self.two_experts:
            return super().lora_from_files(files)
        return {
            f"{name}.{k}": v
            for name, weight_name in zip(EXPERT_NAMES, self.lora_weight_names)
            for k, v in files.get(weight_name, {}).items()
        }


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

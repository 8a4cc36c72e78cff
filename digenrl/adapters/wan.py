"""Wan2.1 (``WanTransformer3DModel``): video latents (B, C, F, H, W), two-pass CFG, fixed shift.

Details: docs/modules.md, `digenrl.adapters.wan`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from digenrl.adapters.base import Adapter, seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import PublishedModel, Tokens, hidden_size
from digenrl.adapters.guidance import TwoPassCFG
from digenrl.adapters.pixels import unit_range
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_text import HashTextEncoder
from digenrl.errors import UserError

# values as in diffusers' own Wan tests, with 4 latent channels
TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
# two down stages, both spatio-temporal: x4 in time (as the real VAE) and x4 in space (real: x8).
# scale_factor_* are plain config values the pipeline trusts, so they must match the architecture.
TINY_VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[True, True],
    scale_factor_temporal=4,
    scale_factor_spatial=4,
    latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
    latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
)
TINY_SHIFT = 3.0
DEFAULT_SHIFT = 5.0  # when a checkpoint's scheduler names no shift (Wan: 3.0 for 480p, 5.0 for 720p)

# Wan-AI/Wan2.1-T2V-14B-Diffusers: transformer/config.json and vae/config.json's compression
WAN21_T2V_14B = PublishedModel(
    label="Wan2.1-T2V-14B",
    transformer=dict(
        patch_size=[1, 2, 2],
        num_attention_heads=40,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=13824,
        num_layers=40,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
    vae=dict(scale_factor_spatial=8, scale_factor_temporal=4),
    vae_params=127e6,
    vae_decode_flops_per_px=10e6,
    text_encoder_params=5.68e9,  # UMT5-XXL encoder
)


class WanAdapter(TwoPassCFG, Adapter):
    name = "wan"
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
    )  # FFN (optional): "ffn.net.0.proj", "ffn.net.2"
    pipeline_class = "WanPipeline"
    transformer_class = "WanTransformer3DModel"
    published = WAN21_T2V_14B
    presets = {"tiny": (TINY_TRANSFORMER, TINY_VAE)}
    _neg: torch.Tensor | None = None  # negative-prompt embedding (1, L, D), encoded once

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel

        if preset != "tiny":
            raise UserError(f"model.preset: unknown preset '{preset}' for wan (available: tiny)")
        with seeded(1234):
            self.transformer = WanTransformer3DModel(**TINY_TRANSFORMER)
            self.vae = AutoencoderKLWan(**TINY_VAE).eval()
        self.text = HashTextEncoder(self.transformer.config.text_dim, self.cfg.max_text_len)
        self.pipe = None
        self.scheduler = self.flow_scheduler({"shift": TINY_SHIFT})
        vc = self.vae.config
        self.preview = LatentRGBDecoder(vc.z_dim, vc.scale_factor_spatial, vc.scale_factor_temporal)

    def build_pretrained(self, path: Path) -> None:
        from diffusers import AutoencoderKLWan, WanPipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers Wan checkpoint (no model_index.json)"
            )
        # the Wan VAE is numerically fragile in half precision: keep it fp32 (as diffusers' example does)
        vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
        # torch_dtype=: honoured by every diffusers >= 0.35 (0.35 ignores dtype=: 14B would load in fp32)
        self.pipe = WanPipeline.from_pretrained(path, vae=vae, torch_dtype=self.dtype)
        self.place_pipe()  # model.offload_text_encoders: the encoders stay on the CPU
        self.transformer, self.vae, self.text = self.pipe.transformer, self.pipe.vae, None
        self.scheduler = self.pipe.scheduler = self._flow_scheduler_from(self.pipe.scheduler.config)

    def _flow_scheduler_from(self, sc) -> object:
        """FlowMatchEuler with the shipped shift (UniPC as shipped: flow_shift; FlowMatchEuler: shift)."""
        return self.flow_scheduler({"shift": float(sc.get("flow_shift", sc.get("shift", DEFAULT_SHIFT)))})

    def checkpoint_scheduler(self, path: Path):
        return self._flow_scheduler_from(super().checkpoint_scheduler(path).config)

    def _component_configs(self) -> tuple[dict, dict] | None:
        """(transformer, vae) configs without building: the tiny ones, or the checkpoint's config.json
        files."""
        if self.cfg.pretrained is None:
            return TINY_TRANSFORMER, TINY_VAE
        try:
            return tuple(
                json.loads((Path(self.cfg.pretrained) / sub / "config.json").read_text())
                for sub in ("transformer", "vae")
            )
        except (OSError, ValueError):
            return None  # missing / unreadable checkpoint: reported by the build

    # ------------------------------------------------------------------ cost
    @classmethod
    def vae_factors(cls, vae_config) -> tuple[int, int]:
        return vae_config.get("scale_factor_spatial") or 8, vae_config.get("scale_factor_temporal") or 4

    @classmethod
    def latent_shape_for(cls, model, transformer_config, vae_config) -> tuple[int, int, int, int]:
        """As WanPipeline.prepare_latents: (C, (F-1)//t + 1, H//s, W//s)."""
        s, t = cls.vae_factors(vae_config)
        return (
            transformer_config.get("in_channels", 16),
            ((model.frames or 1) - 1) // t + 1,
            model.height // s,
            model.width // s,
        )

    @classmethod
    def sequence_tokens(cls, transformer_config, latent_shape) -> int:
        pt, ph, pw = transformer_config.get("patch_size", (1, 2, 2))
        _, f, h, w = latent_shape
        return (f // pt) * (h // ph) * (w // pw)

    @classmethod
    def guidance_passes(cls, guidance: float) -> int:
        return 2 if guidance > 1.0 else 1  # two-pass CFG

    @classmethod
    def forward_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        d = hidden_size(c)
        pt, ph, pw = c.get("patch_size", (1, 2, 2))
        pv = pt * ph * pw
        cin, cout, ffn = c["in_channels"], c.get("out_channels") or c["in_channels"], c["ffn_dim"]
        embed = 2 * cin * pv * d * nx + 2 * (c["text_dim"] * d + d * d) * nt
        embed += 2 * (c.get("freq_dim", 256) * d + d * d) + 2 * d * 6 * d
        block = (
            2 * 4 * d * d * nx
            + 4 * nx * nx * d  # self-attention
            + 2 * 2 * d * d * nx
            + 2 * 2 * d * d * nt
            + 4 * nx * nt * d  # cross-attention to the text
            + 2 * 2 * d * ffn * nx
        )  # FFN
        return embed + c["num_layers"] * block + 2 * d * cout * pv * nx

    @classmethod
    def attention_flops(cls, transformer_config, tokens: Tokens) -> float:
        """Self-attention over the video tokens, cross-attention to the text."""
        c, nx, nt = transformer_config, tokens.x, tokens.text
        return c["num_layers"] * (4 * nx * nx * hidden_size(c) + 4 * nx * nt * hidden_size(c))

    def check_shapes(self) -> None:
        # runs before the (possibly 14B) load, from config files only
        f, h, w = self.cfg.frames, self.cfg.height, self.cfg.width
        if f is None:
            raise UserError("model.frames: Wan is a video model; set model.frames (4k+1, e.g. 33 or 81)")
        configs = self._component_configs()
        if configs is None:
            return
        tcfg, vcfg = configs
        s, t = self.vae_factors(vcfg)
        if (f - 1) % t:  # the pipeline would silently round; we refuse
            raise UserError(
                f"model.frames: Wan needs {t}k+1 frames (e.g. {(f - 1) // t * t + 1} or "
                f"{(f - 1) // t * t + t + 1}), got {f}"
            )
        pt, ph, pw = tcfg.get("patch_size", (1, 2, 2))
        for key, px, p in (("height", h, ph), ("width", w, pw)):
            # a latent side not divisible by the patch is silently cut by the patch embedding (7 -> 6)
            if px % (s * p):
                raise UserError(
                    f"model.{key}: Wan needs a multiple of {s * p} pixels (VAE x{s}, patch {p}), got {px}"
                )
        _, lf, lh, lw = self.latent_shape_for(self.cfg, tcfg, vcfg)
        rope = tcfg.get("rope_max_seq_len", 1024)
        for key, n in (("frames", lf // pt), ("height", lh // ph), ("width", lw // pw)):
            if n > rope:
                raise UserError(
                    f"model.{key}: {n} tokens along this axis exceed the transformer's "
                    f"rope_max_seq_len ({rope}); use a smaller model.{key}"
                )

    # ------------------------------------------------------------------ hooks
    def _embed(self, prompts: list[str]) -> torch.Tensor:
        if self.pipe is not None:
            with torch.no_grad():
                embeds, _ = self.pipe.encode_prompt(
                    prompts,
                    do_classifier_free_guidance=False,
                    device=self.device,
                    max_sequence_length=self.cfg.max_text_len,
                )
            return embeds
        return self.text(prompts)["embeds"].to(self.device)

    def encode_prompts(self, prompts: list[str]) -> Cond:
        batched = {"prompt_embeds": self._embed(prompts)}
        if self.sampling.guidance > 1.0:  # CFG: the negative prompt travels with every sample
            if self._neg is None:  # the same for every prompt: encode it once
                self._neg = self._embed([self.sampling.negative_prompt])
            batched["neg_prompt_embeds"] = self._neg.repeat(len(prompts), 1, 1)
        return Cond(batched)

    def latent_shape(self) -> tuple[int, ...]:
        return self.latent_shape_for(self.cfg, self.transformer.config, self.vae.config)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return self._set_timesteps(num_steps)  # fixed shift, no mu

    # ------------------------------------------------------------------ two-pass CFG (adapters/guidance.py)
    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        # WanPipeline passes scheduler.timesteps[i] = sigmas[i] * 1000, computed in fp32; keep it fp32 even
        # under bf16 (bf16 would round 937.5 to 936) -- the time embedding casts it itself.
        return sigma.to(torch.float32) * 1000

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        return {"embeds": cond.batched["neg_prompt_embeds" if negative else "prompt_embeds"]}

    def forward_pass(
        self, latents: torch.Tensor, t: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        with self.autocast():
            out = self.transformer(
                hidden_states=latents.to(self.dtype),
                timestep=t,
                encoder_hidden_states=inputs["embeds"].to(self.dtype),
                return_dict=False,
            )[0]
        return out.float()

    def guide(self, v_cond: torch.Tensor, v_unc: torch.Tensor) -> torch.Tensor:
        g = self.sampling.guidance
        return v_unc + g * (v_cond - v_unc)  # in fp32 (the pipeline combines in the transformer dtype)

    @torch.no_grad()
    def vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        vc = self.vae.config
        x = latents.to(self.device, self.vae.dtype)
        mean = torch.tensor(vc.latents_mean).view(1, vc.z_dim, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(vc.latents_std).view(1, vc.z_dim, 1, 1, 1).to(x.device, x.dtype)
        x = x / inv_std + mean  # the same float ops as WanPipeline
        video = self.vae.decode(x, return_dict=False)[0]  # (N, 3, F, H, W) in [-1, 1]
        return unit_range(video)

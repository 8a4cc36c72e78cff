"""FLUX.2 [dev] and [klein] (``Flux2Transformer2DModel``): packed 2x2 patches, an LM's stacked hidden
states as text, the empirical shift.

Mirrors ``diffusers.Flux2Pipeline`` / ``Flux2KleinPipeline``: latents are the VAE's latents patchified
2x2 and packed to (B, H/2 * W/2, 4C) tokens with 4-D ids (t, h, w, l); the caption is the text
encoder's hidden states at three layers, stacked per token, padded to ``max_text_len`` and attended
whole (no mask); the sigmas are ``linspace(1, 1/N, N)`` shifted by ``compute_empirical_mu(tokens,
N)``; the timestep is ``(1000 sigma).to(model dtype) / 1000``. [dev] (``guidance_embeds``) embeds the
guidance scale, one pass; [klein] runs two-pass CFG ``neg + g (pos - neg)`` when ``guidance > 1``,
except a step-distilled checkpoint (``is_distilled``), which never does.
Details: docs/modules.md, `digenrl.adapters.flux2`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from digenrl.adapters.base import seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import PublishedModel, Tokens, hidden_size
from digenrl.adapters.guidance import TwoPassCFG
from digenrl.adapters.packed import PackedLatentAdapter
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_lm import TinyLM
from digenrl.errors import UserError

TEXT_LAYERS = 3  # hidden states stacked per token: [klein] Qwen3 (9, 18, 27), [dev] Mistral (10, 20, 30)
TINY_TEXT_WIDTH = 16
# The tiny preset keeps the published proportions that decide how loudly the prompt speaks at init (the
# prompt reaches the image only through attention: no pooled text): the LM's stacked layers at 1/4, 1/2,
# 3/4 of its depth (Qwen3-4B's 9, 18, 27 of 36; Mistral's 10, 20, 30 of 40), [klein] 4B's 5 double to 20
# single blocks, and (configs/flux2_tiny.yaml) text tokens at half the image tokens, as 512 padded tokens
# beside a 512 px image's 1024. With 1 + 1 blocks, a 3-layer LM stacked to its last layer and 16 text
# tokens, "red" vs "blue" moved the velocity 2-7%; now 10-28% over init seeds (Z-Image's tiny preset
# 6-25%), and the colour demo learns the prompt's colour: benchmarks/RESULTS.md
TINY_TEXT_DEPTH = 4
TINY_KLEIN = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x 2x2
    num_layers=4,
    num_single_layers=16,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=TEXT_LAYERS * TINY_TEXT_WIDTH,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
TINY_DEV = {**TINY_KLEIN, "guidance_embeds": True}
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(8, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
)
_VAE = dict(block_out_channels=[128, 256, 512, 512], latent_channels=32)

# black-forest-labs/FLUX.2-klein-4B and FLUX.2-dev: transformer/config.json (dev: the class defaults)
FLUX2_KLEIN_4B = PublishedModel(
    label="FLUX.2 [klein] 4B",
    transformer=dict(
        patch_size=1,
        in_channels=128,
        num_layers=5,
        num_single_layers=20,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=7680,  # 3 x Qwen3-4B's 2560
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=[32, 32, 32, 32],
        rope_theta=2000,
        guidance_embeds=False,
    ),
    vae=_VAE,
    vae_params=84.0e6,
    vae_decode_flops_per_px=6.6e6,
    text_encoder_params=4.02e9,  # Qwen3-4B
)
FLUX2_DEV = PublishedModel(
    label="FLUX.2 [dev] (32B)",
    transformer=dict(
        patch_size=1,
        in_channels=128,
        num_layers=8,
        num_single_layers=48,
        attention_head_dim=128,
        num_attention_heads=48,
        joint_attention_dim=15360,  # 3 x Mistral-Small-3.1's 5120
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=[32, 32, 32, 32],
        rope_theta=2000,
        guidance_embeds=True,
    ),
    vae=_VAE,
    vae_params=84.0e6,
    vae_decode_flops_per_px=6.6e6,
    text_encoder_params=24.0e9,  # Mistral-Small-3.1-24B
)


def unit_scale(model: torch.nn.Module) -> torch.nn.Module:
    """Every Linear weight widened from torch's U(+-1/sqrt(fan_in)) to U(+-sqrt(3/fan_in)): variance
    preserving, as a trained model's activations are. At torch's default each bias-free Linear shrinks
    its input by sqrt(3): through FLUX.2's timestep MLP and modulation every block's gates start ~0.05,
    and the prompt, which reaches the image only through those gated attentions (no pooled text), moved
    the tiny model's velocity by 0.1% (tests/test_flux2_adapter.py; configs/flux2_tiny.yaml)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(3**0.5)
    return model


class Flux2Adapter(TwoPassCFG, PackedLatentAdapter):
    name = "flux2"
    # Flow-Factory src/flow_factory/models/flux/flux2_klein.py ``default_target_modules``: the
    # double-stream attention and feed-forwards, the single-stream fused input projection. Its
    # "attn.to_out" (the single-stream output Linear) is left out: as a suffix it also names the
    # double-stream blocks' ``to_out`` ModuleList, which peft refuses
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    )
    pipeline_class = "Flux2KleinPipeline"  # [dev]: Flux2Pipeline (set at build)
    transformer_class = "Flux2Transformer2DModel"
    published = FLUX2_KLEIN_4B
    presets = {"tiny": (TINY_KLEIN, TINY_VAE), "tiny_dev": (TINY_DEV, TINY_VAE)}
    is_distilled = False  # a step-distilled [klein] checkpoint never runs CFG

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

        if preset not in self.presets:
            raise UserError(f"model.preset: unknown preset '{preset}' for flux2 (available: tiny, tiny_dev)")
        transformer, vae = self.presets[preset]
        with seeded(1234):
            self.transformer = unit_scale(Flux2Transformer2DModel(**transformer))
            self.vae = AutoencoderKLFlux2(**vae).eval()
            bn = self.vae.bn  # non-trivial statistics, so that decode's de-normalisation is exercised
            bn.running_mean.copy_(0.1 * torch.randn_like(bn.running_mean))
            bn.running_var.copy_(0.5 + torch.rand_like(bn.running_var))
        lm = TinyLM.mistral if transformer["guidance_embeds"] else TinyLM.qwen3
        # variance-preserving layers: the padded positions after the prompt, which FLUX.2 attends
        # unmasked, carry it, as the chat template's tokens after it do in the real pipeline
        width, depth = TINY_TEXT_WIDTH, TINY_TEXT_DEPTH
        self.text = lm(width, depth, self.cfg.max_text_len, init_std=width**-0.5)
        self.text_layers = (1, 2, 3)  # 1/4, 1/2, 3/4 of the depth
        self.pipe = None
        self.scheduler = self.flow_scheduler({"shift": 3.0, "use_dynamic_shifting": True})
        self.preview = LatentRGBDecoder(self.transformer.config.in_channels, 2 * self.vae_scale)
        self._set_variant()

    def build_pretrained(self, path: Path) -> None:
        import diffusers

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers FLUX.2 checkpoint (no model_index.json)"
            )
        index = (path / "model_index.json").read_text()
        cls = "Flux2KleinPipeline" if "Flux2KleinPipeline" in index else "Flux2Pipeline"
        self.pipe = getattr(diffusers, cls).from_pretrained(path, torch_dtype=self.dtype)
        self.place_pipe()  # model.offload_text_encoders: the encoder stays on the CPU
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.is_distilled = bool(getattr(self.pipe.config, "is_distilled", False))
        self.text = None
        self._set_variant()

    def _set_variant(self) -> None:
        self.dev = bool(self.transformer.config.guidance_embeds)
        self.pipeline_class = "Flux2Pipeline" if self.dev else "Flux2KleinPipeline"

    def check_shapes(self) -> None:
        h, w = self.cfg.height, self.cfg.width
        unit = 16 if self.cfg.pretrained is not None else 4
        if h % unit or w % unit:
            raise UserError(f"model.height/width: FLUX.2 needs multiples of {unit} pixels, got {h}x{w}")
        if self.cfg.frames is not None:
            raise UserError("model.frames: FLUX.2 is an image model; leave frames unset")

    # ------------------------------------------------------------------ cost
    @classmethod
    def published_model(cls, model) -> PublishedModel:
        dev = model.pretrained is not None and "dev" in Path(model.pretrained).name.lower()
        return FLUX2_DEV if dev else FLUX2_KLEIN_4B

    @classmethod
    def vae_factors(cls, vae_config) -> tuple[int, int]:
        return 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1), 1

    @classmethod
    def guidance_passes(cls, guidance: float) -> int:
        return 2 if guidance > 1 else 1  # [klein]'s CFG (the published default)

    @classmethod
    def passes_for(cls, transformer_config, guidance: float) -> int:
        return 1 if transformer_config.get("guidance_embeds") else cls.guidance_passes(guidance)

    @classmethod
    def forward_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        d, n, r = hidden_size(c), nx + nt, c.get("mlp_ratio", 3.0)
        cin, f = c["in_channels"], int(d * r)
        n_emb = 2 if c.get("guidance_embeds") else 1  # timestep (+ guidance) MLPs: 256 -> d -> d
        embed = 2 * cin * d * nx + 2 * c["joint_attention_dim"] * d * nt + 2 * n_emb * (256 * d + d * d)
        mods = 2 * d * (6 * d + 6 * d + 3 * d)  # the shared modulations: double img / txt, single
        # double: qkv + out (4 d^2) and a SwiGLU (in: d -> 2f, out: f -> d) per stream and token
        double = c["num_layers"] * (2 * (4 * d * d + 3 * d * f) * n + 4 * n * n * d)
        # single: fused qkv + SwiGLU in (d -> 3d + 2f), fused out (d + f -> d)
        single = c["num_single_layers"] * (2 * (d * (3 * d + 2 * f) + (d + f) * d) * n + 4 * n * n * d)
        return embed + mods + double + single + 2 * 2 * d * d + 2 * d * cin * nx

    # ------------------------------------------------------------------ hooks
    def sigmas(self, num_steps: int) -> torch.Tensor:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        sched = self.scheduler
        if self.sampling.shift is not None:  # a user-fixed shift replaces the empirical one
            sched = self.flow_scheduler({"shift": self.sampling.shift, "use_dynamic_shifting": False})
        mu = compute_empirical_mu(image_seq_len=self.latent_shape()[0], num_steps=num_steps)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return sched.sigmas.to(torch.float32).clone()

    def _encode(self, prompts: list[str]) -> torch.Tensor:
        """(B, max_text_len, 3 x LM width): three layers' hidden states per token, padding included."""
        if self.pipe is None:
            states, _ = self.text.hidden_states(prompts)
            out = torch.stack([states[k] for k in self.text_layers], dim=1)  # as the pipelines stack
            b, layers, length, width = out.shape
            return out.permute(0, 2, 1, 3).reshape(b, length, layers * width).to(self.device)
        with torch.no_grad():
            embeds, _ = self.pipe.encode_prompt(
                prompt=list(prompts), device=self.device, max_sequence_length=self.cfg.max_text_len
            )
        return embeds

    def encode_prompts(self, prompts: list[str]) -> Cond:
        batched = {"prompt_embeds": self._encode(prompts)}
        if self.uses_cfg():  # Flux2KleinPipeline's negative prompt is "" (the config may set one)
            neg = self._encode([self.sampling.negative_prompt or ""])
            batched["neg_prompt_embeds"] = neg.expand(len(prompts), -1, -1).clone()
        return Cond(batched)

    def ids(self, text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(txt_ids (L, 4): (0, 0, 0, l); img_ids (rows*cols, 4): (0, row, col, 0)), as the pipeline."""
        rows, cols = self._grid()
        r = torch.arange(1)
        txt = torch.cartesian_prod(r, r, r, torch.arange(text_len))
        img = torch.cartesian_prod(r, torch.arange(rows), torch.arange(cols), r)
        return txt.to(self.device), img.to(self.device)

    # ------------------------------------------------------------------ guidance (adapters/guidance.py)
    def uses_cfg(self) -> bool:
        return not self.dev and not self.is_distilled and self.sampling.guidance > 1

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        # the pipeline: t.to(latents dtype) / 1000, its latents in the text embeddings' (model) dtype
        return (sigma.to(torch.float32) * 1000).to(self.dtype) / 1000

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        return {"embeds": cond.batched["neg_prompt_embeds" if negative else "prompt_embeds"]}

    def forward_pass(
        self, latents: torch.Tensor, t: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        b = latents.shape[0]
        guidance = None
        if self.dev:  # [dev]: the embedded guidance scale, fp32 as the pipeline builds it
            guidance = torch.full((b,), self.sampling.guidance, device=self.device, dtype=torch.float32)
        txt_ids, img_ids = self.ids(inputs["embeds"].shape[1])
        with self.autocast():
            out = self.transformer(
                hidden_states=latents.to(self.dtype),
                timestep=t,
                guidance=guidance,
                encoder_hidden_states=inputs["embeds"].to(self.dtype),
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
        return out[:, : latents.shape[1]].float()

    def guide(self, v_cond: torch.Tensor, v_unc: torch.Tensor) -> torch.Tensor:
        return v_unc + self.sampling.guidance * (v_cond - v_unc)

    # ------------------------------------------------------------------ decode
    def to_spatial(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, rows*cols, 4C) tokens -> the patchified (B, 4C, rows, cols) the VAE's batch norm reads."""
        rows, cols = self._grid()
        return latents.transpose(1, 2).reshape(latents.shape[0], -1, rows, cols)

    def vae_decode(self, x: torch.Tensor) -> torch.Tensor:
        bn, eps = self.vae.bn, self.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(x.device, x.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(x.device, x.dtype)
        x = x * std + mean  # the pipeline's op order, then un-patchify 2x2
        b, c4, rows, cols = x.shape
        x = (
            x.reshape(b, c4 // 4, 2, 2, rows, cols)
            .permute(0, 1, 4, 2, 5, 3)
            .reshape(b, c4 // 4, 2 * rows, 2 * cols)
        )
        image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

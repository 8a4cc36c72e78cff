"""Z-Image (``ZImageTransformer2DModel``): single-stream DiT over a list of samples, Qwen3 text.

Mirrors ``diffusers.ZImagePipeline``: spatial latents (B, C, H, W) go in as a list of (C, 1, H, W)
samples and the caption as a list of its valid tokens (the second-to-last Qwen3 hidden state);
the sigmas are ``linspace(1, 1/N, N)`` through the scheduler's shift (Turbo: fixed 3.0); the
timestep is ``(1000 - 1000 sigma) / 1000`` in fp32; the model predicts minus the velocity; CFG runs
when ``guidance > 0`` as ``pos + g (pos - neg)`` (Turbo is distilled for ``guidance 0``: one pass).
Details: docs/modules.md, `digenrl.adapters.z_image`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from digenrl.adapters.base import Adapter, seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import PublishedModel, Tokens
from digenrl.adapters.guidance import TwoPassCFG
from digenrl.adapters.packed import calculate_shift
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_lm import TinyLM
from digenrl.errors import UserError

TINY_TRANSFORMER = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=32,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=16,  # the tiny Qwen3's width
    axes_dims=[8, 4, 4],
    axes_lens=[256, 32, 32],
)
# FLUX.1's VAE layout (Z-Image ships it: 16 channels, a scale and a shift) at 2x spatial compression
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
    scaling_factor=0.3611,
    shift_factor=0.1159,
)
# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

# Tongyi-MAI/Z-Image-Turbo: transformer/config.json; FLUX.1's VAE; Qwen3-4B as the text encoder
Z_IMAGE_TURBO = PublishedModel(
    label="Z-Image-Turbo (6B)",
    transformer=dict(
        all_patch_size=[2],
        all_f_patch_size=[1],
        in_channels=16,
        dim=3840,
        n_layers=30,
        n_refiner_layers=2,
        n_heads=30,
        n_kv_heads=30,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=2560,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[32, 48, 48],
        axes_lens=[1536, 512, 512],
    ),
    vae=dict(block_out_channels=[128, 256, 512, 512]),
    vae_params=83.8e6,
    vae_decode_flops_per_px=6.6e6,
    text_encoder_params=4.02e9,  # Qwen3-4B
)


class ZImageAdapter(TwoPassCFG, Adapter):
    name = "z_image"
    # Flow-Factory src/flow_factory/models/z_image/z_image.py ``default_target_modules``
    default_lora_targets = (
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
    pipeline_class = "ZImagePipeline"
    transformer_class = "ZImageTransformer2DModel"
    published = Z_IMAGE_TURBO
    presets = {"tiny": (TINY_TRANSFORMER, TINY_VAE)}

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKL, ZImageTransformer2DModel

        if preset != "tiny":
            raise UserError(f"model.preset: unknown preset '{preset}' for z_image (available: tiny)")
        with seeded(1234):
            self.transformer = ZImageTransformer2DModel(**TINY_TRANSFORMER)
            self.vae = AutoencoderKL(**TINY_VAE).eval()
        self.text = TinyLM.qwen3(TINY_TRANSFORMER["cap_feat_dim"], 3, self.cfg.max_text_len)
        self.pipe = None
        self.scheduler = self.flow_scheduler(Z_IMAGE_SCHEDULER)
        self.preview = LatentRGBDecoder(self.vae.config.latent_channels, self.vae_scale)

    def build_pretrained(self, path: Path) -> None:
        from diffusers import ZImagePipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers Z-Image checkpoint (no model_index.json)"
            )
        self.pipe = ZImagePipeline.from_pretrained(path, torch_dtype=self.dtype)
        self.place_pipe()  # model.offload_text_encoders: the encoder stays on the CPU
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = None

    @property
    def vae_scale(self) -> int:
        return self.vae_factors(self.vae.config)[0]

    def check_shapes(self) -> None:
        # the VAE's compression, then 2x2 patches: the pipeline rejects other sizes
        h, w = self.cfg.height, self.cfg.width
        unit = 16 if self.cfg.pretrained is not None else 4
        if h % unit or w % unit:
            raise UserError(f"model.height/width: Z-Image needs multiples of {unit} pixels, got {h}x{w}")
        if self.cfg.frames is not None:
            raise UserError("model.frames: Z-Image is an image model; leave frames unset")

    # ------------------------------------------------------------------ cost
    @classmethod
    def vae_factors(cls, vae_config) -> tuple[int, int]:
        return 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1), 1

    @classmethod
    def latent_shape_for(cls, model, transformer_config, vae_config) -> tuple[int, ...]:
        s = cls.vae_factors(vae_config)[0]
        return (transformer_config["in_channels"], model.height // s, model.width // s)

    @classmethod
    def sequence_tokens(cls, transformer_config, latent_shape) -> int:
        p = transformer_config["all_patch_size"][0]
        return (latent_shape[1] // p) * (latent_shape[2] // p)

    @classmethod
    def width(cls, transformer_config) -> int:
        return transformer_config["dim"]

    @classmethod
    def blocks(cls, transformer_config) -> int:
        return transformer_config["n_layers"] + 2 * transformer_config.get("n_refiner_layers", 2)

    @classmethod
    def guidance_passes(cls, guidance: float) -> int:
        return 2 if guidance > 0 else 1

    @classmethod
    def forward_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        d, p, r = c["dim"], c["all_patch_size"][0], c.get("n_refiner_layers", 2)
        h, m, cin = int(d / 3 * 8), min(d, 256), c["in_channels"]

        def block(n: int, modulated: bool) -> float:  # qkv + out, SwiGLU, attention, adaLN (4d)
            return 2 * (4 * d * d + 3 * d * h) * n + 4 * n * n * d + (2 * m * 4 * d if modulated else 0)

        embed = 2 * p * p * cin * d * nx + 2 * c["cap_feat_dim"] * d * nt + 2 * (256 * 1024 + 1024 * m)
        layers = r * block(nx, True) + r * block(nt, False) + c["n_layers"] * block(nx + nt, True)
        return embed + layers + 2 * m * d + 2 * d * p * p * cin * nx

    @classmethod
    def attention_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        r, d = c.get("n_refiner_layers", 2), c["dim"]
        return 4 * d * (r * (nx * nx + nt * nt) + c["n_layers"] * (nx + nt) ** 2)

    # ------------------------------------------------------------------ hooks
    def latent_shape(self) -> tuple[int, ...]:
        return self.latent_shape_for(self.cfg, self.transformer.config, self.vae.config)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        c = self.scheduler.config
        seq = self.sequence_tokens(self.transformer.config, self.latent_shape())
        mu = calculate_shift(
            seq,
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        sched = self.scheduler
        if self.sampling.shift is not None:  # a user-fixed shift replaces the model's own
            sched = self.flow_scheduler({"shift": self.sampling.shift, "use_dynamic_shifting": False})
        # the pipeline's get_default_z_image_sigmas: torch's linspace, as a list
        sched.set_timesteps(sigmas=torch.linspace(1.0, 1 / num_steps, num_steps).tolist(), mu=mu)
        return sched.sigmas.to(torch.float32).clone()

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (B, L, D), mask (B, L) long), L = model.max_text_len: the valid tokens of each
        caption (Qwen3's second-to-last hidden state) then zeros, so that Conds concatenate."""
        L = self.cfg.max_text_len
        if self.pipe is None:
            states, mask = self.text.hidden_states(prompts)
            return states[-2].to(self.device), mask.to(self.device)
        with torch.no_grad():
            listed, _ = self.pipe.encode_prompt(
                prompt=list(prompts),
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=L,
            )
        embeds = torch.stack([F.pad(e, (0, 0, 0, L - e.shape[0])) for e in listed])
        mask = torch.stack([torch.arange(L, device=self.device) < e.shape[0] for e in listed]).long()
        return embeds, mask

    def encode_prompts(self, prompts: list[str]) -> Cond:
        embeds, mask = self._encode(prompts)
        batched = {"prompt_embeds": embeds, "mask": mask}
        if self.uses_cfg():  # the pipeline's default negative prompt is ""
            neg, neg_mask = self._encode([self.sampling.negative_prompt or ""])
            batched["neg_prompt_embeds"] = neg.expand(len(prompts), -1, -1).clone()
            batched["neg_mask"] = neg_mask.expand(len(prompts), -1).clone()
        return Cond(batched)

    # ------------------------------------------------------------------ CFG (adapters/guidance.py)
    def uses_cfg(self) -> bool:
        return self.sampling.guidance > 0  # ZImagePipeline.do_classifier_free_guidance

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        # the pipeline: t = scheduler timestep (1000 sigma), then (1000 - t) / 1000, fp32 at any dtype
        return (1000 - sigma.to(torch.float32) * 1000) / 1000

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        b = cond.batched
        if negative:
            return {"embeds": b["neg_prompt_embeds"], "mask": b["neg_mask"]}
        return {"embeds": b["prompt_embeds"], "mask": b["mask"]}

    def forward_pass(
        self, latents: torch.Tensor, t: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One transformer pass over a batch, as velocities (the model predicts their negative)."""
        x = list(latents.to(self.dtype).unsqueeze(2).unbind(0))
        caps = [e[m.bool()].to(self.dtype) for e, m in zip(inputs["embeds"], inputs["mask"])]
        with self.autocast():
            out = self.transformer(x, t, caps, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def guide(self, v_cond: torch.Tensor, v_unc: torch.Tensor) -> torch.Tensor:
        return v_cond + self.sampling.guidance * (v_cond - v_unc)

    def vae_decode(self, x: torch.Tensor) -> torch.Tensor:
        vc = self.vae.config
        x = x.to(self.vae.dtype) / vc.scaling_factor + vc.shift_factor  # the pipeline's op order
        image = self.vae.decode(x, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

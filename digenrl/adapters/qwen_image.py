"""Qwen-Image (``QwenImageTransformer2DModel``): packed 2x2 latent tokens, true CFG with norm rescale.

Details: docs/modules.md, `digenrl.adapters.qwen_image`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from digenrl.adapters.base import seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import PublishedModel, Tokens, hidden_size
from digenrl.adapters.guidance import TwoPassCFG
from digenrl.adapters.packed import PackedLatentAdapter
from digenrl.adapters.pixels import unit_range
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_text import HashTextEncoder
from digenrl.errors import UserError

TINY_TRANSFORMER = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=16,
    guidance_embeds=False,
    axes_dims_rope=(8, 4, 4),
)
# diffusers' own dummy VAE (z_dim = out_channels = 4, spatial factor 2**len(temperal_downsample) = 4);
# non-trivial latents_mean/std so that decode's de-normalisation is exercised
TINY_VAE = dict(
    base_dim=24,
    z_dim=4,
    dim_mult=[1, 2, 4],
    num_res_blocks=1,
    temperal_downsample=[False, True],
    latents_mean=[0.1, -0.2, 0.05, 0.0],
    latents_std=[1.5, 0.8, 1.2, 1.0],
)
# Qwen-Image's own scheduler_config.json: dynamic (exponential) shift, stretched to end at 0.02
QWEN_SCHEDULER = dict(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)

# Qwen/Qwen-Image: transformer/config.json, and the VAE's three temporal-downsample stages (8x)
QWEN_IMAGE = PublishedModel(
    label="Qwen-Image (20B)",
    transformer=dict(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=60,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=3584,
        guidance_embeds=False,
        axes_dims_rope=[16, 56, 56],
    ),
    vae=dict(temperal_downsample=[False, True, True]),
    vae_params=127e6,
    vae_decode_flops_per_px=10e6,
    text_encoder_params=8.29e9,  # Qwen2.5-VL-7B
)


def valid_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Each row's valid text length (its last valid position + 1; 0 for none), on the host: read once
    at encoding, so that no forward reads the device mask."""
    pos = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * pos).amax(1).cpu()


class QwenImageAdapter(TwoPassCFG, PackedLatentAdapter):
    name = "qwen_image"
    trims_text = True  # each forward runs its rows' longest valid text (pass_inputs)
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    pipeline_class = "QwenImagePipeline"
    transformer_class = "QwenImageTransformer2DModel"
    published = QWEN_IMAGE
    presets = {"tiny": (TINY_TRANSFORMER, TINY_VAE)}

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

        if preset != "tiny":
            raise UserError(f"model.preset: unknown preset '{preset}' for qwen_image (available: tiny)")
        with seeded(1234):
            self.transformer = QwenImageTransformer2DModel(**TINY_TRANSFORMER)
            self.vae = AutoencoderKLQwenImage(**TINY_VAE).eval()
        self.text = HashTextEncoder(self.transformer.config.joint_attention_dim, self.cfg.max_text_len)
        self.pipe = None
        self.scheduler = self.flow_scheduler(QWEN_SCHEDULER)
        self.preview = LatentRGBDecoder(self.vae.config.z_dim, self.vae_scale)

    def build_pretrained(self, path: Path) -> None:
        from diffusers import QwenImagePipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers Qwen-Image checkpoint (no model_index.json)"
            )
        self.pipe = QwenImagePipeline.from_pretrained(path, torch_dtype=self.dtype)  # Qwen2.5-VL text encoder
        self.place_pipe()  # model.offload_text_encoders: the encoders stay on the CPU
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = None

    def check_shapes(self) -> None:
        # 2x2 packing on top of the VAE's compression: pixels must divide by vae_scale * 2 (16 for the
        # real VAE, 8 for the tiny one); the pipeline would silently round the size down instead
        h, w = self.cfg.height, self.cfg.width
        unit = 16 if self.cfg.pretrained is not None else 8
        if h % unit or w % unit:
            raise UserError(f"model.height/width: Qwen-Image needs multiples of {unit} pixels, got {h}x{w}")
        if self.cfg.frames is not None:
            raise UserError("model.frames: Qwen-Image is an image model; leave frames unset")

    # ------------------------------------------------------------------ cost
    @classmethod
    def vae_factors(cls, vae_config) -> tuple[int, int]:
        return 2 ** len(
            vae_config.get("temperal_downsample", [0] * 3)
        ), 1  # as the pipeline's vae_scale_factor

    @classmethod
    def guidance_passes(cls, guidance: float) -> int:
        return 2 if guidance > 1.0 else 1  # true CFG

    @classmethod
    def forward_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        d, n = hidden_size(c), nx + nt
        cin, p = c["in_channels"], c.get("patch_size", 2)
        cout = c.get("out_channels") or cin // (p * p)
        embed = 2 * cin * d * nx + 2 * c["joint_attention_dim"] * d * nt + 2 * (256 * d + d * d)
        blocks = c["num_layers"] * (2 * 12 * d * d * n + 4 * n * n * d + 2 * 2 * 6 * d * d)
        return embed + blocks + 2 * 2 * d * d + 2 * d * p * p * cout * nx

    # ------------------------------------------------------------------ hooks
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (B, L, D), mask (B, L) long) padded / truncated to a fixed L = model.max_text_len,
        so that Conds from different rollout batches concatenate (padding is masked out)."""
        L = self.cfg.max_text_len
        if self.pipe is None:
            t = self.text(prompts)
            return t["embeds"].to(self.device), t["mask"].to(self.device)
        with torch.no_grad():
            embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device, max_sequence_length=L)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
        pad = L - embeds.shape[1]
        return F.pad(embeds, (0, 0, 0, pad)), F.pad(mask.long(), (0, pad))

    def encode_prompts(self, prompts: list[str]) -> Cond:
        embeds, mask = self._encode(prompts)
        batched = {"prompt_embeds": embeds, "mask": mask}
        host = {"text_len": valid_lengths(mask)}
        if self.sampling.guidance > 1:  # true CFG: the negative prompt travels with every sample
            # the pipeline's docs use " " as the empty negative prompt
            neg, neg_mask = self._encode([self.sampling.negative_prompt or " "])
            batched["neg_prompt_embeds"] = neg.expand(len(prompts), -1, -1).clone()
            batched["neg_mask"] = neg_mask.expand(len(prompts), -1).clone()
            host["neg_text_len"] = valid_lengths(neg_mask).expand(len(prompts)).clone()
        return Cond(batched, host=host)

    def img_shapes(self, batch: int) -> list[list[tuple[int, int, int]]]:
        return [[(1, *self._grid())]] * batch

    # ------------------------------------------------------------------ true CFG (adapters/guidance.py)
    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        # QwenImagePipeline: t.to(latents.dtype) / 1000, t = 1000 sigma (fp32), latents in the model dtype
        return (sigma.to(torch.float32) * 1000).to(self.dtype) / 1000

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        """One pass's text, trimmed to its rows' longest valid text (the pipeline strips the padding
        too; the padding is masked, so the output is the same); batched CFG: both passes to the longer."""
        b, side = cond.batched, "neg_" if negative else ""
        n = self.text_tokens(cond, side)
        if self.uses_cfg() and self.cfg_batched:
            n = max(n, self.text_tokens(cond, "" if negative else "neg_"))
        return {"embeds": b[f"{side}prompt_embeds"][:, :n], "mask": b[f"{side}mask"][:, :n]}

    def text_tokens(self, cond: Cond, side: str) -> int:
        """Text tokens one pass runs: the rows' longest valid text, rounded up to the transformer's
        ``sp_degree`` (sequence parallelism splits the text over its ranks), at most the stored length."""
        full = cond.batched[f"{side}mask"].shape[1]
        n = cond.text_len(f"{side}text_len", full)
        multiple = getattr(self.transformer, "sp_degree", 1)  # sequence parallelism splits the text too
        return min(full, -(-n // multiple) * multiple)

    def forward_pass(
        self, latents: torch.Tensor, t: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One transformer pass over a batch (one side of the CFG pair, or both batched), fp32 out."""
        with self.autocast():
            out = self.transformer(
                hidden_states=latents.to(self.dtype),
                timestep=t,
                encoder_hidden_states=inputs["embeds"].to(self.dtype),
                # always the mask (the pipeline drops an all-valid one: the same attention, and deciding
                # would read the mask on the host every forward)
                encoder_hidden_states_mask=inputs["mask"],
                img_shapes=self.img_shapes(latents.shape[0]),
                return_dict=False,
            )[0]
        return out.float()

    def guide(self, v_cond: torch.Tensor, v_unc: torch.Tensor) -> torch.Tensor:
        # true CFG, then rescale to the conditional prediction's norm per token (over the channel dim)
        v_cfg = v_unc + self.sampling.guidance * (v_cond - v_unc)
        return v_cfg * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(v_cfg, dim=-1, keepdim=True))

    def vae_decode(self, x: torch.Tensor) -> torch.Tensor:
        vc = self.vae.config
        x = x[:, :, None].to(self.vae.dtype)  # the VAE is video-style: one frame
        mean = torch.tensor(vc.latents_mean).view(1, vc.z_dim, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(vc.latents_std).view(1, vc.z_dim, 1, 1, 1).to(x.device, x.dtype)
        x = x / inv_std + mean  # the pipeline's exact op order
        image = self.vae.decode(x, return_dict=False)[0][:, :, 0]  # drop the frame dim
        return unit_range(image)

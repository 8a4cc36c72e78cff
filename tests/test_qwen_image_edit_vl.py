"""Qwen-Image-Edit's real Qwen2.5-VL conditioning, end to end on the CPU.

A tiny diffusers checkpoint is written here (random init, nothing downloaded): a Qwen2.5-VL text
encoder whose hidden size is the tiny transformer's ``joint_attention_dim``, a byte-level
``Qwen2Tokenizer`` with Qwen's special tokens (no merges: the pipeline's system prompt is ~300 tokens,
more than the 64 it drops), Qwen2-VL's image processor (PIL backend) and the tiny preset's transformer,
VAE and scheduler, laid out as the published checkpoint is (``processor/`` with the video
processor's config, which needs torchvision to load). DigenRL loads it as ``model.pretrained``
through a Policy; its sampler at noise level 0 must follow ``QwenImageEditPipeline.__call__`` given the
prompt string and the input image, which runs the Qwen2.5-VL encoding itself (the image resized for
the encoder, the template, the dropped prefix, the masks), with and without true CFG.

Both sides condition at a 64 x 64 area instead of the pipeline's 1024^2 (which the tiny VAE would make
16k image tokens): the adapter's ``CONDITION_AREA`` and the pipeline's ``calculate_dimensions``.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from PIL import Image

from digenrl.adapters.qwen_image import QWEN_SCHEDULER, TINY_TRANSFORMER, TINY_VAE
from digenrl.config.run import load_config
from tests.test_edit_adapters import edit_images, trajectory

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
AREA = 64 * 64  # the conditioning area of both sides: a 64 x 64 image for the VAE and the encoder
PROMPTS = ["make the apple red", "a blue sky"]  # different lengths: the batched encoding pads
NEGATIVE = "blurry"


def image_only_processor(image_processor, tokenizer):
    """A plain ``Qwen2VLProcessor`` without a video processor, for the reference pipeline: transformers'
    class check of each sub-processor is skipped while it is built (without torchvision the check
    cannot look the video processor's class up, and None is none)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def write_checkpoint(out: Path):
    """A tiny Qwen-Image-Edit checkpoint at ``out``; returns the in-memory processor it was saved from."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageTransformer2DModel,
    )
    from tokenizers import pre_tokenizers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # byte-level BPE with no merges: every byte of the text is a token, the special tokens are one each
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], additional_special_tokens=SPECIAL)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    d = TINY_TRANSFORMER["joint_attention_dim"]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=d,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[1, 1, 2]),  # head_dim 8
    )
    # 8 px patches merged 2x2: a 64 x 64 image is 16 tokens; windows of 2 x 2 merged patches, then a
    # full-attention block
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=32,
        fullatt_block_indexes=[1],
        out_hidden_size=d,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=128 * 128
    )
    torch.manual_seed(0)
    pipe = QwenImageEditPipeline(
        transformer=QwenImageTransformer2DModel(**TINY_TRANSFORMER),
        vae=AutoencoderKLQwenImage(**TINY_VAE),
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(),
        tokenizer=tokenizer,
        processor=None,  # a processor without its video half cannot save itself: written below
    )
    pipe.save_pretrained(out)
    # processor/ as the published checkpoint has it: tokenizer, image and video processor configs
    folder = out / "processor"
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    video = {k: pre[k] for k in ("patch_size", "merge_size", "temporal_patch_size", "size")}
    video.update(video_processor_type="Qwen2VLVideoProcessor", processor_class="Qwen2VLProcessor")
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return image_only_processor(image_processor, tokenizer)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_image_edit_vl") / "ckpt"
    return path, write_checkpoint(path)


@pytest.fixture
def small_area(monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as module

    import digenrl.adapters.qwen_image_edit as adapter_module

    real = module.calculate_dimensions
    monkeypatch.setattr(module, "calculate_dimensions", lambda _area, ratio: real(AREA, ratio))
    monkeypatch.setattr(adapter_module, "CONDITION_AREA", AREA)


def test_the_adapter_builds_the_processor_exactly_where_the_stock_pipeline_cannot(checkpoint):
    """Why the adapter builds the processor itself: the checkpoint's video processor needs torchvision.
    Without it the stock pipeline fails and the adapter supplies an image-only processor; with it the
    stock pipeline loads and the adapter leaves the processor to it."""
    from diffusers import QwenImageEditPipeline
    from transformers.utils import is_torchvision_available

    from digenrl.adapters.qwen_vl_processor import ImageOnlyQwen2VLProcessor, processor_without_video

    ours = processor_without_video(checkpoint[0])
    if is_torchvision_available():
        assert ours == {}
        assert QwenImageEditPipeline.from_pretrained(checkpoint[0]).processor is not None
        return
    assert isinstance(ours["processor"], ImageOnlyQwen2VLProcessor)
    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
        QwenImageEditPipeline.from_pretrained(checkpoint[0])


@pytest.mark.parametrize("guidance", [1.0, 4.0])  # no CFG / true CFG with a negative prompt
def test_sampler_equals_the_pipeline_encoding_prompt_and_image(checkpoint, small_area, tmp_path, guidance):
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2_5_VLForConditionalGeneration

    from digenrl.policy.model import Policy

    path, processor = checkpoint
    sets = [
        f"model.pretrained={path}",
        "model.height=32",
        "model.width=32",
        "model.max_text_len=320",
        f"sampling.guidance={guidance}",
        f"sampling.negative_prompt={NEGATIVE}",
    ]
    cfg = load_config(ROOT / "configs" / "qwen_image_edit_tiny.yaml", sets)
    ad = Policy(cfg, trainable=False).adapter
    assert isinstance(ad.pipe.text_encoder, Qwen2_5_VLForConditionalGeneration) and ad.text is None
    images = edit_images(tmp_path, 32, 32)
    cond = ad.cond_for(PROMPTS, images)
    b = cond.batched
    # each instruction's tokens after the pipeline drops the template's first 64, with the image's 16
    template = ad.pipe.prompt_template_encode
    for i, prompt in enumerate(PROMPTS):
        n = len(processor.tokenizer(template.format(prompt))["input_ids"]) - 1 + 16 - 64
        assert b["mask"][i].sum() == n and not b["mask"][i, n:].any()
    assert b["image_latents"].shape == (2, (64 // 8) ** 2, 16)  # the 64 x 64 conditioning image
    assert ("neg_prompt_embeds" in b) == (guidance > 1)
    # the encoder sees the image: the same instructions on the other images embed differently
    swapped = ad.cond_for(PROMPTS, images[::-1]).batched
    assert (swapped["prompt_embeds"] - b["prompt_embeds"]).abs().max() > 1e-4

    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = trajectory(ad, cond, noise, 4)
    assert (ours[:, -1] - noise).abs().mean() > 1e-2
    # the reference: the checkpoint loaded again, with the processor it was written from
    pipe = QwenImageEditPipeline.from_pretrained(path, processor=processor)
    pipe.set_progress_bar_config(disable=True)
    worst = 0.0
    for i in range(2):
        seen = []
        pipe(
            image=Image.open(images[i]),
            prompt=PROMPTS[i],
            negative_prompt=NEGATIVE if guidance > 1 else None,
            true_cfg_scale=guidance,
            latents=noise[i : i + 1].clone(),
            num_inference_steps=4,
            height=32,
            width=32,
            output_type="latent",
            callback_on_step_end=lambda p, j, t, kw: seen.append(kw["latents"].clone()) or {},
        )
        theirs = torch.stack(seen, 1)
        worst = max(worst, (ours[i : i + 1, 1:] - theirs).abs().max().item())
        assert torch.allclose(ours[i : i + 1, 1:], theirs, atol=1e-5, rtol=1e-5), worst
    print(f"guidance {guidance}: max |ours - pipeline| = {worst:.2e}")

"""Qwen-Image's forwards run their rows' longest valid text, not ``model.max_text_len`` (issue 51): the
same velocity as the padded call (the padding is masked), the stock pipeline's trajectory on the text it
makes itself (stripped to the batch's longest), and the rollout's log-probs recomputed by a train chunk
that mixes prompts of other lengths."""

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.adapters.cond import Cond
from digenrl.algorithms.sde import recompute_logprob, sample

QWEN = ("model.adapter=qwen_image", "sampling.guidance=4.0", "model.max_text_len=32")
SHORT, LONG = "a red apple", "a blue sky over a green field with white clouds and a small red house"


def text_seen(ad) -> list[int]:
    """The text length of every transformer call from now on (a forward pre-hook)."""
    seen = []
    ad.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["encoder_hidden_states"].shape[1]), with_kwargs=True
    )
    return seen


def edit_cond(ad, tmp_path, prompts):
    from tests.test_edit_adapters import edit_images

    return ad.encode_prompts(prompts, edit_images(tmp_path, ad.cfg.height, ad.cfg.width))


@pytest.mark.parametrize("family", ["qwen_image", "qwen_image_edit"])
@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_trimmed_velocity_equals_the_padded_call(tiny_cfg, tmp_path, family, mode):
    size = ("model.height=32", "model.width=32")
    cfg = tiny_cfg(
        *QWEN, *size, f"model.adapter={family}", f"sampling.cfg_batching={mode}", "model.lora=null"
    )
    ad = build_adapter(cfg.model, cfg.sampling)
    prompts = [SHORT, LONG]
    cond = edit_cond(ad, tmp_path, prompts) if ad.edits else ad.encode_prompts(prompts)
    words = len(LONG.split()) + (1 if ad.edits else 0)  # the tiny edit encoder: an image token first
    assert cond.host["text_len"].tolist() == [len(SHORT.split()) + ad.edits, words]
    x = ad.initial_noise(2, torch.Generator().manual_seed(0))
    sigma = ad.sigma_input(torch.tensor([0.9, 0.4]))
    seen = text_seen(ad)
    with torch.no_grad():
        trimmed = ad.velocity(x, sigma, cond)
        runs = list(seen)
        padded = ad.velocity(x, sigma, Cond(cond.batched))  # no host lengths: the stored max_text_len
    neg = int(cond.host["neg_text_len"].max())
    assert runs == ([max(words, neg)] if mode == "batched" else [words, neg])
    assert seen[len(runs) :] == [cfg.model.max_text_len] * len(runs) and words < cfg.model.max_text_len
    assert torch.allclose(trimmed, padded, atol=1e-6, rtol=1e-5), (trimmed - padded).abs().max()
    # one row alone runs its own length: the short prompt's forward is shorter than the pair's
    seen.clear()
    with torch.no_grad():
        alone = ad.velocity(x[:1], sigma[:1], cond.select(torch.tensor([0])))
    assert seen[0] == max(len(SHORT.split()) + ad.edits, neg if mode == "batched" else 0)
    assert torch.allclose(alone, trimmed[:1], atol=1e-6, rtol=1e-5)


def test_pipeline_on_its_own_stripped_text_equals_the_trimmed_sampler(tiny_cfg):
    """QwenImagePipeline given the text as its encode_prompt makes it (each batch's padding stripped to
    its longest prompt; the negative to its own length) and DigenRL's trimmed sampler: one trajectory."""
    from tests.test_qwen_adapter import stock_pipeline

    cfg = tiny_cfg(*QWEN)
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts([SHORT, LONG])
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = sample(ad, cond, noise, ad.sigmas(4), "flow_grpo", 0.0, None).latents
    n, m = int(cond.host["text_len"].max()), int(cond.host["neg_text_len"].max())
    pipe = stock_pipeline(ad)
    b, seen = cond.batched, []
    pipe(
        prompt_embeds=b["prompt_embeds"][:, :n],
        prompt_embeds_mask=b["mask"][:, :n],
        negative_prompt_embeds=b["neg_prompt_embeds"][:, :m],
        negative_prompt_embeds_mask=b["neg_mask"][:, :m],
        true_cfg_scale=cfg.sampling.guidance,
        latents=noise.clone(),
        num_inference_steps=4,
        height=cfg.model.height,
        width=cfg.model.width,
        output_type="latent",
        callback_on_step_end=lambda p, i, t, kw: seen.append(kw["latents"].clone()) or {},
    )
    theirs = torch.stack(seen, 1)
    assert torch.allclose(ours[:, 1:], theirs, atol=1e-5, rtol=1e-5), (ours[:, 1:] - theirs).abs().max()
    assert (ours[:, -1] - noise).abs().mean() > 1e-2


def test_a_train_chunk_mixing_prompt_lengths_recomputes_the_rollout_logprob(tiny_cfg):
    """The rollout runs each prompt's rows in its own forward (the short prompt's at its length); the
    trainer's chunk takes one row of each (at the long prompt's length) after the Cond went to the host
    and back: ratio 1 within the engine's on-policy tolerance (test_cfg_batching: 1e-5)."""
    cfg = tiny_cfg(*QWEN, "sampling.cfg_batching=sequential")
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts([SHORT, LONG]).repeat_interleave(2)  # rows 0, 1 short; 2, 3 long
    g, s = torch.Generator().manual_seed(0), ad.sigmas(4)
    batches = [[torch.tensor([0, 1]), torch.tensor([2, 3])]] * 4
    seen = text_seen(ad)
    traj = sample(ad, cond, ad.initial_noise(4, g), s, "flow_grpo", 0.9, g, batches=batches)
    short, long_ = cond.host["text_len"][0].item(), cond.host["text_len"][2].item()
    assert seen[0] == short and seen[2] == long_ and short < long_
    stored = cond.to("cpu")
    chunk = torch.tensor([1, 2])
    for i in range(3):
        seen.clear()
        with torch.enable_grad():
            lp, _, _ = recompute_logprob(
                ad,
                stored.select(chunk),
                traj.latents[chunk, i],
                traj.latents[chunk, i + 1],
                s,
                i,
                "flow_grpo",
                0.9,
            )
        assert seen[0] == long_
        ratio = torch.exp(lp.detach() - traj.log_probs[chunk, i])
        assert torch.allclose(ratio, torch.ones(2), atol=1e-5), ratio


def test_cond_keeps_host_lengths_through_its_moves():
    c = Cond({"m": torch.ones(3, 5)}, host={"text_len": torch.tensor([2, 5, 3])})
    assert c.to("cpu").host["text_len"].tolist() == [2, 5, 3]
    assert c.select(torch.tensor([0, 2])).text_len("text_len", 5) == 3
    assert c.repeat_interleave(2).host["text_len"].tolist() == [2, 2, 5, 5, 3, 3]
    assert Cond.cat([c, c.select([0])]).host["text_len"].tolist() == [2, 5, 3, 2]
    assert Cond.cat([c, Cond({"m": torch.ones(1, 5)})]).text_len("text_len", 5) == 5  # one lacks: no trim
    assert Cond({"m": torch.ones(1, 5)}, host={"text_len": torch.tensor([0])}).text_len("text_len", 5) == 1


def test_trimming_reads_nothing_on_the_host(tiny_cfg):
    """The sampler's forward batches trim on the host copy of their rows (tests/host_reads.py): without it,
    the lengths indexed by the device rows would be read back every forward."""
    from tests.host_reads import counted, on_device

    cfg = tiny_cfg(*QWEN)
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts([SHORT, LONG]).repeat_interleave(2)
    cond.batched.update(on_device(cond.batched))
    noise = on_device(ad.initial_noise(4, torch.Generator().manual_seed(0)))
    seen, sigmas = text_seen(ad), ad.sigmas(2)  # the schedule is the host's
    with counted() as reads, torch.no_grad():
        sample(
            ad,
            cond,
            noise,
            sigmas,
            "flow_grpo",
            0.0,
            None,
            batches=[[torch.tensor([0, 1]), torch.tensor([2, 3])]] * 2,
        )
    assert reads == [] and seen[::2][:2] == cond.host["text_len"][[0, 2]].tolist()  # then the negative


def test_the_planner_counts_the_prompt_files_tokens_for_a_trimming_family(tiny_cfg, tmp_path):
    """By hand: the tiny stand-in keeps words (3 and 7: mean 5), the negative " " keeps one; sequential
    true CFG runs each pass at its own length: (5 + 1) / 2 = 3 per pass; batched: 5. A checkpoint: 45
    characters / 4.5 + the template's 5-token suffix = 15. FLUX (T5's padding is attended), a missing
    file or a built-in set: model.max_text_len."""
    from digenrl.planner.shapes import model_shape
    from digenrl.planner.text_tokens import prompt_tokens, text_tokens
    from digenrl.planner.workload import Workload

    path = tmp_path / "p.txt"
    path.write_text("a red car\na blue sky over a green field\n")
    qwen = (*QWEN, f"prompts.file={path}", "model.lora=null")
    assert text_tokens(tiny_cfg(*qwen, "sampling.cfg_batching=sequential")) == (
        3,
        "mean of 2 prompts and the negative prompt",
    )
    assert text_tokens(tiny_cfg(*qwen, "sampling.cfg_batching=batched"))[0] == 5
    w = Workload.from_config(tiny_cfg(*qwen, "sampling.cfg_batching=sequential"))
    assert w.shape.tokens.text == 3 and w.shape.text_source.startswith("mean of 2")
    real = tiny_cfg(*qwen, f"model.pretrained={tmp_path}").model
    assert prompt_tokens(real, "x" * 45) == 15 and prompt_tokens(real, "x" * 4500) == 32  # capped
    assert text_tokens(tiny_cfg(*QWEN)) is None  # the built-in set: the adapter's count stands
    assert text_tokens(tiny_cfg(*QWEN, f"prompts.file={tmp_path / 'none.txt'}")) is None
    flux = tiny_cfg(f"prompts.file={path}")
    assert text_tokens(flux) is None  # tiny FLUX: T5's padding is attended
    assert Workload.from_config(flux).shape.tokens.text == model_shape(flux.model).tokens.text
    assert Workload.from_config(tiny_cfg(*QWEN, "model.lora=null")).shape.tokens.text == 32


def test_benchmark_smoke(tmp_path):
    """benchmarks/text_trim.py: the FLOPs follow the adapter's count at both lengths, and the two timed
    velocities are the same (no timing asserted)."""
    import json

    from tests.test_benchmarks import bench_module

    bench_module("text_trim.py"[:-3]).main(
        ["--text", "8", "--repeats", "1", "--json", str(tmp_path / "t.json")]
    )
    data = json.loads((tmp_path / "t.json").read_text())
    assert [f["image_tokens"] for f in data["flops"]] == [1024, 4096]
    assert (
        all(f["ratio"] > 1 for f in data["flops"]) and data["flops"][0]["ratio"] > data["flops"][1]["ratio"]
    )
    assert data["cpu"]["max_abs_diff"] < 1e-5


def test_the_trimmed_calls_flops_are_the_formulas_at_the_trimmed_lengths():
    """FlopCounterMode over the guided velocity of the tiny config (3 words, the negative 1): the adapter's
    forward_flops at 3 and at 1 text tokens, where the padded call counts 2 x its max_text_len's."""
    from pathlib import Path

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from digenrl.config.run import load_config
    from digenrl.planner.shapes import model_shape

    cfg = load_config(Path(__file__).parents[1] / "configs" / "qwen_tiny.yaml")
    ad, shape = build_adapter(cfg.model, cfg.sampling), model_shape(cfg.model)
    cond, x = ad.encode_prompts(["a red apple"]), torch.randn(1, *ad.latent_shape())
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        ad.velocity(x, torch.full((1,), 0.5), cond)
    t = shape.tokens
    formula = sum(ad.forward_flops(shape.config, type(t)(t.x, n, 0, 0)) for n in (3, 1))
    assert counter.get_total_flops() == pytest.approx(formula, rel=0.1)
    assert formula < 0.8 * 2 * ad.forward_flops(shape.config, t)  # and well under the padded pair

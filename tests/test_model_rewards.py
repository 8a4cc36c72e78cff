"""CLIP-based rewards on a tiny random CLIP built here (no download), loaded through the rewards'
real code path; the reward actor on a local Ray against the inline rewards."""

import json

import numpy as np
import pytest
import torch

from digenrl.config.train import RewardConfig
from digenrl.errors import UserError
from digenrl.rewards import build_reward
from digenrl.rewards.base import Decoded
from digenrl.rewards.clip_models import LAION_HIDDEN, Aesthetic, ClipScore, PickScore

PROMPTS = ["a red car", "a blue bird on a tree", "a red car", "green hills", "a cat"]


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE (GPT-2 / CLIP vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def make_tiny_clip(path, seed: int = 0, image_size: int = 32, hidden: int = 32, layers: int = 2):
    """A random CLIPModel (by default hidden 32, 2 layers, 2 heads, 32 px, patch 8, projection 16)
    with a byte-level CLIP tokenizer (no merges) and a CLIP image processor config, saved to
    ``path``. A larger ``image_size`` / ``hidden`` / ``layers`` gives a slower one."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": 256 + i for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": 512, "<|endoftext|>": 513}
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer.from_pretrained(path).save_pretrained(path)
    small = dict(
        hidden_size=hidden, intermediate_size=hidden + 5, num_hidden_layers=layers, num_attention_heads=2
    )
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=514,
            max_position_embeddings=77,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
            **small,
        ),
        vision_config=dict(image_size=image_size, patch_size=8, **small),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    CLIPModel(cfg).save_pretrained(path)
    CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    ).save_pretrained(path)
    return path


def make_head(path, in_dim: int = 16, seed: int = 0):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    dims, idx = (in_dim, *LAION_HIDDEN, 1), (0, 2, 4, 6, 7)
    state = {}
    for i, (a, b) in zip(idx, zip(dims, dims[1:])):
        state[f"layers.{i}.weight"] = torch.randn(b, a, generator=g) / a**0.5
        state[f"layers.{i}.bias"] = torch.randn(b, generator=g) * 0.1
    if str(path).endswith(".safetensors"):
        save_file(state, path)
    else:
        torch.save(state, path)
    return state


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tiny-clip"))


@pytest.fixture(scope="module")
def head_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    return path, make_head(path)


def images(n, h=32, w=32, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def reference_logits(clip_dir, imgs, prompts):
    """logit_scale.exp() * cos per (image, its prompt), straight from CLIPModel.forward with the
    tokenizer and the (PIL) CLIP image processor, on uint8 images as the processor expects."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    model = CLIPModel.from_pretrained(clip_dir).eval()
    tok = AutoTokenizer.from_pretrained(clip_dir)(prompts, padding=True, return_tensors="pt")
    proc = CLIPImageProcessor.from_pretrained(clip_dir)
    arrays = [(im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8) for im in imgs]
    pixel_values = proc(images=arrays, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model(
            input_ids=tok["input_ids"], attention_mask=tok["attention_mask"], pixel_values=pixel_values
        )
    return out.logits_per_image.diagonal(), model.logit_scale.exp().item(), out.image_embeds


def quantised(imgs):
    return (imgs * 255).round() / 255  # what the uint8 reference sees


def test_clipscore_and_pickscore_match_clipmodel(clip_dir):
    imgs = quantised(images(5))
    logits, scale, _ = reference_logits(clip_dir, imgs, PROMPTS)
    cos = logits / scale
    pick = PickScore(path=str(clip_dir), device="cpu")(imgs, PROMPTS)
    clip = ClipScore(path=str(clip_dir), device="cpu")(imgs, PROMPTS)
    assert torch.allclose(pick, logits, atol=1e-4)
    assert torch.allclose(clip, 2.5 * cos.clamp(min=0), atol=1e-5)


def test_resize_and_crop_match_the_clip_processor(clip_dir):
    """48x64 images: shortest edge resized to 32 (bicubic), centre-cropped to 32x32 — in torch,
    against the PIL processor on the same (uint8) images."""
    imgs = quantised(images(3, 48, 64, seed=3))
    _, _, ref = reference_logits(clip_dir, imgs, PROMPTS[:3])
    r = ClipScore(path=str(clip_dir), device="cpu")
    emb = r.backbone.image_embeds(imgs, 4)
    assert torch.nn.functional.cosine_similarity(emb, ref).min() > 0.999


def test_batch_size_does_not_change_scores(clip_dir, head_file):
    imgs = images(5, seed=1)
    for cls, extra in ((ClipScore, {}), (PickScore, {}), (Aesthetic, {"head": str(head_file[0])})):
        one = cls(path=str(clip_dir), batch_size=1, device="cpu", **extra)(imgs, PROMPTS)
        four = cls(path=str(clip_dir), batch_size=4, device="cpu", **extra)(imgs, PROMPTS)
        assert torch.allclose(one, four, atol=1e-5), cls.__name__


def test_output_ranges_and_device(clip_dir, head_file):
    imgs = images(8, seed=2)
    prompts = [PROMPTS[i % 5] for i in range(8)]
    clip = ClipScore(path=str(clip_dir), device="cpu")
    s = clip(imgs, prompts)
    assert s.shape == (8,) and s.dtype == torch.float32 and s.device.type == "cpu"
    assert (s >= 0).all() and (s <= 2.5).all()
    assert clip.device.type == "cpu" and next(clip.backbone.model.parameters()).device.type == "cpu"
    pick = PickScore(path=str(clip_dir), device="cpu")
    assert (pick(imgs, prompts).abs() <= pick.backbone.model.logit_scale.exp()).all()
    aes = Aesthetic(path=str(clip_dir), head=str(head_file[0]), device="cpu")
    assert torch.isfinite(aes(imgs, prompts)).all()
    assert aes.head.layers[0].weight.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_scores_on_gpu_equal_cpu(clip_dir, head_file):
    imgs = images(4, 40, 40, seed=5)
    for cls, extra in ((ClipScore, {}), (Aesthetic, {"head": str(head_file[0])})):
        gpu = cls(path=str(clip_dir), device="cuda", **extra)
        assert next(gpu.backbone.model.parameters()).is_cuda
        assert torch.allclose(
            gpu(imgs, PROMPTS[:4]),
            cls(path=str(clip_dir), device="cpu", **extra)(imgs, PROMPTS[:4]),
            atol=1e-4,
        )


def test_aesthetic_is_the_mlp_on_the_normalised_image_embedding(clip_dir, head_file, tmp_path):
    imgs = quantised(images(3, seed=4))
    _, _, emb = reference_logits(clip_dir, imgs, PROMPTS[:3])  # CLIPModel's own normalised image_embeds
    _, state = head_file
    x = emb
    for i in (0, 2, 4, 6, 7):  # purely linear (dropout is off at inference)
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    got = Aesthetic(path=str(clip_dir), head=str(head_file[0]), device="cpu")(imgs, PROMPTS[:3])
    assert torch.allclose(got, x.squeeze(-1), atol=1e-4)
    pt = tmp_path / "head.pt"  # a torch .pt state dict (the published LAION file is one) loads too
    torch.save(state, pt)
    assert torch.allclose(Aesthetic(path=str(clip_dir), head=str(pt), device="cpu")(imgs, PROMPTS[:3]), got)


def test_video_scores_sampled_frames(clip_dir):
    video = torch.rand(2, 3, 5, 32, 32, generator=torch.Generator().manual_seed(6))
    prompts = ["a red car", "a cat"]
    r = ClipScore(path=str(clip_dir), device="cpu")
    r.frame_stride = 2  # what build_reward sets from args.frame_stride (below)
    got = r(video, prompts)
    for i in range(2):
        frames = video[i, :, ::2].permute(1, 0, 2, 3)  # frames 0, 2, 4
        assert got[i] == pytest.approx(r(frames, [prompts[i]] * 3).mean().item(), abs=1e-5)
    combined = build_reward(
        RewardConfig(
            components=[
                {"name": "pickscore", "args": {"path": str(clip_dir), "device": "cpu", "frame_stride": 2}}
            ]
        )
    )
    _, parts = combined(video, prompts)
    every = PickScore(path=str(clip_dir), device="cpu")(
        video[:, :, ::2], prompts
    )  # stride 1 on the sampled ones
    assert torch.allclose(parts["pickscore"], every, atol=1e-5)


def test_missing_weights_and_bad_args_name_the_field(clip_dir, tmp_path):
    def build(*components):
        return build_reward(RewardConfig(components=list(components)))

    with pytest.raises(
        UserError,
        match=r"reward\.components\.1\.args\.path: reward 'clipscore': weights directory .*nope not found",
    ):
        build({"name": "prompt_color"}, {"name": "clipscore", "args": {"path": str(tmp_path / "nope")}})
    with pytest.raises(UserError, match=r"reward\.components\.0\.args\.path: reward 'pickscore': required"):
        build({"name": "pickscore"})
    with pytest.raises(UserError, match=r"components\.0\.args\.path: .* no config\.json"):
        build({"name": "pickscore", "args": {"path": str(tmp_path)}})
    with pytest.raises(
        UserError, match=r"components\.0\.args\.head: reward 'aesthetic': head weights file .* not found"
    ):
        build({"name": "aesthetic", "args": {"path": str(clip_dir), "head": str(tmp_path / "h.pt")}})
    make_head(tmp_path / "wide.safetensors", in_dim=768)
    with pytest.raises(
        UserError, match=r"args\.head: .* does not fit the MLP 16->1024->128->64->16->1 .* takes 768"
    ):
        build(
            {"name": "aesthetic", "args": {"path": str(clip_dir), "head": str(tmp_path / "wide.safetensors")}}
        )
    with pytest.raises(UserError, match=r"components\.0\.args\.batch_size: .* positive integer"):
        build({"name": "clipscore", "args": {"path": str(clip_dir), "batch_size": 0}})
    with pytest.raises(UserError, match=r"components\.0\.args\.frame_stride: .* positive integer"):
        build({"name": "clipscore", "args": {"path": str(clip_dir), "frame_stride": 0}})
    with pytest.raises(
        UserError, match=r"components\.0\.args: reward 'clipscore': .*unexpected keyword argument 'heads'"
    ):
        build({"name": "clipscore", "args": {"path": str(clip_dir), "heads": 3}})
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"args\.device: .*'cuda' asked for, but CUDA is not available"):
            build({"name": "clipscore", "args": {"path": str(clip_dir), "device": "cuda"}})


def test_model_rewards_pass_the_dry_run(clip_dir, head_file):
    cfg = RewardConfig(
        components=[
            {"name": "clipscore", "args": {"path": str(clip_dir)}},
            {"name": "aesthetic", "weight": 0.1, "args": {"path": str(clip_dir), "head": str(head_file[0])}},
        ]
    )
    fn = build_reward(cfg)
    assert fn.terms[0][2].backbone is fn.terms[1][2].backbone  # one directory, loaded once
    timings = fn.check(["a red car"], (3, 24, 40))
    assert set(timings) == {"clipscore", "aesthetic"}


# ----------------------------------------------------------------------- the reward actor (Ray)


def test_actor_counts_queue_depth_and_latency():
    """The actor class itself (no Ray), with calls from three threads: one scores, two queue."""
    import threading

    from digenrl.rewards.base import REWARDS, Reward, register
    from digenrl.rewards.service import RewardActor

    gate, started = threading.Event(), threading.Event()

    @register("_gated")
    class Gated(Reward):
        def score(self, images, prompts, metadata):
            started.set()
            gate.wait(10)
            return torch.ones(len(prompts))

    try:
        actor = RewardActor(
            RewardConfig(components=[{"name": "_gated"}, {"name": "prompt_color", "weight": 0.0}])
        )
        assert actor.ready() == ["_gated", "prompt_color"]
        calls = [threading.Thread(target=actor.score, args=(images(2), ["a red car"] * 2)) for _ in range(3)]
        calls[0].start()
        assert started.wait(10)
        for t in calls[1:]:
            t.start()
        for _ in range(1000):
            if actor.stats()["queue_depth"] == 2:
                break
            threading.Event().wait(0.01)
        assert actor.stats()["queue_depth"] == 2
        gate.set()
        for t in calls:
            t.join(10)
        st = actor.stats()
        assert (
            st["queue_depth"] == 0 and st["max_queue_depth"] == 2 and st["calls"] == 3 and st["samples"] == 6
        )
        assert st["rewards"]["_gated"]["calls"] == 3 and st["rewards"]["_gated"]["max_s"] > 0
    finally:
        REWARDS.pop("_gated")


def test_actor_applies_the_nan_policy_to_late_nan():
    """NaN that shows up only in the run (the dry run scored 2 samples, the run scores 4):
    ``drop`` passes it on as NaN in the total (the driver gives it advantage 0), ``fail``
    raises the UserError naming the reward from the actor, which stays usable."""
    from digenrl.rewards.base import REWARDS, Reward, register
    from digenrl.rewards.service import RewardActor

    @register("_nan_when_big")
    class NanWhenBig(Reward):
        def score(self, images, prompts, metadata):
            r = torch.ones(len(prompts))
            if len(prompts) > 2:
                r[1] = float("nan")
            return r

    try:
        terms = [{"name": "_nan_when_big"}, {"name": "prompt_color", "weight": 0.5}]
        drop = RewardActor(RewardConfig(components=terms, nan_policy="drop"))
        drop.check(["a red car"], (3, 8, 8))
        scored = drop.score_timed(Decoded(images(4), ["a red car"] * 4, [{}] * 4))
        assert torch.isnan(scored.total).tolist() == [False, True, False, False]
        assert scored.end >= scored.start and scored.wait_s >= 0 and scored.queue_depth == 0
        assert set(scored.timings) == {"_nan_when_big", "prompt_color"}
        fail = RewardActor(RewardConfig(components=terms))
        fail.check(["a red car"], (3, 8, 8))
        with pytest.raises(UserError, match=r"reward '_nan_when_big' returned NaN for 1 of 4 samples"):
            fail.score_timed(Decoded(images(4), ["a red car"] * 4, [{}] * 4))
        assert (
            fail.stats()["queue_depth"] == 0
            and fail.score_timed(Decoded(images(2), ["a red car"] * 2, [{}] * 2)).queue_depth == 0
        )
    finally:
        REWARDS.pop("_nan_when_big")


def test_building_rewards_draws_no_random_numbers(clip_dir, head_file):
    """Workers that do not score (reward.service, trainer ranks) skip building the rewards; the
    policy each process builds next must not notice."""
    cfg = RewardConfig(
        components=[
            {"name": "aesthetic", "args": {"path": str(clip_dir), "head": str(head_file[0])}},
            {"name": "clipscore", "args": {"path": str(clip_dir)}},
        ]
    )
    torch.manual_seed(3)
    build_reward(cfg)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))


def test_reward_call_metrics():
    from digenrl.rewards.service import reward_call_metrics

    inline = [
        {"seconds": 0.2, "timings": {"a": 0.1, "b": 0.1}},
        {"seconds": 0.4, "timings": {"a": 0.3, "b": 0.1}},
    ]
    assert reward_call_metrics(inline) == pytest.approx(
        {"reward_latency_s": 0.3, "reward_latency_s/a": 0.2, "reward_latency_s/b": 0.1}
    )
    served = [{**c, "wait_s": w, "queue_depth": q} for c, w, q in zip(inline, (0.0, 0.5), (0, 2))]
    assert reward_call_metrics(served) == pytest.approx(
        {
            "reward_latency_s": 0.3,
            "reward_latency_s/a": 0.2,
            "reward_latency_s/b": 0.1,
            "reward_wait_s": 0.25,
            "reward_queue_depth": 2,
        }
    )
    assert reward_call_metrics([]) == {}


@pytest.fixture(scope="module")
def ray_local(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``)."""
    import ray

    return ray


@pytest.mark.slow
def test_reward_actor_scores_equal_inline(ray_local, clip_dir, head_file):
    from digenrl.rewards.service import RewardClient, reward_client, start_reward_actor

    cfg = RewardConfig(
        components=[
            {"name": "clipscore", "weight": 2.0, "args": {"path": str(clip_dir), "batch_size": 3}},
            {"name": "aesthetic", "weight": 0.5, "args": {"path": str(clip_dir), "head": str(head_file[0])}},
            {"name": "prompt_color", "weight": 1.0},
        ],
        service={"num_cpus": 0.5},
    )
    client = RewardClient(start_reward_actor(cfg))
    batches = [
        (images(4, seed=s), ["a red car", "a red car", "a blue bird", "a blue bird"]) for s in range(3)
    ]
    refs = [client.submit(px, pr) for px, pr in batches]  # the worker carries on: nothing waited on yet
    assert all(isinstance(r, ray_local.ObjectRef) for r in refs)
    inline = reward_client(cfg)  # no actor: the same rewards in this process
    for ref, (px, pr) in zip(refs, batches):
        total, parts = client.result(ref)
        want_total, want_parts = inline(px, pr)
        assert torch.allclose(total, want_total, atol=1e-5)
        assert parts.keys() == want_parts.keys()
        assert all(torch.allclose(parts[k], want_parts[k], atol=1e-5) for k in parts)
    video = torch.rand(2, 3, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    assert torch.allclose(
        client(video, ["a red car", "a cat in red"])[0],
        inline(video, ["a red car", "a cat in red"])[0],
        atol=1e-5,
    )
    stats = client.stats()
    assert stats["calls"] == 4 and stats["samples"] == 14 and stats["in_flight"] == 0
    assert stats["queue_depth"] == 0 and stats["max_queue_depth"] >= 0
    assert set(stats["rewards"]) == {"clipscore", "aesthetic", "prompt_color"}
    assert all(r["calls"] == 4 and r["mean_s"] > 0 for r in stats["rewards"].values())
    assert client.check(["a red car"], (3, 32, 32)).keys() == stats["rewards"].keys()
    inline_stats = inline.stats()
    assert inline_stats["calls"] == 4 and set(inline_stats["rewards"]) == set(stats["rewards"])
    with pytest.raises(UserError, match="names no colour"):  # raised in the actor, re-raised as itself
        client(images(1), ["a car"])
    ray_local.kill(client.actor)


@pytest.mark.slow
def test_reward_actor_reports_user_errors(ray_local, tmp_path):
    from digenrl.rewards.service import start_reward_actor

    bad = RewardConfig(
        components=[{"name": "clipscore", "args": {"path": str(tmp_path / "missing")}}],
        service={"num_cpus": 0.5},
    )
    with pytest.raises(UserError, match=r"reward\.components\.0\.args\.path: .*not found"):
        start_reward_actor(bad)

"""Every recipe in configs/recipes/ validates as published, and runs 2 iterations on the tiny preset of
its family with the local trainer.

The swap for the test (``FAMILY_SIZE``, stated in configs/recipes/README.md): the tiny random-init preset
instead of the local checkpoint, fp32 at 16-32 px, the built-in colour prompts instead of a prompt
file, the weight-free ``prompt_color`` reward instead of the model / served rewards (PickScore and
the rest need local weights or a server), one prompt per iteration, placement local (no Ray), and
for one recipe a larger ``train.micro_batch`` (``MEMORY``: a memory knob, gradients equal to rounding).
Everything algorithmic -- steps, G, SDE kind, noise level, clip, std mode and ddof, timestep mode,
window and its range, combine -- runs as the recipe sets it.
"""

from pathlib import Path

import pytest

from digenrl.adapters import adapter_class
from digenrl.config.run import load_config
from tests.helpers import TINY_IMAGE, write_edit_set

RECIPES = sorted((Path(__file__).parents[1] / "configs" / "recipes").glob("*.yaml"))
COMMON = [
    "model.preset=tiny",
    "model.pretrained=null",
    "model.dtype=float32",
    "model.max_text_len=16",
    "prompts.file=null",
    "prompts.builtin=colors",
    "reward.components=[{name: prompt_color}]",
    "train.iterations=2",
    "train.prompts_per_iteration=1",
    "train.device=cpu",
    "engine.unit_groups=1",
    "placement.mode=local",
    "train.fsdp=off",  # one local trainer (FLUX.2 [dev] shards its 32B: FSDP x8)
    "output.checkpoint_every=0",
]
FAMILY_SIZE = {  # per family: a size the tiny preset takes
    "flux": [*TINY_IMAGE],
    "hunyuan_video": ["model.height=32", "model.width=32", "model.frames=5"],
    "qwen_image": [*TINY_IMAGE],
    "sd3": [*TINY_IMAGE],
    "wan22": ["model.height=32", "model.width=32", "model.frames=5"],
    "qwen_image_edit": ["model.height=32", "model.width=32"],
    "flux_kontext": [*TINY_IMAGE],
    "z_image": [*TINY_IMAGE],
    "flux2": [*TINY_IMAGE],
    "hunyuan_video15": [*TINY_IMAGE, "model.frames=5"],
}
MEMORY = {  # per recipe: a memory knob lifted where micro-batches of 1 made the run the suite's slowest
    "unirl_hunyuan_video15_pickscore": ["train.micro_batch=12"],  # a mini-batch's samples in one forward
}


def test_every_family_has_a_recipe_and_every_recipe_a_readme_row():
    names = {p.stem for p in RECIPES}
    assert {
        "flow_grpo_flux_pickscore",
        "flow_grpo_fast_flux_pickscore",
        "dancegrpo_flux_hpsv2",
        "dancegrpo_hunyuan_videoalign",
        "mixgrpo_flux",
        "diffusion_nft_flux",
        "diffusion_nft_qwen_image",
        "flow_grpo_qwen_image_ocr",
        "flow_grpo_qwen_image_geneval",
        "awm_flux_pickscore",
        "flow_dppo_qwen_image",
        "grpo_guard_qwen_image",
        "online_dpo_flux_pickscore",
        "flow_factory_wan22_pickscore",
        "flow_grpo_qwen_image_edit_counting",
        "flow_factory_z_image_turbo_pickscore",
        "flow_factory_flux2_klein_pickscore",
        "flow_factory_flux2_dev_clip_pickscore",
        "unirl_hunyuan_video15_pickscore",
    } <= names
    readme = (RECIPES[0].parent / "README.md").read_text()
    for name in names:
        assert f"{name}.yaml" in readme, name


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_as_published(recipe):
    cfg = load_config(recipe)
    assert cfg.model.pretrained is not None and cfg.model.preset is None
    assert cfg.model.adapter in FAMILY_SIZE
    assert "Recipe:" in recipe.read_text().splitlines()[0]  # the header names its source


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_two_iterations_on_the_tiny_preset(recipe, tmp_path, monkeypatch):
    import digenrl.engine.local
    from digenrl.engine.local import LocalTrainer

    seen = []  # (mini-batch, train unit stats)
    train_unit = digenrl.engine.local.train_unit

    def recording(*args, **kw):
        stats = train_unit(*args, **kw)
        seen.append((kw.get("minibatch", 0), stats))
        return stats

    monkeypatch.setattr(digenrl.engine.local, "train_unit", recording)

    published = load_config(recipe)
    size = FAMILY_SIZE[published.model.adapter]
    if published.model.adapter == "flux2" and "dev" in Path(published.model.pretrained).name.lower():
        size = [*size, "model.preset=tiny_dev"]  # [dev]: the guidance embedding, not CFG
    edit = []  # an edit family: a tiny edit set of input images instead of the colour prompts
    if adapter_class(published.model.adapter).edits:
        h, w = (int(kv.split("=")[1]) for kv in size[:2])
        edit = ["prompts.builtin=null", f"prompts.file={write_edit_set(tmp_path / 'edits', h, w)}"]
    memory = MEMORY.get(recipe.stem, [])
    cfg = load_config(recipe, [*COMMON, *size, *memory, *edit, f"output.run_dir={tmp_path / 'run'}"])
    alg, samp = cfg.algorithm, cfg.sampling
    # the algorithm is the recipe's, untouched by the swap
    assert (
        alg.model_dump() == published.algorithm.model_dump()
        and samp.model_dump() == published.sampling.model_dump()
    )
    assert (cfg.train.optimizer_steps, cfg.train.ema) == (
        published.train.optimizer_steps,
        published.train.ema,
    )
    trainer = LocalTrainer(cfg)
    result = trainer.run()
    rows = result.metrics
    assert [r["iteration"] for r in rows] == [0, 1] and rows[-1]["version"] == 2
    assert rows[0]["samples"] == alg.group_size
    # on-policy, the first mini-batch of each iteration: ratio 1, up to recomputing the log-prob in
    # other batch shapes than the rollout's (~2e-7 measured; below the smallest clip, 1e-5); the
    # later mini-batches (train.optimizer_steps > 1) see the moved weights, as PPO does
    steps = cfg.train.optimizer_steps
    assert len(seen) == 2 * steps and sorted(m for m, _ in seen) == sorted(list(range(steps)) * 2)
    unit = trainer.last_units[0]
    if alg.name in ("diffusion_nft", "awm", "online_dpo"):  # no ratio: clean samples, K noise levels each
        section = {"awm": alg.awm, "online_dpo": alg.dpo}.get(alg.name, alg.nft)
        assert unit.latents.shape[1] == 1 and unit.train_idx.shape[1] == (section.noise_levels or samp.steps)
        if alg.name == "diffusion_nft":  # r in [0, 1]
            assert all(0 <= r["nft_r"] <= 1 and r["loss"] > 0 for r in rows)
        assert (result.run_dir / "final").is_dir()
        return
    for m, st in seen:
        if m == 0:
            assert abs(st["ratio_min"] - 1) < 1e-6 and abs(st["ratio_max"] - 1) < 1e-6 and st["clip_sum"] == 0
    if steps == 1:
        assert all(abs(r["ratio_min"] - 1) < 1e-6 and abs(r["ratio_max"] - 1) < 1e-6 for r in rows)
    assert (result.run_dir / "final").is_dir()
    if alg.timesteps.mode == "window":  # SDE (and trained) steps only inside the window and its range
        ts, n = alg.timesteps, samp.steps
        sde = unit.sde_mask.nonzero().squeeze(1)
        assert len(sde) == ts.window and sde.min() >= int(ts.window_range[0] * n)
        assert sde.max() < min(int(ts.window_range[1] * n), n - 1)
        assert set(unit.train_idx.unique().tolist()) == set(sde.tolist())
    else:
        assert unit.sde_mask.all()

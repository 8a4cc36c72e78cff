"""Ulysses sequence parallelism over 2 gloo ranks equals one process, for the tiny real
transformer of every family (FLUX, Wan, Qwen-Image: diffusers' context parallelism; HunyuanVideo:
digenrl's own all-to-all processor): the guided velocity (forward), its gradient w.r.t. the LoRA
parameters (summed over the group), and a full SDE trajectory with the same seeds.

Tolerances (fp32): the two-rank run adds the same terms in another order (attention over a
permuted key order, row blocks of the linear layers, the gradient sum over ranks). Measured max
differences (velocities ~1-2, log-probs ~1-4 per sample): velocity 1.0e-6, gradient 1.2e-6 of the
largest element, latents after 3 SDE steps 2.1e-6, log-probs 4.8e-7 (Wan: bit-identical forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_spawn import spawn

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAMILIES = {
    "flux": "flux_tiny.yaml",
    "wan": "wan_tiny.yaml",
    "qwen_image": "qwen_tiny.yaml",
    "hunyuan_video": "hunyuan_tiny.yaml",
    "wan22": "wan2.2_tiny.yaml",  # two experts: the low-noise one runs at these sigmas
}
PROMPTS = ["a red apple on a wooden table", "blue sky"]  # different lengths: padded text tokens
VELOCITY_ATOL = 1e-5
GRAD_RTOL = 1e-5  # of the largest gradient element
TRAJECTORY_ATOL = 2e-5  # latents after 3 SDE steps
LOGPROB_ATOL = 1e-5


def _adapter(family: str):
    """The family's tiny adapter with its LoRA, the LoRA weights set to seeded random values
    (peft starts B at 0, which would leave every A gradient 0)."""
    from digenrl.adapters import build_adapter
    from digenrl.config.run import load_config
    from digenrl.policy.lora import apply_lora

    cfg = load_config(CONFIGS / FAMILIES[family], [])
    adapter = build_adapter(cfg.model, cfg.sampling)
    apply_lora(adapter.transformer, cfg.model.lora, adapter.default_lora_targets)
    gen = torch.Generator().manual_seed(7)
    for p in adapter.transformer.parameters():
        if p.requires_grad:
            p.data = 0.05 * torch.randn(p.shape, generator=gen)
    return cfg, adapter


def _first_attention_tokens(net) -> list[int]:
    """Records how many tokens the last block's first attention query projection sees per call (the
    last expert's, for a model of two experts)."""
    seen = []
    name = [
        n
        for n, _ in net.named_modules()
        if {"transformer_blocks", "blocks"} & set(n.split(".")[:2])
        and n.endswith((".attn.to_q", ".attn1.to_q"))
    ][-1]
    net.get_submodule(name).register_forward_hook(lambda m, a, out: seen.append(a[0].shape[1]))
    return seen


def _measure(family: str, sp_degree: int) -> dict:
    from digenrl.algorithms.sde import sample
    from digenrl.distributed import sequence_parallel as sp

    cfg, adapter = _adapter(family)
    net = adapter.transformer
    mesh = None
    if sp_degree > 1:
        mesh = sp.sp_mesh(sp_degree)
        sp.enable_sequence_parallel(net, mesh)
    seen = _first_attention_tokens(net)
    gen = torch.Generator().manual_seed(11)
    cond = adapter.encode_prompts(PROMPTS)
    x = torch.randn((len(PROMPTS), *adapter.latent_shape()), generator=gen)
    weights = torch.randn(x.shape, generator=gen)
    v = adapter.velocity(x, torch.tensor([0.7, 0.3]), cond)
    (v * weights).sum().backward()
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    if mesh is not None:
        sp.sum_gradients(list(params.values()), mesh)
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
    with torch.no_grad():
        traj = sample(
            adapter,
            cond,
            torch.randn(x.shape, generator=gen),
            adapter.sigmas(3),
            cfg.sampling.sde,
            cfg.sampling.noise_level,
            randn=torch.Generator().manual_seed(3),
        )
    return {
        "v": v.detach(),
        "grads": grads,
        "latents": traj.latents,
        "log_probs": traj.log_probs,
        "tokens": seen[0],
    }


def _run(rank, world, out: Path):
    for family in FAMILIES:
        ref = _measure(family, 1)
        par = _measure(family, world)
        torch.save({"ref": ref, "sp": par}, out / f"{family}_rank{rank}.pt")


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    spawn(_run, 2, out)
    return {f: [torch.load(out / f"{f}_rank{r}.pt") for r in (0, 1)] for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sp2_velocity_and_lora_gradient_equal_one_process(results, family):
    for rank_result in results[family]:
        ref, par = rank_result["ref"], rank_result["sp"]
        assert par["tokens"] * 2 == ref["tokens"], "each rank must project half the tokens"
        assert (par["v"] - ref["v"]).abs().max().item() < VELOCITY_ATOL
        assert set(par["grads"]) == set(ref["grads"]) and ref["grads"]
        scale = max(g.abs().max().item() for g in ref["grads"].values())
        assert scale > 0
        assert _max_diff(par["grads"], ref["grads"]) < GRAD_RTOL * scale
        # the attention LoRA is trained (its gradient crosses the all-to-alls), not only the output layer
        assert any(g.abs().max() > 1e-3 * scale for n, g in par["grads"].items() if ".to_q.lora_A" in n)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sp2_sde_trajectory_equals_one_process(results, family):
    for rank_result in results[family]:
        ref, par = rank_result["ref"], rank_result["sp"]
        assert ref["latents"].shape[1] == 4 and ref["log_probs"].abs().max() > 0  # 3 SDE steps
        assert (par["latents"] - ref["latents"]).abs().max().item() < TRAJECTORY_ATOL
        assert (par["log_probs"] - ref["log_probs"]).abs().max().item() < LOGPROB_ATOL
    r0, r1 = (r["sp"] for r in results[family])
    assert torch.equal(r0["latents"], r1["latents"])  # both ranks return the same samples


# ---------------------------------------------------------------------- SP inside FSDP
BATCH_PROMPTS = ["a red apple on a wooden table", "blue sky", "green grass", "a yellow cat"]


def _fsdp_sp_gradient(family: str, rank: int, world: int, composed: bool) -> dict:
    """The LoRA gradient of a 4-sample batch: one process (``composed`` False), or FSDP2 over all
    ranks with SP inside groups of 2 consecutive ranks, each group training its half of the batch
    (the loss terms add up to the whole batch's; FSDP reduce-scatters by sum)."""
    from torch.distributed.tensor import DTensor

    from digenrl.distributed import fsdp
    from digenrl.distributed import sequence_parallel as sp

    _, adapter = _adapter(family)
    net = adapter.transformer
    rows = torch.arange(len(BATCH_PROMPTS))
    if composed:  # as the engine's trainer ranks: shard first, then the sequence split
        fsdp.parallelize(net, fsdp.trainer_mesh(world), param_dtype=torch.float32)
        sp.enable_sequence_parallel(net, sp.sp_mesh(2))
        half = len(rows) // (world // 2)
        rows = rows[rank // 2 * half : (rank // 2 + 1) * half]
    gen = torch.Generator().manual_seed(11)
    cond = adapter.encode_prompts(BATCH_PROMPTS)
    x = torch.randn((len(BATCH_PROMPTS), *adapter.latent_shape()), generator=gen)
    weights = torch.randn(x.shape, generator=gen)
    sigma = torch.tensor([0.7, 0.3, 0.5, 0.9])
    v = adapter.velocity(x[rows], sigma[rows], cond.select(rows))
    (v * weights[rows]).sum().backward()
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in net.named_parameters()
        if p.requires_grad
    }


def _run_fsdp_sp(rank, world, out: Path):
    for family in ("flux", "hunyuan_video"):  # diffusers' context parallelism, and digenrl's own
        ref = _fsdp_sp_gradient(family, rank, world, composed=False)
        par = _fsdp_sp_gradient(family, rank, world, composed=True)
        if rank == 0:
            torch.save({"ref": ref, "par": par}, out / f"{family}_fsdp_sp.pt")


def test_sp_inside_fsdp_gradient_equals_one_process(tmp_path):
    """4 gloo ranks: FSDP2 over all 4, Ulysses inside groups of 2 (measured: 4.4e-7 FLUX, 2.0e-7
    HunyuanVideo of the largest gradient element)."""
    spawn(_run_fsdp_sp, 4, tmp_path)
    for family in ("flux", "hunyuan_video"):
        r = torch.load(tmp_path / f"{family}_fsdp_sp.pt")
        assert set(r["par"]) == set(r["ref"]) and r["ref"]
        scale = max(g.abs().max().item() for g in r["ref"].values())
        assert scale > 0 and _max_diff(r["par"], r["ref"]) < GRAD_RTOL * scale, family

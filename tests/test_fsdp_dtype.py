"""dtype discipline under FSDP2 in bf16 (issue 36: item 1, and Wan's fp32-kept modules): sharding
casts neither a module's forward inputs nor what diffusers keeps in fp32. Two gloo ranks shard the
tiny FLUX / Wan / HunyuanVideo (full fine-tuning, bf16 compute, fp32 masters) exactly as a trainer
rank does; forward pre-hooks placed after FSDP2's own see the inputs each sharded module gets: the
root's inputs keep the dtypes the adapter passed (Wan's timestep fp32: 937.5 would round to 936
in bf16), the blocks' rotary tables stay fp32, Wan's kept parameters arrive in fp32,
and the sharded velocity equals the unsharded one computed with the same weights (bf16 but for
what diffusers keeps in fp32 when it loads a bf16 model)."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.dist_spawn import spawn
from tests.helpers import TINY_IMAGE

pytestmark = pytest.mark.slow

FAMILIES = {
    "flux": ("configs/flux_tiny.yaml", TINY_IMAGE),
    "wan": ("configs/wan_tiny.yaml", ["model.frames=1"]),
    "hunyuan_video": ("configs/hunyuan_tiny.yaml", []),
}


def _leaves(value, out: list):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _leaves(v, out)
    return out


def _named_inputs(module, args, kwargs) -> dict[str, list[torch.Tensor]]:
    """The forward's inputs by parameter name (positional ones too), as lists of tensor leaves."""
    bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    return {name: _leaves(v, []) for name, v in bound.arguments.items()}


def _hooks(net, seen: dict):
    """Record the input dtypes each module gets before FSDP2's pre-forward (``prepend``) and after."""
    from digenrl.distributed.blocks import transformer_blocks

    def recorder(key):
        def hook(module, args, kwargs):
            dtypes = {n: [t.dtype for t in ts] for n, ts in _named_inputs(module, args, kwargs).items()}
            seen.setdefault(key, []).append(dtypes)

        return hook

    net.register_forward_pre_hook(recorder("root_given"), prepend=True, with_kwargs=True)
    net.register_forward_pre_hook(recorder("root_seen"), with_kwargs=True)
    for block in transformer_blocks(net):
        block.register_forward_pre_hook(recorder("block_seen"), with_kwargs=True)


def _kept_hooks(net, seen: dict):
    """Record, as each module runs (after FSDP2 gathered it), the dtypes of the parameters diffusers
    keeps in fp32 (``_keep_in_fp32_modules``: Wan's time embedder, norms, modulation tables)."""
    keep = set(getattr(net, "_keep_in_fp32_modules", None) or ())
    for name, module in net.named_modules():
        whole = name.split(".")[-1] in keep  # a kept module: all its parameters; else its kept own ones
        kept = [n for n, _ in module.named_parameters(recurse=whole) if whole or n in keep]
        if not kept:
            continue

        def hook(module, args, name=name, kept=kept, whole=whole):
            params = dict(module.named_parameters(recurse=whole))
            seen.setdefault("kept", {})[name] = sorted({str(params[n].dtype) for n in kept})

        module.register_forward_pre_hook(hook)


def _check(rank, world, out):
    from digenrl.config.run import load_config
    from digenrl.distributed import fsdp
    from digenrl.policy.model import Policy

    results = {}
    for family, (path, sets) in FAMILIES.items():
        cfg = load_config(path, [*sets, "model.dtype=bfloat16", "model.lora=null", "algorithm.kl_beta=0"])
        torch.manual_seed(0)  # unsharded, its weights in bf16 as FSDP2 all-gathers them (param_dtype)
        rollout = Policy(cfg, device="cpu", trainable=False)
        keep = set(getattr(rollout.adapter.transformer, "_keep_in_fp32_modules", None) or ())
        for name, p in rollout.adapter.transformer.named_parameters():  # (buffers, RoPE, stay fp32)
            if not keep & set(name.split(".")):  # what diffusers keeps in fp32 loading a bf16 model stays
                p.data = p.data.to(torch.bfloat16)
        torch.manual_seed(0)  # the trainer rank's: the same weights as fp32 masters, then sharded
        policy = Policy(cfg, device="cpu")
        adapter = policy.adapter
        cond = adapter.encode_prompts(["a red cube", "a blue ball"])
        x = torch.randn((2, *adapter.latent_shape()), generator=torch.Generator().manual_seed(1))
        sigma = torch.tensor([0.9375, 0.3])  # Wan / Hunyuan: timestep 937.5, which bf16 rounds to 936
        with torch.no_grad():
            unsharded = rollout.adapter.velocity(x, sigma, cond)
        fsdp.shard_policy(policy, fsdp.trainer_mesh())
        seen: dict = {}
        _hooks(adapter.transformer, seen)
        _kept_hooks(adapter.transformer, seen)
        with torch.no_grad():
            sharded = adapter.velocity(x, sigma, cond)
        results[family] = {"unsharded": unsharded, "sharded": sharded, "seen": seen}
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_dtype")
    spawn(_check, 2, out)
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharding_never_casts_forward_inputs(results, family):
    for rank in results:
        seen = rank[family]["seen"]
        assert seen["root_given"] == seen["root_seen"], "FSDP2 changed the root's input dtypes"
        if family == "wan":  # WanPipeline feeds fp32; FLUX's and Hunyuan's the model dtype (issue 53)
            assert all(call["timestep"] == [torch.float32] for call in seen["root_seen"])
        rotary = [d for call in seen["block_seen"] for n, ds in call.items() if "rotary" in n for d in ds]
        assert rotary and set(rotary) == {torch.float32}, f"{family}: rotary tables reach blocks as {rotary}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_velocity_equals_unsharded_in_bf16(results, family):
    """Bit for bit: the unsharded model holds the bf16 parameters FSDP2 all-gathers (buffers, such as
    Wan's RoPE tables, fp32 in both). On 849bed7 (inputs cast) they differed by 0.0078 (FLUX), 0.084
    (Wan), 0.025 (Hunyuan) at a velocity scale of ~1.5."""
    for rank in results:
        r = rank[family]
        assert r["unsharded"].abs().max().item() > 0
        diff = (r["sharded"] - r["unsharded"]).abs().max().item()
        assert torch.equal(r["sharded"], r["unsharded"]), f"{family}: sharded differs by {diff:.3g}"


def test_what_diffusers_keeps_in_fp32_is_gathered_in_fp32(results):
    """Wan's ``_keep_in_fp32_modules`` (the time embedder, the blocks' cross-attention norm, every
    ``scale_shift_table``) reach its forward in fp32 on a bf16 sharded rank, as a rollout worker holds
    them (diffusers loads them so): a module as its own fp32 FSDP2 unit, a bare table left whole.
    Before, FSDP2 gathered them in bf16 (the sharded velocity then differed from the unsharded one)."""
    for rank in results:
        kept = rank["wan"]["seen"]["kept"]
        assert {"condition_embedder.time_embedder", "", "blocks.0", "blocks.0.norm2"} <= set(kept)
        assert set(map(tuple, kept.values())) == {("torch.float32",)}, kept

"""FSDP2 sharding of the trained transformer: ``fully_shard`` per block, then the root.

Details: docs/modules.md, `digenrl.distributed.fsdp`.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from digenrl.distributed.blocks import transformer_blocks
from digenrl.distributed.checkpointing import checkpoint_blocks
from digenrl.distributed.grad_sync import all_reduce_tensors
from digenrl.distributed.precision import fp32_master


def forget_meshes() -> None:
    """Drop every DTensor cache that holds a mesh, for a process kept to join another run's groups
    (call it on the thread that ran the DTensor ops: the sharding caches are per thread).

    A cached op's output carries the mesh it was first computed on, and meshes compare equal by shape
    and global ranks alone: a process whose coordinate in an equal-looking mesh changed would get its
    old coordinate back, and place its shards at another rank's offsets (DCP then refuses the save
    plan). And a cached mesh holds its process groups: the redistribute plans and cost caches an
    optimizer step fills kept a destroyed group alive -- gloo's threads, sockets to the old peers,
    rank 0's store server -- one more every run (tests/test_warm.py)."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    clear_redistribute_planner_cache()
    for cached in _dtensor_lru_caches():
        cached.cache_clear()


def _dtensor_lru_caches() -> list:
    """The ``functools.lru_cache`` functions of torch's DTensor modules (and of their classes)."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed.tensor") or module is None:
            continue
        for value in list(vars(module).values()):
            inner = vars(value).values() if isinstance(value, type) and value.__module__ == name else ()
            for v in (value, *inner):
                v = getattr(v, "__func__", v)  # (a cached staticmethod)
                if not isinstance(v, type) and callable(getattr(v, "cache_clear", None)):
                    found.append(v)
    return found


def trainer_mesh(degree: int | None = None, device_type: str = "cpu") -> DeviceMesh:
    """The mesh over the default process group's ranks (already initialised): 1-D when the
    sharding ``degree`` is the world size (FSDP), 2-D (replicate, shard) when it divides it
    (HSDP: ``fully_shard`` then shards inside each group of ``degree`` ranks and all-reduces
    across the groups)."""
    world = dist.get_world_size()
    degree = degree or world
    if degree == world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world // degree, degree), mesh_dim_names=("replicate", "shard"))


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    gradient_sum: bool = True,
    independent_replicas: bool = False,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh``; returns it (now an ``FSDPModule``).

    Order, as torchtitan: trained parameters to fp32 (the masters), activation checkpointing
    per block, ``fully_shard`` per block, ``fully_shard`` on the root (embeddings, norms, the
    output projection and anything outside the blocks). Build the optimizer afterwards: sharding
    replaces the parameters with ``DTensor`` shards.

    ``gradient_sum``: reduce gradients by sum, as the engine's units are written (each unit's
    loss is already divided by the iteration's total term count); False averages, as DDP does.
    ``independent_replicas`` (HSDP, a 2-D mesh): shard over this rank's ``shard`` sub-mesh only, so
    backward reduce-scatters inside the shard group and the replica groups need not run the same
    passes (FSDP2's own HSDP all-reduces across the replicas in every backward);
    :func:`all_reduce_replicas` then sums the gradient shards over the replicas before the step.
    ``device``: where a model still in host memory goes (a rank built with ``host_transformer``):
    each block is cast, moved and sharded in turn, then the root's own tensors, so the device
    holds the shards plus one full block at most, never the whole model.
    """
    if independent_replicas and mesh.ndim == 2:
        mesh = mesh["shard"]
    if activation_checkpointing:
        checkpoint_blocks(model)
    # never cast a module's inputs (FSDP2's default casts every floating one to param_dtype: timesteps,
    # rotary tables, position ids); activations follow the bf16 weights and the adapter's autocast
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    # what diffusers keeps in fp32 (`_keep_in_fp32_modules`: Wan's time embedder, norms, modulation
    # tables) is gathered in fp32: a module as its own fp32 unit, a bare parameter left whole
    fp32 = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    kept_modules, kept_params = fp32_kept(model)
    for block in transformer_blocks(model):  # cast one block at a time, then shard it: the full fp32
        fp32_master(block)  # copy of one block is the most that ever exists
        to_device(block, device)
        for sub in kept_modules.pop(block, []):
            fully_shard(sub, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=kept_params,
        )
    fp32_master(model)  # the root's own parameters (the blocks' are fp32 shards already)
    to_device(model, device)  # (and what FSDP leaves whole: kept bare parameters, buffers)
    for sub in kept_modules.pop(model, []):
        fully_shard(sub, mesh=mesh, mp_policy=fp32, reshard_after_forward=False)
    # the root's parameters are needed again right at the start of backward: keep them gathered. A
    # model of experts (Wan2.2 A14B) runs each expert's forward, never its own: each expert is a root
    for root in [*getattr(model, "experts", list)(), model]:
        fully_shard(
            root, mesh=mesh, mp_policy=policy, reshard_after_forward=False, ignored_params=kept_params
        )
    if gradient_sum:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def to_device(module: nn.Module, device: torch.device | str | None) -> None:
    """Move ``module``'s tensors that are neither shards nor on ``meta`` to ``device`` in place (the
    parameter objects stay: FSDP2's ``ignored_params`` and the optimizer name them); None: no move."""
    if device is None:
        return
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and not isinstance(p, DTensor) and p.device.type != "meta":
                moved = nn.Parameter(p.data.to(device), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, moved)  # (``p.data =`` cannot change the device type)
        for name, b in sub._buffers.items():
            if b is not None and b.device.type != "meta":
                sub._buffers[name] = b.to(device)


def fp32_kept(model: nn.Module) -> tuple[dict[nn.Module, list[nn.Module]], set[nn.Parameter]]:
    """What ``model._keep_in_fp32_modules`` names (matched on a name's parts, as diffusers loads them):
    the kept modules that hold parameters, by the block (or the root) that contains them, and the
    kept bare parameters (a block's own ``scale_shift_table``)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    modules: dict[nn.Module, list[nn.Module]] = {}
    params: set[nn.Parameter] = set()
    if not keep:
        return modules, params
    blocks = {id(b): b for b in transformer_blocks(model)}
    for name, module in model.named_modules():
        parts = name.split(".")
        if parts[-1] not in keep or not any(True for _ in module.parameters()):
            continue
        if any(p in keep for p in parts[:-1]):
            continue  # inside a kept module already
        owner = next((b for b in _ancestors(model, parts) if id(b) in blocks), model)
        modules.setdefault(owner, []).append(module)
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[-1] in keep:  # a bare parameter (a kept module's own are its unit's)
            params.add(param)
    return modules, params


def _ancestors(model: nn.Module, parts: list[str]) -> list[nn.Module]:
    out, here = [], model
    for part in parts[:-1]:
        here = getattr(here, part)
        out.append(here)
    return out


def all_reduce_replicas(params: list[nn.Parameter], mesh: DeviceMesh) -> int:
    """HSDP with independent replicas: sum every trained parameter's local gradient shard over the
    ``replicate`` mesh dimension, in buckets (a replica that trained nothing adds zeros). A parameter
    FSDP leaves whole (:func:`fp32_kept`) has its gradient summed over every rank. Returns the bucket
    count (0 on a 1-D mesh without whole parameters: nothing to do)."""
    whole = [p for p in params if not isinstance(p, DTensor)]
    sharded = [p for p in params if isinstance(p, DTensor)] if mesh.ndim == 2 else []
    for p in whole + sharded:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets = 0
    with torch.no_grad():  # the local tensors are the gradients' own storage: summed in place
        if whole and dist.get_world_size() > 1:
            buckets += all_reduce_tensors([p.grad for p in whole], None)
        if sharded:
            buckets += all_reduce_tensors([p.grad.to_local() for p in sharded], mesh.get_group("replicate"))
    return buckets


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over FSDP2 shards and whole parameters together (torch's refuses the mix):
    the total norm of both, every gradient scaled by the same coefficient. Returns the norm."""
    whole = [p.grad for p in params if p.grad is not None and not isinstance(p, DTensor)]
    sharded = [p.grad for p in params if p.grad is not None and isinstance(p, DTensor)]
    if not (whole and sharded):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm_s = torch.nn.utils.get_total_norm(sharded).full_tensor()
    norm_w = torch.nn.utils.get_total_norm(whole).to(norm_s.device)
    total = torch.linalg.vector_norm(torch.stack([norm_s, norm_w]))
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for g in sharded + whole:
            g.mul_(coef)
    return total


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def local_numel(model: nn.Module, trainable_only: bool = False) -> int:
    """Elements this rank stores (its shards, for a sharded model)."""
    total = 0
    for p in model.parameters():
        if trainable_only and not p.requires_grad:
            continue
        total += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return total


def full_numel(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def shard_policy(
    policy,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
    independent_replicas: bool = False,
) -> None:
    """Shard a :class:`~digenrl.policy.model.Policy`'s transformer and rebuild its optimizer over the
    shards (same hyper-parameters). ``param_dtype`` defaults to the model's compute dtype
    (``model.dtype``). Call before the first step; ``Policy.optimizer_step`` works on shards.

    A policy built for a sharded rank (``shard_pending``) gets its fp32 masters, KL reference, EMA
    and old policy created here, from its shards: nothing full-size is ever allocated for them. A
    policy built whole (a test, a single process sharded later) has them split into shards."""
    net = policy.adapter.transformer
    dtype = param_dtype or policy.adapter.dtype
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    ref = policy._ref
    if ref is None and getattr(policy, "shard_pending", False) and not policy.lora:
        if (
            policy.cfg.algorithm.kl_beta > 0 or policy.cfg.algorithm.name == "online_dpo"
        ):  # full FT: the reference is the initial weights, in the
            ref = {n: p.dtype for n, p in net.named_parameters()}  # compute dtype they were loaded in
    # the policy lets go of the whole parameters (its optimizer is rebuilt over the shards): each block
    # parallelize moves to the device is freed once sharded, not kept to the end
    trains, policy.optimizer, policy.named_params, policy.params = policy.optimizer is not None, None, {}, []
    parallelize(
        net,
        mesh,
        param_dtype=dtype,
        activation_checkpointing=activation_checkpointing,
        independent_replicas=independent_replicas,
        device=policy.device if getattr(policy.adapter, "host_transformer", False) else None,
    )
    policy.adapter.host_transformer = False
    policy.named_params = {n: p for n, p in net.named_parameters() if n in trained}
    policy.params = list(policy.named_params.values())
    if isinstance(ref, dict):  # the initial weights' shards, in their compute dtype (1/N each)
        policy._ref = {n: p.detach().to(ref[n]).clone() for n, p in policy.named_params.items()}
    elif ref is not None:  # a whole frozen copy: keep its shards only
        whole = dict(ref.named_parameters())
        policy._ref = {n: shard_like(whole[n], p) for n, p in policy.named_params.items()}
    if trains:
        policy.build_optimizer()
    if getattr(policy, "shard_pending", False):
        if trains:
            policy.build_averages()  # train.ema / the old policy, fp32, from the shards
        policy.shard_pending = False
        return
    ema = getattr(policy, "ema", None)
    if ema is not None:  # train.ema: each rank averages its own shards (elementwise, so equal to unsharded)
        ema.params = policy.named_params
        ema.average = {n: shard_like(ema.average[n], p) for n, p in policy.named_params.items()}
    old = getattr(policy, "old", None)
    if old is not None:  # diffusion_nft: the old policy is sharded like the weights (elementwise EMA too)
        old.params = policy.named_params
        old.average = {n: shard_like(old.average[n], p) for n, p in policy.named_params.items()}


def shard_like(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's shard of the whole tensor ``full``, laid out like the sharded parameter ``like``
    (no communication: every rank holds ``full``)."""
    if not isinstance(like, DTensor):  # a parameter FSDP leaves whole (fp32_kept)
        return full.detach().to(like.device).clone()
    return distribute_tensor(
        full.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None
    )


def full_tensors(model: nn.Module, names: list[str] | None = None, trainable_only: bool = False):
    """Yield ``(name, full tensor)`` of the model's state, one tensor at a time, gathering each
    shard (a collective: every rank of the mesh must iterate in the same order). Memory stays at
    one full tensor beyond the shards, so a sender can stream them into broadcast buckets."""
    params = dict(model.named_parameters())
    wanted = set(names) if names is not None else None
    for name, value in model.state_dict().items():
        if wanted is not None and name not in wanted:
            continue
        if trainable_only and not (name in params and params[name].requires_grad):
            continue
        yield name, (value.full_tensor() if isinstance(value, DTensor) else value).detach()

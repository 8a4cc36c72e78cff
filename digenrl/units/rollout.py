"""The rollout unit: m prompt groups (or part of one) generated and decoded with ONE policy version.

Its model forwards run in the train units' batches (:func:`forward_batches`), so an on-policy
ratio is exactly 1 on the same kernels (docs/architecture.md, "Units and versions").
"""

from __future__ import annotations

import torch

from digenrl.adapters.pixels import decode_to_host
from digenrl.algorithms import grpo
from digenrl.algorithms.sde import (
    sample,
)
from digenrl.data.prompts import Prompt
from digenrl.rewards.base import Decoded, score
from digenrl.units.branch import branched_sample, node_rng, prefix_noise, prefix_selection
from digenrl.units.klref import RolloutReference
from digenrl.units.nft import is_forward_process, noise_plan
from digenrl.units.rows import minibatch_rows, stream_seed
from digenrl.units.samples import GroupRNG, Samples


@torch.no_grad()
def rollout_unit(
    policy,
    prompts: list[Prompt],
    group_ids: list[int],
    iteration: int,
    seed: int,
    samples: tuple[int, int] | None = None,
    batch: int | None = None,
    whole_forwards: bool = False,
    reference_steps: list[int] | None = None,
) -> tuple[Samples, Decoded]:
    """Generate G samples for each prompt with the policy's current weights and decode them (unscored:
    :func:`scored`, or any other mode's :func:`~digenrl.rewards.base.score`, adds the rewards);
    ``samples = (lo, hi)``: only samples lo..hi-1 of each group (a sub-group unit), the same ones a
    whole-group unit generates. ``batch``: samples per model forward (``engine.rollout_batch`` /
    ``engine.colocated_batch``: the trainer's log-probs then match to rounding); None: the train
    forwards' batches (:func:`forward_batches`, bit for bit). ``whole_forwards`` (without ``batch``):
    one forward of all the samples per step (a sharded group's ranks whose shares would run
    different numbers). ``reference_steps``: the KL reference at rollout in a sharded group's lockstep
    (:class:`~digenrl.units.klref.RolloutReference`)."""
    cfg, ad = policy.cfg, policy.adapter
    G, n_steps = cfg.algorithm.group_size, cfg.sampling.steps
    lo, hi = samples or (0, G)
    if not 0 <= lo < hi <= G:
        raise ValueError(f"samples {samples} is not a range of 0..{G}")
    n = hi - lo  # samples per group in this unit
    rng = GroupRNG([stream_seed(seed, iteration, gid) for gid in group_ids], G, (lo, hi))
    # an edit prompt's input image (its path, in the metadata) conditions it
    cond = ad.cond_for([p.text for p in prompts], [p.meta.get("image") for p in prompts]).repeat_interleave(n)
    noise = rng((len(prompts) * n, *ad.latent_shape()))
    sigmas = ad.sigmas(n_steps)
    nft, noise_seeds = is_forward_process(cfg), None
    if nft:  # K noise levels per sample and their noise seeds; the rollout itself is a plain sampler
        sde_mask, train_idx, noise_seeds = noise_plan(cfg, iteration, seed, group_ids, (lo, hi))
    else:
        sde_mask, train_idx = _timestep_selection(cfg, iteration, seed, group_ids, (lo, hi))
    k = cfg.algorithm.shared_prefix  # > 0: the group shares its noise and first k (ODE) steps
    if k:
        sde_mask, train_idx = prefix_selection(sde_mask, train_idx, k)
    batches = (
        own_batches(len(noise), n_steps, batch)
        if batch is not None
        else None
        if whole_forwards or nft
        else forward_batches(train_idx, cfg, n, lo, _trainer_shards(policy))
    )
    kind, eta = cfg.sampling.sde, cfg.sampling.noise_level
    reference = None  # algorithm.kl_reference rollout: the KL reference at the trained steps, here
    if policy.settings.kl_reference == "rollout" and cfg.algorithm.kl_beta > 0 and not nft:
        reference = RolloutReference(policy.reference, train_idx, kind, eta, reference_steps)
    if k:
        start = prefix_noise(seed, iteration, group_ids, tuple(ad.latent_shape())).to(ad.device)
        tree = [tuple(t) for t in cfg.algorithm.branch_tree]
        nodes = node_rng(seed, iteration, group_ids)
        traj = branched_sample(
            ad, cond.to(ad.device), start, n, sigmas, kind, eta, rng, sde_mask, batches, k, tree, nodes
        )
    else:
        traj = sample(
            ad, cond.to(ad.device), noise.to(ad.device), sigmas, kind, eta, rng, sde_mask, batches, reference
        )
    pixels = decode_to_host(ad, traj.latents[:, -1])  # scored off the device (whatever mode scores it)
    texts = [p.text for p in prompts for _ in range(n)]
    metas = [p.meta for p in prompts for _ in range(n)]
    samples = Samples(
        iteration=iteration,
        version=policy.version,
        group_ids=list(group_ids),
        prompts=texts,
        cond=cond.to("cpu"),
        # NFT trains on the clean samples only: a copy, so no view drags the trajectory's storage along
        latents=(traj.latents[:, -1:].clone() if nft else traj.latents).cpu(),
        log_probs=(traj.log_probs[:, :0].clone() if nft else traj.log_probs).cpu(),
        sigmas=sigmas.cpu(),
        sde_mask=sde_mask,
        train_idx=train_idx,
        preview=(pixels[::n].clamp(0, 1) * 255).round().to(torch.uint8),
        first_sample=lo,
        noise_seeds=noise_seeds,
        step_noise=None if nft else traj.noise.cpu(),  # diffusion_nft: no trajectory travels
        ref_means=None if reference is None else reference.result(tuple(ad.latent_shape())),
        timings={"ref_forwards": 0 if reference is None else reference.forwards},
    )
    return samples, Decoded(pixels, texts, metas)


def scored(rollout: tuple[Samples, Decoded], reward_fn) -> Samples:
    """A rollout unit's samples scored in place by ``reward_fn`` (the inline mode of scoring)."""
    samples, decoded = rollout
    return samples.take(score(reward_fn, decoded))


def preflight_reward(reward_fn, adapter, prompts: list[Prompt]) -> dict[str, float]:
    """Dry-run the rewards on two random samples of the adapter's decoded shape, before training:
    a reward that crashes, or returns NaN / inf / the wrong shape, fails here naming itself."""
    with torch.no_grad():
        shape = tuple(adapter.decode(torch.zeros(1, *adapter.latent_shape(), device=adapter.device))[0].shape)
    head = prompts[:2]
    return reward_fn.check([p.text for p in head], shape, [p.meta for p in head])


def _timestep_selection(cfg, iteration: int, seed: int, group_ids: list[int], samples: tuple[int, int]):
    """SDE steps (shared by the whole iteration) and trained steps per sample (per group's own seed),
    for samples [lo, hi) of each group."""
    ts, n_steps, G = cfg.algorithm.timesteps, cfg.sampling.steps, cfg.algorithm.group_size
    lo, hi = samples

    def select(n, *stream):
        gen = torch.Generator().manual_seed(stream_seed(seed, iteration, *stream))
        return grpo.select_timesteps(
            ts.mode,
            n_steps,
            n,
            gen,
            fraction=ts.fraction,
            window=ts.window,
            iteration=iteration,
            shift_every=ts.window_shift_every,
            window_range=ts.window_range,
        )

    sde_mask, _ = select(1, "window")
    if ts.mode == "random":
        return sde_mask, torch.cat([select(G, gid, "t")[1][lo:hi] for gid in group_ids])
    return sde_mask, select(len(group_ids) * (hi - lo), "window")[1]  # the same row for every sample


def forward_batches(
    train_idx: torch.Tensor, cfg, per_group: int | None = None, first: int = 0, shards: int = 1
) -> list[list[torch.Tensor]] | None:
    """Per denoising step, the rows of each model forward of a rollout unit (``train_idx``: its
    samples' trained steps; ``per_group`` / ``first`` as in :func:`minibatch_rows`): the forwards
    :func:`train_unit` runs -- per micro-batch of every mini-batch and per TSP rank, the samples
    that train the step -- and each micro-batch's other samples together. ``shards``: the trainer's
    FSDP degree; each of its ranks trains an equal share of every mini-batch in micro-batches of its
    own (``engine.fsdp_group.share_rows``), so the micro-batches are cut per share. None: one forward
    of the whole unit at every step is already that."""
    n, S = len(train_idx), cfg.train.optimizer_steps
    degree = 1 if cfg.placement.mode == "local" else cfg.engine.tsp_degree  # the local trainer has no TSP
    rank_of_position = torch.arange(train_idx.shape[1]) % degree
    micro = []
    for s in range(S):
        rows = minibatch_rows(n, cfg.algorithm.group_size, s, S, per_group, first)
        for r in range(shards):  # FSDP rank r's share, as share_rows cuts it, in micro-batches
            share = rows[len(rows) * r // shards : len(rows) * (r + 1) // shards]
            micro += [mb for mb in share.split(cfg.train.micro_batch) if len(mb)]
    per_step = []
    for i in range(cfg.sampling.steps):
        batches = []
        for mb in micro:
            hit = train_idx[mb] == i  # (samples, positions): a sample trains a step at most once
            for rank in range(degree):
                trains = hit[:, rank_of_position == rank].any(1)
                if trains.any():
                    batches.append(mb[trains])
            rest = mb[~hit.any(1)]
            if len(rest):
                batches.append(rest)
        per_step.append(batches)
    whole = all(len(b) == 1 and len(b[0]) == n for b in per_step)
    return None if whole else per_step


def _trainer_shards(policy) -> int:
    """The FSDP degree whose per-rank shares a rollout worker's forwards follow (a rank of a sharded
    group that generates, TAG or colocated, generates shares of its own: the unit-wide batches)."""
    return policy.settings.fsdp if policy.optimizer is None else 1


def own_batches(n: int, steps: int, batch: int) -> list[list[torch.Tensor]] | None:
    """Per denoising step, the rows of each forward of ``n`` samples in chunks of ``batch`` (None: one
    forward of all)."""
    return None if batch >= n else [list(torch.arange(n).split(batch)) for _ in range(steps)]

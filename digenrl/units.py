"""The two units of work (docs/architecture.md), as plain functions any driver can call.

- :func:`rollout_unit`: m whole prompt groups, or a part of one group (samples lo..hi-1 of it),
  generated with ONE policy version from the first denoising step to the reward.
- :func:`train_unit`: a set of rolled-out samples x a subset of their trained timesteps; it only
  accumulates gradients (the driver calls ``Policy.optimizer_step`` once per mini-batch:
  ``train.optimizer_steps`` of them per iteration, mini-batch s being the s-th slice of every
  group's samples, :func:`minibatch_rows`).

A rollout unit runs its model forwards in the train forwards' batches (:func:`forward_batches`): the
trainer's recomputed log-prob of a sample is then the same forward in the same batch as its
behaviour log-prob, so an on-policy ratio is exactly 1 (on the same kernels), not 1 up to rounding.

Randomness is drawn per prompt group from a seed of (run seed, iteration, group id), so a sample
is the same whichever unit, worker or batch it is generated in: a part of a group draws the whole
group's noise from the group's stream and keeps its own samples' share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from digenrl import units_nft
from digenrl.adapters.base import Cond
from digenrl.adapters.guidance import backward_through_velocity
from digenrl.algorithms import grpo
from digenrl.algorithms.sde import (
    logprob_of_velocity,
    recompute_logprob,
    sample,
    step_scale,
    transition_logprob,
)
from digenrl.prompts import Prompt
from digenrl.unit_rows import stream_seed, train_batches
from digenrl.units_nft import is_nft, noise_plan


class GroupRNG:
    """One torch.Generator per prompt group; draws the batch's noise as a concatenation of groups.

    ``samples``: the samples [lo, hi) of each group the batch holds (a sub-group unit); every draw
    still takes all ``group_size`` samples' noise from the group's stream, so sample i gets the same
    noise whichever part of the group it is generated in."""

    def __init__(self, seeds: list[int], group_size: int, samples: tuple[int, int] | None = None):
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.g = group_size
        self.lo, self.hi = samples or (0, group_size)

    def __call__(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.cat(
            [torch.randn((self.g, *shape[1:]), generator=gen)[self.lo : self.hi] for gen in self.gens]
        )


@dataclass
class Samples:
    """A rollout unit's output; CPU tensors so it can travel between processes."""

    iteration: int
    version: int  # policy version that generated every sample
    group_ids: list[int]
    prompts: list[str]  # one per sample (each prompt repeated G times)
    cond: Cond
    latents: torch.Tensor  # (B, N+1, ...) fp32; diffusion_nft: (B, 1, ...), the clean sample only
    log_probs: torch.Tensor  # (B, N) behaviour log-probs; diffusion_nft: (B, 0)
    sigmas: torch.Tensor
    sde_mask: torch.Tensor  # (N,)
    train_idx: torch.Tensor  # (B, T) steps to train; diffusion_nft: (B, K) noise levels (sigma indices)
    rewards: torch.Tensor  # (B,) weighted total
    reward_parts: dict[str, torch.Tensor]
    advantages: torch.Tensor | None = None  # (B,), set once the group's rewards are known
    preview: torch.Tensor | None = None  # uint8 pixels of the first sample of each group
    timings: dict[str, float] = field(default_factory=dict)
    first_sample: int = 0  # a sub-group unit: the in-group index of its groups' first sample
    noise_seeds: torch.Tensor | None = None  # diffusion_nft: (B, K) seeds of each level's forward noise
    step_noise: torch.Tensor | None = None  # (B, N, ...) x_{i+1} - mu_behaviour_i (stale samples' gradient)

    def __len__(self) -> int:
        return len(self.prompts)


#: the tensor fields of :class:`Samples` that hold one row per sample (None where a run has none):
#: what cutting a unit's rows or joining its shares touches, beside ``prompts``, ``cond`` and
#: ``reward_parts``. A per-sample field added to Samples belongs here, or a split unit loses it.
ROW_FIELDS = ("latents", "log_probs", "train_idx", "rewards", "advantages", "noise_seeds", "step_noise")


@torch.no_grad()
def rollout_unit(
    policy,
    reward_fn,
    prompts: list[Prompt],
    group_ids: list[int],
    iteration: int,
    seed: int,
    samples: tuple[int, int] | None = None,
    batch: int | None = None,
    whole_forwards: bool = False,
) -> Samples:
    """Generate G samples for each prompt with the policy's current weights, decode and score them;
    ``samples = (lo, hi)``: only samples lo..hi-1 of each group (a sub-group unit), the same ones a
    whole-group unit generates. ``batch``: samples per model forward (a rollout-only worker's own,
    ``engine.rollout_batch``: the trainer's log-probs then match to rounding); None: the train
    forwards' batches (:func:`forward_batches`, bit for bit). ``whole_forwards``: one forward of all
    the samples per step, not the train forwards' batches (a sharded group's ranks whose shares
    would run different numbers)."""
    cfg, ad = policy.cfg, policy.adapter
    G, n_steps = cfg.algorithm.group_size, cfg.sampling.steps
    lo, hi = samples or (0, G)
    if not 0 <= lo < hi <= G:
        raise ValueError(f"samples {samples} is not a range of 0..{G}")
    n = hi - lo  # samples per group in this unit
    rng = GroupRNG([stream_seed(seed, iteration, gid) for gid in group_ids], G, (lo, hi))
    cond = ad.cond_for([p.text for p in prompts]).repeat_interleave(n)
    noise = rng((len(prompts) * n, *ad.latent_shape()))
    sigmas = ad.sigmas(n_steps)
    nft, noise_seeds = is_nft(cfg), None
    if nft:  # K noise levels per sample and their noise seeds; the rollout itself is a plain sampler
        sde_mask, train_idx, noise_seeds = noise_plan(cfg, iteration, seed, group_ids, (lo, hi))
    else:
        sde_mask, train_idx = _timestep_selection(cfg, iteration, seed, group_ids, (lo, hi))
    traj = sample(
        ad,
        cond.to(ad.device),
        noise.to(ad.device),
        sigmas,
        cfg.sampling.sde,
        cfg.sampling.noise_level,
        rng,
        sde_mask,
        batches=None
        if whole_forwards
        else own_batches(len(noise), n_steps, batch)
        if batch is not None
        else None
        if nft
        else forward_batches(train_idx, cfg, n, lo),
    )
    pixels = ad.decode(traj.latents[:, -1])
    texts = [p.text for p in prompts for _ in range(n)]
    metas = [p.meta for p in prompts for _ in range(n)]
    total, parts = reward_fn(pixels, texts, metas)
    return Samples(
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
        rewards=total,
        reward_parts=parts,
        preview=(pixels[::n].clamp(0, 1) * 255).round().to(torch.uint8).cpu(),
        first_sample=lo,
        noise_seeds=noise_seeds,
        step_noise=None if nft else traj.noise.cpu(),  # diffusion_nft: no trajectory travels
    )


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


def assign_advantages(batches: list[Samples], cfg) -> None:
    """Group-relative advantages; with global std, over all the given batches together.

    ``reward.combine: weighted_sum`` normalises the weighted total per group;
    ``per_reward_advantage`` (DanceGRPO / MixGRPO) normalises each component per group and sums
    the advantages with the components' weights, clipping the sum. A sample whose total is NaN
    (``nan_policy: drop``) gets advantage 0 and is left out of every group statistic.
    """
    alg, rc = cfg.algorithm, cfg.reward
    chunks = [batches] if alg.std == "global" else [[b] for b in batches]
    for chunk in chunks:
        total = torch.cat([b.rewards for b in chunk]).float()
        if rc.combine == "weighted_sum":
            adv = grpo.group_advantages(total, alg.group_size, alg.std, alg.adv_clip, ddof=alg.std_ddof)
        else:
            dropped = torch.isnan(total)
            adv = torch.zeros_like(total)
            for term in rc.components:
                r = (
                    torch.cat([b.reward_parts[term.name] for b in chunk])
                    .float()
                    .masked_fill(dropped, float("nan"))
                )
                adv += term.weight * grpo.group_advantages(
                    r, alg.group_size, alg.std, float("inf"), ddof=alg.std_ddof
                )
            adv = adv.clamp(-alg.adv_clip, alg.adv_clip)
        for b, a in zip(chunk, adv.split([len(b) for b in chunk])):
            b.advantages = a


def train_unit(
    policy,
    samples: Samples,
    total_terms: int,
    tsp_rank: int = 0,
    tsp_degree: int = 1,
    minibatch: int = 0,
    minibatches: int = 1,
    lockstep: list[list[int]] | None = None,
    padding: bool = False,
) -> dict:
    """Accumulate the gradient of this unit's share of the iteration loss.

    The loss of a mini-batch (the whole iteration with ``train.optimizer_steps: 1``) is the mean
    over its (sample, trained step) terms; each term here is divided by ``total_terms``, the
    mini-batch's count, so the units' gradients add up to the mini-batch gradient. The ratio is to
    the behaviour policy (PPO: ~1 in an on-policy first mini-batch, moving after each step); a
    stale sample (``samples.version`` older than the policy's) is clipped around the proximal
    policy, the weights at the start of the current mini-batch (decoupled PPO).
    Trains the trained-step positions j with j % tsp_degree == tsp_rank (time-step parallelism)
    of the samples of mini-batch ``minibatch`` of ``minibatches`` (:func:`minibatch_rows`).
    ``lockstep``: per micro-batch, the steps to run a forward / backward at (a sharded group's rank,
    :func:`~digenrl.engine.fsdp_group.lockstep_steps`: every rank runs the same passes); at a step
    none of this rank's samples trains, the pass runs on one row and adds nothing; ``padding``: the
    rank holds no sample of the unit (``samples`` is one row to run the group's passes on).
    """
    cfg, ad = policy.cfg, policy.adapter
    if is_nft(cfg):  # DiffusionNFT: flow matching on forward-noised clean samples
        passes = None if lockstep is None else len(lockstep)  # a sharded group's micro-batches
        return units_nft.train_unit(
            policy, samples, total_terms, tsp_rank, tsp_degree, minibatch, minibatches, passes, padding
        )
    alg, kind, eta = cfg.algorithm, cfg.sampling.sde, cfg.sampling.noise_level
    stale = samples.version < policy.version  # one-step async: decoupled PPO
    stats = _Stats()
    positions = [j for j in range(samples.train_idx.shape[1]) if j % tsp_degree == tsp_rank]
    sig = samples.sigmas.to(ad.device)
    batches = train_batches(
        len(samples),
        cfg,
        minibatch,
        minibatches,
        len(samples) // len(samples.group_ids),
        samples.first_sample,
    )
    real = 0 if padding else len(batches)
    if lockstep is not None and len(lockstep) > real:  # an uneven split: the group's other micro-batches
        batches = batches[:real] + [batches[0][:1]] * (len(lockstep) - real)  # run as zero-weighted passes
    for k, mb in enumerate(batches):
        cond = samples.cond.select(mb).to(ad.device)
        adv = samples.advantages[mb].to(ad.device)
        mine = samples.train_idx[mb][:, positions]  # (samples, this rank's positions): steps to train
        steps = mine.unique().tolist() if lockstep is None else lockstep[k]
        for i in steps:  # the samples training step i share one forward (each trains it once)
            sel = (mine == i).any(1).nonzero().squeeze(1)
            # lockstep: a pass the rank's group runs, on one row, weighted 0
            idle = len(sel) == 0 or k >= real
            if idle:
                sel = sel.new_zeros(1)
            rows = mb[sel]
            x = samples.latents[rows, i].to(ad.device)
            x_next = samples.latents[rows, i + 1].to(ad.device)
            c = cond.select(sel) if len(sel) < len(mb) else cond
            behaviour = samples.log_probs[rows, i].to(ad.device)
            noise = None
            if stale and alg.stale_gradient == "recentred" and samples.step_noise is not None:
                noise = samples.step_noise[rows, i].to(ad.device)
            mu_ref = None
            if alg.kl_beta > 0:
                with torch.no_grad(), policy.reference():
                    _, mu_ref, _ = recompute_logprob(ad, c, x, x_next, sig, i, kind, eta)

            def objective(
                v,
                x=x,
                x_next=x_next,
                i=i,
                behaviour=behaviour,
                a=adv[sel],
                mu_ref=mu_ref,
                noise=noise,
                scale=1.0 - idle,
            ):
                logp, mu, std = logprob_of_velocity(v, x, x_next, sig, i, kind, eta)
                if noise is not None:  # the stale sample's noise around the current mean
                    logp = (logp.detach(), recentred_logprob(kind, mu, noise, sig, i, std))
                scalar, extras = term_loss(alg, logp, behaviour, a, stale, mu, mu_ref, std, total_terms)
                return scalar * scale, (*extras, logp[0] if isinstance(logp, tuple) else logp.detach())

            sigma = sig[i].expand(x.shape[0])
            loss, st, w, kl, logp = backward_through_velocity(ad, x, sigma, c, objective)
            if idle:
                continue
            if w is not None:
                stats.add_is(w)
            elif minibatch == 0:  # on-policy: the trainer should reproduce the rollout's log-prob
                stats.add_mismatch(logp - behaviour)
            if kl is not None:
                stats.kl += kl.sum().item()
            stats.add(loss, st, len(rows), total_terms)
    return stats.as_dict()


def recentred_logprob(kind: str, mu: torch.Tensor, noise: torch.Tensor, sigmas, i: int, std: float):
    """log N(mu.detach() + noise; mu, scale^2): the stale sample's recorded step noise put around the
    current step mean. Its value is the behaviour log-prob; its gradient is the on-policy score
    noise / scale^2 * dmu, without the stale drift (mu_behaviour - mu) / scale^2 * dmu that the raw
    sample's gradient carries (docs/algorithms.md, "Stale samples")."""
    scale = step_scale(kind, float(sigmas[i]), float(sigmas[i + 1]), std)
    return transition_logprob(kind, mu.detach() + noise, mu, scale)


def term_loss(alg, logp, behaviour, adv, stale: bool, mu, mu_ref, std: float, total_terms: int):
    """(the scalar to backpropagate, (per-term loss, ratio stats, IS weight or None, KL or None) detached).

    On-policy: PPO-clip to the behaviour log-prob. Stale (one-step async): clip around the proximal
    policy and weight by the capped exp(logp_prox - logp_behaviour) (decoupled PPO). ``logp`` may be a
    pair (the sample's log-prob under the current weights, detached; the recentred log-prob to
    differentiate, :func:`recentred_logprob`). ``mu_ref``: the KL reference's step mean (None: no KL term)."""
    w = kl = None
    prox, logp = logp if isinstance(logp, tuple) else (logp.detach(), logp)
    if stale:
        w = torch.exp(prox - behaviour).clamp(max=alg.is_cap)
        loss, st = grpo.clipped_objective(logp, logp.detach(), adv, alg.clip_range, w)
    else:
        loss, st = grpo.clipped_objective(logp, behaviour, adv, alg.clip_range)
    if mu_ref is not None:
        kl = grpo.kl_to_reference(mu, mu_ref, std)
        loss = loss + alg.kl_beta * kl
        kl = kl.detach()
    return loss.sum() / total_terms, (loss.detach(), st, w, kl)


class _Stats:
    """Sums over a unit's terms; merged across units by :func:`merge_stats`."""

    def __init__(self):
        self.loss = self.kl = self.ratio_sum = self.clip_sum = 0.0
        self.terms = 0
        self.ratio_max, self.ratio_min = float("-inf"), float("inf")
        self.is_sum, self.is_max, self.is_n = 0.0, 0.0, 0
        self.mismatch_sum, self.mismatch_n = 0.0, 0  # |logp - behaviour logp| over on-policy terms

    def add(self, loss, st, n, total_terms):
        self.loss += loss.sum().item() / total_terms
        self.terms += n
        self.ratio_sum += st["ratio_mean"] * n
        self.clip_sum += st["clip_frac"] * n
        self.ratio_max, self.ratio_min = (
            max(self.ratio_max, st["ratio_max"]),
            min(self.ratio_min, st["ratio_min"]),
        )

    def add_is(self, w):
        self.is_sum += w.sum().item()
        self.is_max = max(self.is_max, w.max().item())
        self.is_n += w.numel()

    def add_mismatch(self, diff):
        self.mismatch_sum += diff.abs().sum().item()
        self.mismatch_n += diff.numel()

    def as_dict(self) -> dict:
        return dict(vars(self))


def forward_batches(
    train_idx: torch.Tensor, cfg, per_group: int | None = None, first: int = 0
) -> list[list[torch.Tensor]] | None:
    """Per denoising step, the rows of each model forward of a rollout unit (``train_idx``: its
    samples' trained steps; ``per_group`` / ``first`` as in :func:`minibatch_rows`): the forwards
    :func:`train_unit` runs -- per micro-batch of every mini-batch and per TSP rank, the samples
    that train the step -- and each micro-batch's other samples together. None: one forward of the
    whole unit at every step is already that."""
    n, S = len(train_idx), cfg.train.optimizer_steps
    degree = 1 if cfg.placement.mode == "local" else cfg.engine.tsp_degree  # the local trainer has no TSP
    rank_of_position = torch.arange(train_idx.shape[1]) % degree
    micro = [mb for s in range(S) for mb in train_batches(n, cfg, s, S, per_group, first)]
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


def own_batches(n: int, steps: int, batch: int) -> list[list[torch.Tensor]] | None:
    """Per denoising step, the rows of each forward of ``n`` samples in chunks of ``batch`` (None: one
    forward of all)."""
    return None if batch >= n else [list(torch.arange(n).split(batch)) for _ in range(steps)]


def merge_stats(parts: list[dict], minibatches: int = 1) -> dict:
    """Combine unit stats into the iteration's metrics (``loss``: the mean of the mini-batches' losses)."""
    if parts and "nft_r" in parts[0]:  # DiffusionNFT's stats (no ratios)
        return units_nft.merge_stats(parts, minibatches)
    terms = sum(p["terms"] for p in parts) or 1
    out = {
        "loss": sum(p["loss"] for p in parts) / minibatches,
        "kl": sum(p["kl"] for p in parts) / terms,
        "ratio_mean": sum(p["ratio_sum"] for p in parts) / terms,
        "ratio_max": max(p["ratio_max"] for p in parts),
        "ratio_min": min(p["ratio_min"] for p in parts),
        "clip_frac": sum(p["clip_sum"] for p in parts) / terms,
    }
    mismatch_n = sum(p["mismatch_n"] for p in parts)
    if mismatch_n:
        out["logprob_mismatch"] = sum(p["mismatch_sum"] for p in parts) / mismatch_n
    is_n = sum(p["is_n"] for p in parts)
    if is_n:
        out["is_weight_mean"] = sum(p["is_sum"] for p in parts) / is_n
        out["is_weight_max"] = max(p["is_max"] for p in parts)
    return out

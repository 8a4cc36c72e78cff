"""DiffusionNFT's side of the two units (``algorithm.name: diffusion_nft``; the math:
:mod:`digenrl.algorithms.nft`, docs/algorithms.md).

Details: docs/modules.md, `digenrl.units.nft`.
"""

from __future__ import annotations

import torch

from digenrl.adapters.guidance import backward_through_velocity
from digenrl.algorithms import nft
from digenrl.units.rows import host_values, stream_seed, train_batches


def is_nft(cfg) -> bool:
    return cfg.algorithm.name == "diffusion_nft"


def is_forward_process(cfg) -> bool:
    """DiffusionNFT, AWM, online DPO: trained on forward-noised clean samples, no SDE log-probs."""
    return cfg.algorithm.name in ("diffusion_nft", "awm", "online_dpo")


def noise_levels(cfg) -> int:
    """K: forward-noised copies per sample (null: one per rollout step)."""
    alg = cfg.algorithm
    section = {"awm": alg.awm, "online_dpo": alg.dpo}.get(alg.name, alg.nft)
    return section.noise_levels or cfg.sampling.steps


def noise_plan(cfg, iteration: int, seed: int, group_ids: list[int], samples: tuple[int, int]):
    """(sde_mask (N,) all True, level index (B, K) into the rollout sigmas, noise seeds (B, K) int64)
    for samples [lo, hi) of each group: per sample a random K of the N sigmas (as the reference
    shuffles each sample's timesteps and takes the first K), and one seed per (sample, level)."""

    n, k, G = cfg.sampling.steps, noise_levels(cfg), cfg.algorithm.group_size
    lo, hi = samples
    idx, seeds = [], []
    for gid in group_ids:
        gen = torch.Generator().manual_seed(stream_seed(seed, iteration, gid, "nft-levels"))
        levels = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(G)])
        idx.append(levels[lo:hi])
        seeds.append(
            torch.tensor(
                [
                    [stream_seed(seed, iteration, gid, q, j, "nft-noise") for j in range(k)]
                    for q in range(lo, hi)
                ]
            )
        )
    return torch.ones(n, dtype=torch.bool), torch.cat(idx), torch.cat(seeds)


def noise_of(seeds: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The forward noise eps of each row (one seed each)."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds])


def train_unit(
    policy,
    samples,
    total_terms: int,
    tsp_rank: int = 0,
    tsp_degree: int = 1,
    minibatch: int = 0,
    minibatches: int = 1,
    micro_batches: int | None = None,
    padding: bool = False,
) -> dict:
    """Accumulate this unit's share of the mini-batch's NFT loss gradient (docstring of the module).
    A sharded group's rank (:func:`~digenrl.engine.fsdp_group.train_share`) runs ``micro_batches``,
    its group's most: every micro-batch runs the same passes (one per noise level), so a rank with
    fewer -- or none, ``padding`` (``samples`` is one row) -- runs the rest on one row, weighted 0."""

    cfg, ad = policy.cfg, policy.adapter
    alg = cfg.algorithm
    beta = alg.nft.beta
    stats = NftStats()
    positions = [j for j in range(samples.train_idx.shape[1]) if j % tsp_degree == tsp_rank]
    sig = samples.sigmas.float()
    per_group = len(samples) // len(samples.group_ids)
    batches = train_batches(len(samples), cfg, minibatch, minibatches, per_group, samples.first_sample)
    real = 0 if padding else len(batches)
    if micro_batches is not None and micro_batches > real:  # an uneven split: the group's other passes
        batches = batches[:real] + [batches[0][:1]] * (micro_batches - real)
    for k, mb in enumerate(batches):
        if not positions:
            break
        weight = 0.0 if k >= real else 1.0  # a pass only the group's collectives need adds nothing
        x0 = samples.latents[mb, -1].float().to(ad.device)
        cond = samples.cond.select(mb).to(ad.device)
        r = nft.optimality(samples.advantages[mb], alg.adv_clip).to(ad.device)
        noisy = []  # (the levels as velocity takes them, on the device, x_t)
        for j in positions:
            levels = sig[samples.train_idx[mb, j]]  # on the host
            t = levels.to(ad.device)
            eps = noise_of(samples.noise_seeds[mb, j], tuple(x0.shape[1:])).to(ad.device)
            noisy.append((ad.sigma_input(levels), t, nft.forward_noise(x0, t, eps)))
        with torch.no_grad(), policy.old_weights():  # v_old: every level's forward in one weight swap
            olds = [ad.velocity(x_t, s, cond) for s, _, x_t in noisy]
        for (s, t, x_t), v_old in zip(noisy, olds):
            v_ref = None
            if alg.kl_beta > 0:
                with torch.no_grad(), policy.reference():
                    v_ref = ad.velocity(x_t, s, cond)
                stats.ref_forwards += 1

            def objective(v, v_old=v_old, x_t=x_t, t=t, v_ref=v_ref, weight=weight):
                loss, parts = nft.nft_loss(v, v_old, x_t, x0, t, r, beta, alg.adv_clip)
                kl = None
                if v_ref is not None:
                    kl = nft.velocity_kl(v, v_ref)
                    loss = loss + alg.kl_beta * kl
                    kl = kl.detach()
                return weight * loss.sum() / total_terms, (loss.detach(), parts, kl)

            loss, parts, kl = backward_through_velocity(ad, x_t, s, cond, objective)
            if weight:
                stats.add(loss, parts, kl, r, total_terms)
    return stats.as_dict()


class NftStats:
    """Sums over a unit's (sample, noise level) terms; merged by :func:`merge_stats` (and summed
    over FSDP ranks' shares by the engine's ``combine_rank_stats``)."""

    def __init__(self):
        self.loss = self.kl = 0.0
        self.terms = 0
        self.nft_positive = self.nft_negative = self.nft_old_deviation = self.nft_r = 0.0
        self.ref_forwards = 0  # KL reference forwards this unit ran

    def add(self, loss, parts, kl, r, total_terms):
        self.loss += loss.sum() / total_terms  # on the device until the unit ends (rows.host_values)
        self.terms += loss.numel()
        self.nft_positive += parts["positive"].sum()
        self.nft_negative += parts["negative"].sum()
        self.nft_old_deviation += parts["old_deviation"].sum()
        self.nft_r += r.sum()
        if kl is not None:
            self.kl += kl.sum()

    def as_dict(self) -> dict:
        return host_values(vars(self))


def merge_nft_stats(parts: list[dict], minibatches: int = 1) -> dict:
    """The iteration's metrics from the units' stats: ``loss`` (mean of the mini-batches' losses), and
    per-term means of the KL, the positive / negative x0 errors, the old-policy deviation and r."""
    terms = sum(p["terms"] for p in parts) or 1
    out = {"loss": sum(p["loss"] for p in parts) / minibatches, "kl": sum(p["kl"] for p in parts) / terms}
    for key in ("nft_positive", "nft_negative", "nft_old_deviation", "nft_r"):
        out[key] = sum(p[key] for p in parts) / terms
    return out

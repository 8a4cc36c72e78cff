"""The train unit of AWM and online DPO (``algorithm.name: awm | online_dpo``; the math:
:mod:`digenrl.algorithms.awm`, :mod:`digenrl.algorithms.dpo`, docs/algorithms.md).

Details: docs/modules.md, `digenrl.units.forward`.
"""

from __future__ import annotations

import torch

from digenrl.adapters.guidance import backward_through_velocity
from digenrl.algorithms import awm, dpo, nft
from digenrl.units.nft import noise_of
from digenrl.units.rows import host_values, train_batches


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
    """Accumulate this unit's share of the mini-batch's AWM / DPO loss gradient (module docstring)."""
    cfg, ad = policy.cfg, policy.adapter
    alg = cfg.algorithm
    stats = ForwardStats()
    positions = [j for j in range(samples.train_idx.shape[1]) if j % tsp_degree == tsp_rank]
    sig = samples.sigmas.float()
    per_group = len(samples) // len(samples.group_ids)
    batches = train_batches(len(samples), cfg, minibatch, minibatches, per_group, samples.first_sample)
    real = 0 if padding else len(batches)
    if micro_batches is not None and micro_batches > real:  # the group's other passes, weighted 0
        batches = batches[:real] + [batches[0][:1]] * (micro_batches - real)
    for k, mb in enumerate(batches):
        weight = 0.0 if k >= real else 1.0
        if alg.name == "online_dpo":
            rows, chosen, counts = _pairs(samples, mb, per_group)
        else:
            rows, chosen, counts = mb, mb, None
        if len(rows) == 0:  # no pair here: the passes still run (lockstep) on an identical pair, weight 0
            rows, chosen, counts, weight = mb[:1].repeat(2), mb[:1], torch.ones(1), 0.0
        x0 = samples.latents[rows, -1].float().to(ad.device)
        cond = samples.cond.select(rows).to(ad.device)
        for j in positions:
            levels = sig[samples.train_idx[chosen, j]]  # on the host
            eps = noise_of(samples.noise_seeds[chosen, j], tuple(x0.shape[1:])).to(ad.device)
            if alg.name == "online_dpo":  # the pair shares the chosen sample's t and eps
                levels, eps = levels.repeat(2), eps.repeat(2, *([1] * (eps.dim() - 1)))
            t, s = levels.to(ad.device), ad.sigma_input(levels)
            x_t = nft.forward_noise(x0, t, eps)
            v_ref = None
            if alg.name == "online_dpo" or alg.kl_beta > 0:
                with torch.no_grad(), policy.reference():
                    v_ref = ad.velocity(x_t, s, cond)
                stats.ref_forwards += 1
            adv = samples.advantages[rows].to(ad.device)
            objective = _dpo_objective if alg.name == "online_dpo" else _awm_objective
            scalar = objective(alg, x0, eps, t, adv, v_ref, counts, weight / total_terms)
            loss, parts, kl = backward_through_velocity(ad, x_t, s, cond, scalar)
            if weight:
                stats.add(loss, parts, kl, total_terms, counts)
    return stats.as_dict()


def _awm_objective(alg, x0, eps, t, adv, v_ref, counts, scale):
    def objective(v):
        loss, err = awm.awm_loss(v, x0, eps, t, adv, alg.awm.weighting, alg.awm.ghuber_power)
        kl = None
        if v_ref is not None:  # kl_beta > 0: the velocity-space KL to the reference
            kl = nft.velocity_kl(v, v_ref)
            loss = loss + alg.kl_beta * kl
            kl = kl.detach()
        return scale * loss.sum(), (loss.detach(), {"awm_error": err}, kl)

    return objective


def _dpo_objective(alg, x0, eps, t, adv, v_ref, counts, scale):
    def objective(v):
        err = awm.matching_error(v, x0, eps)
        with torch.no_grad():
            err_ref = awm.matching_error(v_ref, x0, eps)
        p = len(err) // 2  # rows: the chosen samples, then the rejected ones
        loss, delta = dpo.dpo_loss(err[:p], err_ref[:p], err[p:], err_ref[p:], alg.dpo.beta)
        c = torch.ones_like(loss) if counts is None else counts.to(loss)
        return scale * (c * loss).sum(), (loss.detach(), {"dpo_delta": delta}, None)

    return objective


def _pairs(samples, mb: torch.Tensor, per_group: int):
    """(rows: the chosen rows then the rejected ones, the chosen rows, samples per pair's group in
    ``mb``) of the micro-batch ``mb``'s part of each group. Ranked by advantage: within a group it orders
    the samples as their rewards do, and it is what every engine mode hands a train unit (the rewards
    stay with the driver)."""
    groups = mb // per_group
    pairs = dpo.best_worst_pairs(samples.advantages[mb].double(), groups)
    if not pairs:
        return mb[:0], mb[:0], torch.zeros(0)
    w = torch.tensor([mb[a] for a, _ in pairs])
    lose = torch.tensor([mb[b] for _, b in pairs])
    counts = torch.tensor([float((groups == groups[a]).sum()) for a, _ in pairs])
    return torch.cat([w, lose]), w, counts


class ForwardStats:
    """Sums over a unit's terms (AWM: (sample, level); DPO: (pair, level) weighted by its samples)."""

    def __init__(self):
        self.loss = self.kl = 0.0
        self.terms = 0
        self.forward_error = 0.0  # AWM: the matching error l; DPO: Delta
        self.forward_n = 0
        self.ref_forwards = 0  # KL (or DPO) reference forwards this unit ran

    def add(self, loss, parts, kl, total_terms, counts):
        """``counts``: on the host, each pair's samples (None: AWM, one term per row)."""
        weights = 1 if counts is None else counts.to(loss.device)
        self.loss += (loss * weights).sum() / total_terms  # on the device until the unit ends
        self.terms += int(loss.numel() if counts is None else counts.sum())
        part = next(iter(parts.values()))
        self.forward_error += part.sum()
        self.forward_n += part.numel()
        if kl is not None:
            self.kl += kl.sum()

    def as_dict(self) -> dict:
        return host_values(vars(self))


def merge_forward_stats(parts: list[dict], minibatches: int = 1) -> dict:
    """The iteration's metrics: ``loss`` (mean of the mini-batches'), the KL per term, and the mean
    matching error (awm) or preference margin Delta (online_dpo) as ``forward_error``."""
    terms = sum(p["terms"] for p in parts) or 1
    n = sum(p["forward_n"] for p in parts) or 1
    return {
        "loss": sum(p["loss"] for p in parts) / minibatches,
        "kl": sum(p["kl"] for p in parts) / terms,
        "forward_error": sum(p["forward_error"] for p in parts) / n,
    }

"""The train unit: a set of rolled-out samples x a subset of their trained timesteps; it only
accumulates gradients (the driver steps the optimizer once per mini-batch).
"""

from __future__ import annotations

import torch

from digenrl.adapters.guidance import backward_through_velocity
from digenrl.algorithms import dppo, grpo, guard
from digenrl.algorithms.sde import (
    logprob_of_velocity,
    recompute_logprob,
    step_scale,
    transition_logprob,
)
from digenrl.units import forward as units_forward
from digenrl.units import nft as units_nft
from digenrl.units.klref import shipped_reference
from digenrl.units.nft import is_nft
from digenrl.units.rows import host_values, train_batches
from digenrl.units.samples import Samples


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
    pair_passes: int | None = None,
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
    ``train.pair_batch``: the pairs of the mini-batch in forwards of that many rows (:func:`pair_chunks`);
    ``pair_passes``: a sharded group's forwards (its busiest rank's), the rest zero-weighted.
    """
    cfg, ad = policy.cfg, policy.adapter
    if is_nft(cfg) or cfg.algorithm.name in ("awm", "online_dpo"):  # flow matching on noised clean samples
        passes = None if lockstep is None else len(lockstep)  # a sharded group's micro-batches
        unit = units_nft.train_unit if is_nft(cfg) else units_forward.train_unit
        share = (tsp_rank, tsp_degree, minibatch, minibatches, passes, padding)
        with ad.lockstep(passes is not None):  # per-row levels: a rank's rows may need either expert
            return unit(policy, samples, total_terms, *share)
    stale = samples.version < policy.version  # one-step async: decoupled PPO
    stats = _Stats()
    positions = [j for j in range(samples.train_idx.shape[1]) if j % tsp_degree == tsp_rank]
    sig = samples.sigmas.float()  # on the host: the step's scalars and sigma are read there
    batches = train_batches(
        len(samples),
        cfg,
        minibatch,
        minibatches,
        len(samples) // len(samples.group_ids),
        samples.first_sample,
    )
    pairs = cfg.train.pair_batch if lockstep is None else None  # (lockstep: a group's per-step passes)
    # train.old_logprob recompute: the on-policy behaviour log-prob from each forward's own rows first
    recompute = cfg.train.old_logprob == "recompute" and minibatch == 0 and not stale
    if pairs:  # timestep-pair batches: the mini-batch's (sample, step) pairs, pair_batch rows a forward
        batches = [torch.cat(batches)]
    real = 0 if padding else len(batches)
    if lockstep is not None and len(lockstep) > real:  # an uneven split: the group's other micro-batches
        batches = batches[:real] + [batches[0][:1]] * (len(lockstep) - real)  # run as zero-weighted passes
    for k, mb in enumerate(batches):
        cond = samples.cond.select(mb).to(ad.device)
        adv = samples.advantages[mb].to(ad.device)
        mine = samples.train_idx[mb][:, positions]  # (samples, this rank's positions): steps to train
        steps = mine.unique().tolist() if lockstep is None else lockstep[k]
        groups = []
        for i in steps:  # the samples training step i share one forward (each trains it once)
            sel = (mine == i).any(1).nonzero().squeeze(1)
            # lockstep: a pass the rank's group runs, on one row, weighted 0
            idle = len(sel) == 0 or k >= real
            groups.append((i, sel.new_zeros(1) if idle else sel, idle))
        chunks = [[g] for g in groups]
        if pairs:  # (a sharded group: as many forwards as its busiest rank, the others zero-weighted)
            chunks = pair_chunks([g for g in groups if not g[2]], pairs)
            chunks += [[(groups[0][0], groups[0][1][:1], True)]] * ((pair_passes or 0) - len(chunks))
        for chunk in chunks:
            terms = [
                _term(policy, samples, mb, cond, adv, sig, i, sel, idle, stale, total_terms, stats)
                for i, sel, idle in chunk
            ]
            x = torch.cat([t["x"] for t in terms])
            sigma = ad.sigma_input(torch.cat([sig[t["i"]].expand(len(t["sel"])) for t in terms]))
            every = torch.cat([t["sel"] for t in terms])
            c = cond.select(every) if len(every) != len(mb) or len(terms) > 1 else cond
            if recompute:  # every chunk, idle ones too: a sharded group's ranks run the same forwards
                old_logprobs(ad, x, sigma, c, terms, sig)

            def objective(v, terms=terms):  # each step's rows: its own terms, summed into one backward
                scalar, extras, at = 0.0, [], 0
                for t in terms:
                    part, ex = t["objective"](v[at : at + len(t["sel"])])
                    scalar, at = scalar + part, at + len(t["sel"])
                    extras.append(ex)
                return scalar, extras

            for t, (loss, st, w, kl, logp) in zip(
                terms, backward_through_velocity(ad, x, sigma, c, objective)
            ):
                if t["idle"]:
                    continue
                if w is not None:
                    stats.add_is(w)
                elif minibatch == 0:  # on-policy: the trainer should reproduce the rollout's log-prob
                    stats.add_mismatch(logp - t.get("rollout_behaviour", t["behaviour"]))
                if kl is not None:
                    stats.kl += kl.sum()
                stats.add(loss, st, len(t["rows"]), total_terms)
    return stats.as_dict()


def old_logprobs(ad, x, sigma, c, terms: list[dict], sig) -> None:
    """veRL-Omni's old_log_prob pass in the train forward's own batch: a no-grad forward of the same
    rows at the same timesteps; each term's behaviour log-prob becomes its result (the rollout's kept
    as ``rollout_behaviour``, for ``logprob_mismatch``)."""
    with torch.no_grad():
        v = ad.velocity(x, sigma, c)
    at = 0
    for t in terms:
        n = len(t["sel"])
        logp, mu, _ = logprob_of_velocity(v[at : at + n], t["x"], t["x_next"], sig, t["i"], *t["sde"])
        t["rollout_behaviour"], t["behaviour"] = t["behaviour"], logp
        if t["mu_old"] is not None:  # flow_dppo / grpo_guard's behaviour step mean too
            t["mu_old"] = mu
        at += n


def pair_chunks(groups: list[tuple], size: int) -> list[list[tuple]]:
    """Timestep-pair batches: the (step, rows, idle) groups of one mini-batch cut into forwards of
    ``size`` rows, in step order (a step's rows may span two forwards)."""
    chunks, chunk, room = [], [], size
    for i, sel, idle in groups:
        while len(sel):
            take, sel = sel[:room], sel[room:]
            chunk.append((i, take, idle))
            room -= len(take)
            if room == 0:
                chunks, chunk, room = chunks + [chunk], [], size
    return chunks + [chunk] if chunk else chunks


def _term(policy, samples, mb, cond, adv, sig, i, sel, idle, stale, total_terms, stats) -> dict:
    """The rows ``sel`` (of micro-batch ``mb``) training step ``i``: their inputs and the objective of
    their velocity (the per-step loss, divided by ``total_terms``)."""
    cfg, ad = policy.cfg, policy.adapter
    alg, kind, eta = cfg.algorithm, cfg.sampling.sde, cfg.sampling.noise_level
    rows = mb[sel]
    x = samples.latents[rows, i].to(ad.device)
    x_next = samples.latents[rows, i + 1].to(ad.device)
    behaviour = samples.log_probs[rows, i].to(ad.device)
    noise = mu_old = None
    if alg.name in TRUST_REGION:  # the behaviour step mean: x_{i+1} minus its recorded noise
        mu_old = x_next - samples.step_noise[rows, i].to(ad.device)
    elif stale and alg.stale_gradient == "recentred" and samples.step_noise is not None:
        noise = samples.step_noise[rows, i].to(ad.device)
    mu_ref = None
    if alg.kl_beta > 0 and samples.ref_means is not None:  # computed at rollout (kl_reference)
        mu_ref = shipped_reference(samples, rows, i, ad.device)
    elif alg.kl_beta > 0:
        c = cond.select(sel) if len(sel) < len(mb) else cond
        with torch.no_grad(), policy.reference():
            _, mu_ref, _ = recompute_logprob(ad, c, x, x_next, sig, i, kind, eta)
        stats.ref_forwards += 1
    a = adv[sel] if adv.ndim == 1 else adv[sel, i]  # branch_advantages depth: per step

    term = {"i": i, "sel": sel, "rows": rows, "x": x, "x_next": x_next, "sde": (kind, eta), "idle": idle}
    term |= {"behaviour": behaviour, "mu_old": mu_old}  # (replaced by old_logprobs: train.old_logprob)

    def objective(v):
        logp, mu, std = logprob_of_velocity(v, x, x_next, sig, i, kind, eta)
        if noise is not None:  # the stale sample's noise around the current mean
            logp = (logp.detach(), recentred_logprob(kind, mu, noise, sig, i, std))
        old = None
        if term["mu_old"] is not None:  # flow_dppo / grpo_guard: the behaviour mean and the step scale
            old = (term["mu_old"], step_scale(kind, float(sig[i]), float(sig[i + 1]), std))
        behaviour = term["behaviour"]
        scalar, extras = term_loss(alg, logp, behaviour, a, stale, mu, mu_ref, std, total_terms, old)
        return scalar * (1.0 - idle), (*extras, logp[0] if isinstance(logp, tuple) else logp.detach())

    term["objective"] = objective
    return term


def recentred_logprob(kind: str, mu: torch.Tensor, noise: torch.Tensor, sigmas, i: int, std: float):
    """log N(mu.detach() + noise; mu, scale^2): the stale sample's recorded step noise put around the
    current step mean. Its value is the behaviour log-prob; its gradient is the on-policy score
    noise / scale^2 * dmu, without the stale drift (mu_behaviour - mu) / scale^2 * dmu that the raw
    sample's gradient carries (docs/algorithms.md, "Stale samples")."""
    scale = step_scale(kind, float(sigmas[i]), float(sigmas[i + 1]), std)
    return transition_logprob(kind, mu.detach() + noise, mu, scale)


#: the algorithms whose trust region needs the behaviour step mean (recovered from the step noise)
TRUST_REGION = ("flow_dppo", "grpo_guard")


def term_loss(alg, logp, behaviour, adv, stale: bool, mu, mu_ref, std: float, total_terms: int, old=None):
    """(the scalar to backpropagate, (per-term loss, ratio stats, IS weight or None, KL or None) detached).

    On-policy: PPO-clip to the behaviour log-prob. Stale (one-step async): clip around the proximal
    policy and weight by the capped exp(logp_prox - logp_behaviour) (decoupled PPO). ``logp`` may be a
    pair (the sample's log-prob under the current weights, detached; the recentred log-prob to
    differentiate, :func:`recentred_logprob`). ``mu_ref``: the KL reference's step mean (None: no KL term).
    ``old`` = (behaviour step mean, step scale): flow_dppo's KL mask / grpo_guard's normalised ratio,
    both to the behaviour policy (a stale sample too: its trust region is around what generated it)."""
    w = kl = None
    prox, logp = logp if isinstance(logp, tuple) else (logp.detach(), logp)
    if alg.name == "flow_dppo":
        loss, st = dppo.dppo_objective(logp, behaviour, adv, mu, old[0], old[1], alg.kl_mask_threshold)
    elif alg.name == "grpo_guard":
        loss, st = guard.guard_objective(logp, behaviour, adv, mu, old[0], old[1], alg.clip_range)
    elif stale:
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
    """Sums over a unit's terms, kept on the device until the unit ends (no term's forward or backward
    waits for the device to report one); merged across units by :func:`merge_stats`."""

    def __init__(self):
        self.loss = self.kl = self.ratio_sum = self.clip_sum = 0.0
        self.terms = 0
        self.ratio_max, self.ratio_min = float("-inf"), float("inf")
        self.is_sum, self.is_max, self.is_n = 0.0, 0.0, 0
        self.mismatch_sum, self.mismatch_n = 0.0, 0  # |logp - behaviour logp| over on-policy terms
        self.ref_forwards = 0  # KL reference forwards this unit ran (0: none, or computed at rollout)

    def add(self, loss, st, n, total_terms):
        self.loss += loss.sum() / total_terms
        self.terms += n
        self.ratio_sum += st["ratio_mean"] * n
        self.clip_sum += st["clip_frac"] * n
        self.ratio_max = st["ratio_max"].clamp(min=self.ratio_max)
        self.ratio_min = st["ratio_min"].clamp(max=self.ratio_min)

    def add_is(self, w):
        self.is_sum += w.sum()
        self.is_max = w.max().clamp(min=self.is_max)
        self.is_n += w.numel()

    def add_mismatch(self, diff):
        self.mismatch_sum += diff.abs().sum()
        self.mismatch_n += diff.numel()

    def as_dict(self) -> dict:
        return host_values(vars(self))


def merge_stats(parts: list[dict], minibatches: int = 1) -> dict:
    """Combine unit stats into the iteration's metrics (``loss``: the mean of the mini-batches' losses)."""
    if parts and "nft_r" in parts[0]:  # DiffusionNFT's stats (no ratios)
        return units_nft.merge_nft_stats(parts, minibatches)
    if parts and "forward_error" in parts[0]:  # AWM's / online DPO's
        return units_forward.merge_forward_stats(parts, minibatches)
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

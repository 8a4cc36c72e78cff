"""The configured model's calls on this device, and whole units at the run's unit size.

Details: docs/modules.md, `digenrl.planner.measure.model_times`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from digenrl.algorithms.sde import recompute_logprob
from digenrl.data.prompts import load_prompts
from digenrl.engine.weight_sync import state_bytes
from digenrl.planner.call_times import ProfiledTimes, rollout_unit_time, train_unit_time
from digenrl.planner.measure.engine_run import unit_spread
from digenrl.planner.measure.timing import RoundRobin, means
from digenrl.planner.workload import Workload
from digenrl.policy.lora import checksum
from digenrl.policy.model import Policy
from digenrl.rewards import build_reward
from digenrl.units.advantages import assign_advantages
from digenrl.units.rollout import rollout_unit, scored
from digenrl.units.train import train_unit

STEP_KEYS = {"rollout": "rollout_step_s", "train": "train_step_s", "ref": "ref_forward_s"}


class ModelBench:
    """The model of ``cfg`` built on ``device`` with everything its calls need."""

    def __init__(self, cfg, device: torch.device, warmup: int):
        torch.manual_seed(cfg.train.seed)
        self.cfg, self.device = cfg, device
        self.policy = Policy(cfg, device)  # a single process's settings (the planner never resolves a run)
        self.ad = self.policy.adapter
        self.workload = Workload.from_config(cfg)
        self.prompts = load_prompts(cfg.prompts)
        self.reward = build_reward(cfg.reward)
        self.clock = RoundRobin(device, warmup)
        self.cond1 = self.encode(self.prompts[:1])
        self.sigmas = self.ad.sigmas(cfg.sampling.steps).to(device)
        self.gen = torch.Generator().manual_seed(0)
        self.groups = 0  # of the whole units, once added
        self.samples = None  # a rollout unit's samples (what the train unit trains on)
        self.state: dict = {}  # the weights a sync ships, once the calls are added

    def encode(self, prompts):
        """The prompts' conditioning, uncached (an edit family's with each row's input image)."""
        texts = [p.text for p in prompts]
        if self.ad.edits:
            return self.ad.encode_prompts(texts, [p.meta.get("image") for p in prompts])
        return self.ad.encode_prompts(texts)

    def inputs(self, b: int):
        """A batch of b: the first prompt's conditioning and noise latents."""
        x = torch.randn((b, *self.ad.latent_shape()), generator=self.gen).to(self.device)
        return self.cond1.repeat_interleave(b).to(self.device), x

    def velocity_call(self, b: int):
        """One no-grad velocity call at batch b (all guidance passes), ready to time."""
        cond, x = self.inputs(b)
        s = self.sigmas[1].expand(b)

        def velocity():
            with torch.no_grad():
                self.ad.velocity(x, s, cond)

        return velocity

    # -- the calls -----------------------------------------------------------------------

    def add_rollout_steps(self, batches: list[int], step) -> None:
        with self.clock.phase("rollout"):
            for b in batches:
                step(f"rollout step, batch {b}")
                self.clock.add(f"rollout:{b}", self.velocity_call(b), "rollout")

    def add_train_steps(self, batches: list[int], step) -> None:
        ad, sig, policy = self.ad, self.sigmas, self.policy
        kind, eta = self.cfg.sampling.sde, self.cfg.sampling.noise_level
        with self.clock.phase("train"):
            for b in batches:
                step(f"train step and reference forward, batch {b}")
                cond, x = self.inputs(b)
                x_next = x + 0.1 * torch.randn(x.shape, generator=self.gen).to(self.device)

                def fwd_bwd(cond=cond, x=x, x_next=x_next):
                    logp, _, _ = recompute_logprob(ad, cond, x, x_next, sig, 1, kind, eta)
                    logp.sum().backward()

                def ref(cond=cond, x=x, x_next=x_next):
                    with torch.no_grad(), policy.reference():
                        recompute_logprob(ad, cond, x, x_next, sig, 1, kind, eta)

                if self.clock.add(f"train:{b}", fwd_bwd, "train"):
                    self.clock.add(f"ref:{b}", ref, "train")
                policy.optimizer.zero_grad(set_to_none=True)

    def add_calls(self) -> None:
        """Decode and reward of a group, prompt encoding of an iteration, optimizer step, weight sync."""

        ad, policy, prompts = self.ad, self.policy, self.prompts
        G, P = self.cfg.algorithm.group_size, self.cfg.train.prompts_per_iteration
        _, x = self.inputs(G)
        with torch.no_grad():
            pixels = ad.decode(x)

        def decode(x=x):
            with torch.no_grad():
                ad.decode(x)

        texts = [prompts[i % len(prompts)].text for i in range(G)]
        metas = [prompts[i % len(prompts)].meta for i in range(G)]
        prows = [prompts[i % len(prompts)] for i in range(P)]

        def encode():
            with torch.no_grad():
                self.encode(prows)

        def opt():
            for p in policy.params:
                p.grad = torch.ones_like(p) * 1e-3
            policy.optimizer_step()

        self.state = policy.weights()
        digest = checksum(self.state)
        self.clock.add("decode", decode, "rollout")
        self.clock.add("reward", lambda: self.reward(pixels.cpu(), texts, metas), "rollout")
        self.clock.add("encode", encode, "rollout")
        self.clock.add("optimizer", opt, "train")
        self.clock.add("pack", lambda: checksum(policy.weights()), "train")
        self.clock.add("agree", policy.agreement_digest, "train")
        self.clock.add(
            "load", lambda: policy.load_weights(self.state, policy.version, expected_checksum=digest), "train"
        )

    def add_units(self, groups: int) -> None:
        """A rollout unit and a train unit of ``groups`` groups, as the engine runs them."""

        cfg, policy = self.cfg, self.policy
        self.groups = groups
        with self.clock.phase("units"):

            def one_rollout():
                return scored(
                    rollout_unit(policy, self.prompts[:groups], list(range(groups)), 0, cfg.train.seed),
                    self.reward,
                )

            samples = self.samples = one_rollout()  # the samples the train unit trains on
            assign_advantages([samples], cfg)
            terms = len(samples) * samples.train_idx.shape[1]
            self.clock.add("rollout_unit", one_rollout, "rollout")
            self.clock.add("train_unit", lambda: train_unit(policy, samples, terms), "train")
            policy.optimizer.zero_grad(set_to_none=True)

    # -- the measurements ------------------------------------------------------------------

    def measure(self, repeats: int, min_time: float) -> dict:
        """Time every call in round robin; the profile's ``measurements`` (model part)."""

        timed = self.clock.rounds(repeats, min_time)
        self.policy.optimizer.zero_grad(set_to_none=True)
        mean = means(timed)
        G, P = self.cfg.algorithm.group_size, self.cfg.train.prompts_per_iteration
        m: dict = {key: {} for key in STEP_KEYS.values()}
        for name, v in mean.items():
            kind, _, b = name.partition(":")
            if b:
                m[STEP_KEYS[kind]][b] = v
        m["decode_s_per_sample"] = mean["decode"] / G
        m["reward_s_per_sample"] = mean["reward"] / G
        m["encode_s_per_prompt"] = mean["encode"] / P
        m["optimizer_step_s"] = mean["optimizer"]
        m["weight_sync"] = {
            "bytes": state_bytes(self.state),
            "tensors": len(self.state),
            "pack_s": mean["pack"],
            "agree_s": mean["agree"],
            "load_s": mean["load"],
        }
        m["timing_rounds"] = len(timed["rollout_unit"])
        m["unit_cv"] = {kind: unit_spread([timed[f"{kind}_unit"]]) for kind in ("rollout", "train")}
        m["unit_overhead"] = self.unit_overhead(m, mean["rollout_unit"], mean["train_unit"])
        return m

    def unit_overhead(self, m: dict, rollout_s: float, train_s: float) -> dict:
        """Whole units against the sum of their calls: ``*_factor`` = whole / composed, ``*_s`` the
        difference."""

        times = ProfiledTimes({"device": {"name": "partial"}, "measurements": {**m, "unit_overhead": {}}})
        w, groups = self.workload, self.groups
        composed_roll = rollout_unit_time(times, w, groups, w.rollout_batch)[0]
        # the profile times a whole unit's training (every mini-batch): composed as one mini-batch
        whole = replace(w, optimizer_steps=1)
        composed_train = train_unit_time(times, whole, groups, 0, 1, self.cfg.train.micro_batch)
        return {
            "groups": groups,
            "rollout_unit_s": rollout_s,
            "train_unit_s": train_s,
            "rollout_s": rollout_s - composed_roll,
            "train_s": train_s - composed_train,
            "rollout_factor": rollout_s / composed_roll,
            "train_factor": train_s / composed_train,
        }

    def sample_bytes(self) -> float:
        """Bytes of one rolled-out sample (tensors and conditioning) as it travels to a trainer."""
        total = 0
        for v in vars(self.samples).values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
            elif hasattr(v, "batched"):
                total += sum(t.numel() * t.element_size() for t in v.batched.values())
        return total / len(self.samples)

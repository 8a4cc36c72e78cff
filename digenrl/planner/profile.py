"""``digenrl profile``: measure what the cost model needs, on this device, for the configured model.

Every number is the mean of timed calls after ``warmup`` untimed ones (CUDA: synchronised around
each call), taken in round robin: each round times every measurement once, for at least ``repeats``
rounds and ``10 x min_time`` seconds, so that on a shared host every entry -- and the ratio of a
whole unit to its calls -- spans the same stretch of the other processes' load. On CPU the torch
thread count is set to ``threads`` (default 1, as every engine worker runs).

measurements
  rollout_step_s[b]   one ``Adapter.velocity`` call at batch b with the model's guidance (both
                      passes with two-pass CFG), no grad
  train_step_s[b]     forward + backward of ``recompute_logprob`` on the trained parameters
  ref_forward_s[b]    the KL reference forward (LoRA disabled), no grad
  decode / reward / encode   per sample / per sample / per prompt
  optimizer_step_s    grad-norm clip + AdamW on the trained parameters
  weight_sync         bytes of ``Policy.weights()``, pack (weights + checksum), verified load
  unit_overhead       a real ``rollout_unit`` / ``train_unit`` of ``engine.unit_groups`` groups against
                      the sum of its calls: ``*_factor`` = whole unit / composed calls (the cost model
                      scales every composed unit by it), ``*_s`` = the difference in seconds
  unit_cv             spread (std / mean, from successive differences) of whole rollout / train unit
                      times across the timing rounds; the engine run's ``unit_cv``, when there is one,
                      is the spread inside engine workers (the simulator draws unit times from it)
  cpu_slowdown        (CPU) time per rollout step (a unit's batch) with n = 1, 2, 3 forked workers
                      computing at once, relative to one: what concurrent workers get of the host (one
                      observer beside n - 1 neighbours that compute in every other 0.2 s slot,
                      each process with its own copy of the weights)
  peak_memory_bytes   CUDA ``max_memory_allocated`` per phase, or the process's peak RSS on CPU
  other_runnable      (CPU) mean number of runnable threads of other processes (not this one or its
                      children) while measuring: the call times above were measured beside that
                      demand on the host's cores; ``other_load_cores``: the CPU they got
engine (optional)
  ``ray``: Ray micro-benchmarks -- actor call round trip, object-store transfer between two actors
  at two sizes (latency + bytes/s), ``ray.put`` / ``ray.get`` of the weights, gloo all-reduce of
  the gradients; ``run``: additionally an 8-iteration run of the engine itself (disaggregated, sync,
  1 + 1 workers) whose timeline gives the per-unit dispatch gap, the samples transfer, the
  publish / fetch times as the runtime really pays them (what the simulator adds around units),
  and how much slower a unit runs inside an engine worker than the profile's round-robin whole
  unit (``unit_time_factor``, median 1.12 on the quiet 2-core host), and the spread of its unit times
  (``unit_cv``)
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from digenrl.errors import UserError, read_user_text

PROFILE_VERSION = 1
DEFAULT_BATCHES = (1, 2, 4, 8, 16)


def batch_sizes(cfg, requested: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(rollout, train) batch sizes: the requested ones (default 1..16) plus every batch the
    workload runs: rollout units of m groups (m | prompts, <= 64 samples), the micro-batch."""
    base = sorted(set(requested or DEFAULT_BATCHES))
    G, P, mb = cfg.algorithm.group_size, cfg.train.prompts_per_iteration, cfg.train.micro_batch
    roll = set(base) | {m * G for m in range(1, P + 1) if P % m == 0 and m * G <= 64}
    train = {b for b in base if b <= max(mb, G)} | {min(mb, G), mb}
    return sorted(roll), sorted(train)


def device_info(device: torch.device, threads: int) -> dict:
    from digenrl.planner.gpus import match_device_name

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = match_device_name(name)
        return {"kind": "gpu", "name": name, "table_key": key, "torch_device": str(device),
                "memory_bytes": torch.cuda.get_device_properties(device).total_memory}
    return {"kind": "cpu", "name": f"cpu ({platform.machine()}, {os.cpu_count()} cores, {threads} thread(s))",
            "table_key": "cpu", "torch_device": "cpu", "threads": threads, "cores": os.cpu_count()}


class _Clock:
    """Median of timed calls: at least ``repeats``, more (up to ``max_repeats``) until ``min_time``
    seconds have been timed, so that millisecond calls on a shared CPU get enough samples."""

    def __init__(self, device: torch.device, warmup: int, repeats: int, min_time: float = 0.3,
                 max_repeats: int = 60):
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.min_time, self.max_repeats = min_time, max(repeats, max_repeats)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, fn: Callable[[], object], repeats: int | None = None, warmup: int | None = None) -> float:
        for _ in range(self.warmup if warmup is None else warmup):
            fn()
        times: list[float] = []
        least = repeats or self.repeats
        while len(times) < least or (sum(times) < self.min_time and len(times) < self.max_repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@contextlib.contextmanager
def _threads(n: int | None):
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def unit_groups(cfg) -> int:
    """The rollout unit size the run uses (``engine.unit_groups``, at most the prompts per iteration)."""
    return max(1, min(cfg.engine.unit_groups, cfg.train.prompts_per_iteration))


def steps_total(cfg, engine: str, requested: list[int] | None = None, device: str = "cpu", sharing: int = 3) -> int:
    roll, train = batch_sizes(cfg, requested)
    extra = 1 if device == "cpu" and sharing else 0
    return 1 + len(roll) + len(train) + 3 + extra + {"none": 0, "ray": 1, "run": 2}[engine]


def run_profile(cfg, device: str = "cpu", *, batches: list[int] | None = None, repeats: int = 5, warmup: int = 2,
                threads: int | None = 1, engine: str = "none", min_time: float = 0.3, sharing: int = 3,
                on_step: Callable[[str], None] | None = None) -> dict:
    """Measure ``cfg``'s model on ``device``; returns the profile dict (see the module docstring)."""
    from digenrl.algorithms.sde import recompute_logprob
    from digenrl.engine.weight_sync import state_bytes
    from digenrl.lora import checksum
    from digenrl.planner.costmodel import ProfiledTimes, Workload, rollout_unit_time, train_unit_time
    from digenrl.policy import Policy, pick_device
    from digenrl.prompts import load_prompts
    from digenrl.rewards import build_reward
    from digenrl.units import assign_advantages, rollout_unit, train_unit

    if engine not in ("none", "ray", "run"):
        raise UserError(f"--engine: expected none, ray or run, got '{engine}'")
    dev = pick_device(device)
    step = on_step or (lambda what: None)
    load = OtherLoad()
    with _threads(threads if dev.type == "cpu" else None), load:
        step("building the model")
        torch.manual_seed(cfg.train.seed)
        policy = Policy(cfg, dev)
        ad = policy.adapter
        workload = Workload.from_config(cfg)
        prompts = load_prompts(cfg.prompts)
        reward = build_reward(cfg.reward)
        clock = _Clock(dev, warmup, repeats, min_time)
        roll_b, train_b = batch_sizes(cfg, batches)
        G, N = cfg.algorithm.group_size, cfg.sampling.steps
        kind, eta = cfg.sampling.sde, cfg.sampling.noise_level
        cond1 = ad.encode_prompts([prompts[0].text])
        sig = ad.sigmas(N).to(dev)
        gen = torch.Generator().manual_seed(0)
        peaks: dict[str, int] = {}

        def inputs(b):
            x = torch.randn((b, *ad.latent_shape()), generator=gen).to(dev)
            return cond1.repeat_interleave(b).to(dev), x

        def reset_peak():
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)

        def peak(name):
            peaks[name] = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else _peak_rss()

        m: dict = {"rollout_step_s": {}, "train_step_s": {}, "ref_forward_s": {}}
        skipped: dict[str, list[int]] = {"rollout": [], "train": []}
        # Every measurement is an item; they are warmed up phase by phase (peak memory per phase,
        # batches that do not fit dropped), then timed in ROUND ROBIN: round r times each item
        # once, so that every median spans the same stretch of time. On a shared host the load of
        # other processes comes and goes within seconds: measured one after the other, a table
        # entry taken in a quiet second and a whole unit taken in a busy one would disagree by 2x.
        items: dict[str, Callable[[], object]] = {}

        def warm(name: str, fn, phase: str) -> bool:
            try:
                for _ in range(max(1, warmup)):
                    fn()
                    clock.sync()
            except torch.cuda.OutOfMemoryError:
                skipped[phase].append(int(name.rsplit(":", 1)[1]))
                torch.cuda.empty_cache()
                return False
            items[name] = fn
            return True

        # -- rollout steps vs batch ----------------------------------------------------
        reset_peak()
        for b in roll_b:
            step(f"rollout step, batch {b}")
            cond, x = inputs(b)
            s = sig[1].expand(b)

            def velocity(x=x, s=s, cond=cond):
                with torch.no_grad():
                    ad.velocity(x, s, cond)

            warm(f"rollout:{b}", velocity, "rollout")
        peak("rollout")

        # -- train steps (forward + backward) and reference forwards vs micro-batch -----
        reset_peak()
        for b in train_b:
            step(f"train step and reference forward, batch {b}")
            cond, x = inputs(b)
            x_next = x + 0.1 * torch.randn(x.shape, generator=gen).to(dev)

            def fwd_bwd(cond=cond, x=x, x_next=x_next):
                logp, _, _ = recompute_logprob(ad, cond, x, x_next, sig, 1, kind, eta)
                logp.sum().backward()

            def ref(cond=cond, x=x, x_next=x_next):
                with torch.no_grad(), policy.reference():
                    recompute_logprob(ad, cond, x, x_next, sig, 1, kind, eta)

            if warm(f"train:{b}", fwd_bwd, "train"):
                warm(f"ref:{b}", ref, "train")
            policy.optimizer.zero_grad(set_to_none=True)
        peak("train")
        if not any(k.startswith("rollout:") for k in items) or not any(k.startswith("train:") for k in items):
            raise UserError(f"profile: the model does not fit this device even at batch 1 ({dev})")

        # -- decode, reward, prompt encoding, optimizer step, weight sync -------------------
        step("decode, reward, prompt encoding, optimizer step, weight sync")
        _, x = inputs(G)
        with torch.no_grad():
            pixels = ad.decode(x)

        def decode(x=x):
            with torch.no_grad():
                ad.decode(x)

        texts = [prompts[i % len(prompts)].text for i in range(G)]
        metas = [prompts[i % len(prompts)].meta for i in range(G)]
        P = cfg.train.prompts_per_iteration
        ptexts = [prompts[i % len(prompts)].text for i in range(P)]

        def encode():
            with torch.no_grad():
                ad.encode_prompts(ptexts)

        def opt():
            for p in policy.params:
                p.grad = torch.ones_like(p) * 1e-3
            policy.optimizer_step()

        state = policy.weights()
        digest = checksum(state)
        warm("decode", decode, "rollout")
        warm("reward", lambda: reward(pixels.cpu(), texts, metas), "rollout")
        warm("encode", encode, "rollout")
        warm("optimizer", opt, "train")
        warm("pack", lambda: checksum(policy.weights()), "train")
        warm("load", lambda: policy.load_weights(state, policy.version, expected_checksum=digest), "train")

        # -- whole units at the run's unit size: what the sum of the calls leaves out ----------
        # (the SDE step and log-prob math, the loss, gathering latents, stats): a unit of
        # m = engine.unit_groups groups, as the engine runs it; its ratio to the composed call times
        # scales every unit size, TSP share and micro-batch split the planner composes
        groups = unit_groups(cfg)
        step(f"one rollout unit and one train unit ({groups} group(s))")
        reset_peak()
        samples_box = {}

        def one_rollout():
            samples_box["s"] = rollout_unit(policy, reward, prompts[:groups], list(range(groups)), 0, cfg.train.seed)

        one_rollout()  # the samples the train unit trains on
        samples = samples_box["s"]
        assign_advantages([samples], cfg)
        terms = len(samples) * samples.train_idx.shape[1]
        warm("rollout_unit", one_rollout, "rollout")
        warm("train_unit", lambda: train_unit(policy, samples, terms), "train")
        policy.optimizer.zero_grad(set_to_none=True)
        peak("units")

        # -- the timed rounds ------------------------------------------------------------------
        step("timing (round robin)")
        timed: dict[str, list[float]] = {name: [] for name in items}
        budget = 10 * min_time  # seconds of rounds at least (and ``repeats`` rounds at least)
        started = time.perf_counter()
        while True:
            for name, fn in items.items():
                clock.sync()
                t0 = time.perf_counter()
                fn()
                clock.sync()
                timed[name].append(time.perf_counter() - t0)
            rounds = len(timed["rollout_unit"])
            if rounds >= repeats and (time.perf_counter() - started >= budget or rounds >= 40):
                break
        policy.optimizer.zero_grad(set_to_none=True)
        # the mean, not the median: throughput sees the mean, and on a busy host the median of short
        # calls skips exactly those the scheduler preempted (a 15 ms call often fits in one time
        # slice, a 300 ms unit never does), so median calls composed into a unit undercount it
        med = {name: statistics.fmean(v) for name, v in timed.items()}
        for name, v in med.items():
            kind_, _, b = name.partition(":")
            if b:
                m[{"rollout": "rollout_step_s", "train": "train_step_s", "ref": "ref_forward_s"}[kind_]][b] = v
        m["decode_s_per_sample"] = med["decode"] / G
        m["reward_s_per_sample"] = med["reward"] / G
        m["encode_s_per_prompt"] = med["encode"] / P
        m["optimizer_step_s"] = med["optimizer"]
        m["weight_sync"] = {"bytes": state_bytes(state), "tensors": len(state), "pack_s": med["pack"],
                            "load_s": med["load"]}
        m["timing_rounds"] = len(timed["rollout_unit"])
        m["unit_cv"] = {kind: unit_spread([timed[f"{kind}_unit"]]) for kind in ("rollout", "train")}
        times = ProfiledTimes({"device": {"name": "partial"}, "measurements": {**m, "unit_overhead": {}}})
        composed_roll = rollout_unit_time(times, workload, groups)[0]
        composed_train = train_unit_time(times, workload, groups, 0, 1, cfg.train.micro_batch)
        rollout_s, train_s = med["rollout_unit"], med["train_unit"]
        m["unit_overhead"] = {"groups": groups, "rollout_unit_s": rollout_s, "train_unit_s": train_s,
                              "rollout_s": rollout_s - composed_roll, "train_s": train_s - composed_train,
                              "rollout_factor": rollout_s / composed_roll, "train_factor": train_s / composed_train}
        if dev.type == "cpu":  # what other processes wanted from / got of the host's cores while we measured
            m["other_runnable"] = load.other_runnable
            m["other_load_cores"] = load.other_cores
        m["sample_bytes"] = _samples_bytes(samples) / len(samples)
        m["peak_memory_bytes"] = peaks
        if dev.type == "cpu" and sharing:  # before Ray starts in this process: the probe forks
            step("CPU sharing between concurrent workers")
            cond, x = inputs(groups * G)  # a rollout unit's batch
            s_ = sig[1].expand(groups * G)

            def work():
                with torch.no_grad():
                    ad.velocity(x, s_, cond)

            m["cpu_slowdown"] = cpu_slowdown(work, max_workers=sharing, seconds=max(2.4, 8 * min_time),
                                             prepare=lambda: _private_weights(policy))
    out = {
        "version": PROFILE_VERSION,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": device_info(dev, threads if dev.type == "cpu" else torch.get_num_threads()),
        "dtype": cfg.model.dtype,
        "torch": torch.__version__,
        "model": ad.model_signature(),
        "workload": {
            "steps": N, "trained_steps": workload.trained_steps, "timestep_mode": workload.timestep_mode,
            "group_size": G, "prompts_per_iteration": P, "guidance_passes": workload.passes,
            "guidance": cfg.sampling.guidance, "micro_batch": cfg.train.micro_batch, "kl": workload.kl,
            "lora": workload.lora, "trained_params": workload.trained_params,
            "tokens": {"x": workload.shape.tokens.x, "text": workload.shape.tokens.text},
            "height": cfg.model.height, "width": cfg.model.width, "frames": cfg.model.frames,
        },
        "settings": {"repeats": repeats, "warmup": warmup, "min_time_s": min_time, "skipped_batches_oom": skipped},
        "measurements": m,
        "engine": None,
    }
    if engine != "none":
        step("engine: Ray call / transfer / all-reduce")
        out["engine"] = ray_overheads(m["sample_bytes"] * G, m["weight_sync"]["bytes"], workload.trained_params)
        if engine == "run":
            step("engine: an 8-iteration calibration run")
            out["engine"].update(engine_run_overheads(cfg, m))
    return out


def _private_weights(policy) -> None:
    """In a forked child: give every module of the policy its own copy of its weights (fork shares
    the parent's pages until written; separate engine workers never share them)."""
    for owner in (policy, policy.adapter):
        for obj in vars(owner).values():
            if isinstance(obj, torch.nn.Module):
                for t in [*obj.parameters(), *obj.buffers()]:
                    t.data = t.data.clone()


def _observe(fn, prepare, t0: float, seconds: float, conn) -> None:
    """A forked observer: run ``fn`` back to back from ``t0`` for ``seconds``; report (start, end) per call."""
    result = None
    try:
        torch.set_num_threads(1)
        prepare()
        fn()  # warm
        while time.monotonic() < t0:
            time.sleep(0.001)
        calls = []
        while time.monotonic() - t0 < seconds:
            a = time.monotonic()
            fn()
            calls.append((a, time.monotonic()))
        result = calls
    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
        result = f"{type(exc).__name__}: {exc}"
    finally:
        conn.send(result)  # synchronous: written before we exit
        os._exit(0)


def _neighbour(fn, prepare, t0: float, seconds: float, slot: float) -> None:
    """A forked neighbour: from ``t0``, compute (``fn`` back to back) in even slots, sleep in odd ones."""
    try:
        torch.set_num_threads(1)
        prepare()
        fn()  # warm
        took = 0.0
        while (now := time.monotonic()) - t0 < seconds:
            k = (now - t0) // slot if now >= t0 else -1
            if k >= 0 and k % 2 == 0 and t0 + (k + 1) * slot - now > took:  # room for one more call
                a = time.monotonic()
                fn()
                took = time.monotonic() - a
            else:
                time.sleep(0.001)
    finally:
        os._exit(0)


def cpu_slowdown(fn: Callable[[], object], max_workers: int = 3, seconds: float = 2.4,
                 slot: float = 0.2, prepare: Callable[[], object] = lambda: None) -> dict[str, float]:
    """How much slower a worker gets when ``n`` worker processes compute at once on this host:
    {n: time per call with n - 1 neighbours computing / time per call alone}. One forked observer
    runs ``fn`` back to back for ``seconds`` while n - 1 forked neighbours compute in every other
    ``slot`` and sleep in between; the ratio compares the observer's calls inside busy slots with
    those inside idle ones. Interleaved at the slot's time scale, slow drift of the host's speed
    (other tenants, frequency) weighs on both sides alike -- measuring n = 1 and n = 2 one after
    the other, a second apart, swung the ratio between 0.85 and 1.5 on the 2-core host. Each
    process first runs ``prepare`` (the profile gives it a private copy of the model's weights, as
    every engine worker has: forked copies sharing one set of pages read ~1.0 at n = 2 where
    private copies read ~1.3, the cache they compete for). On an idle machine with C cores the
    ratio is ~max(1, n / C) times what shared caches and memory bandwidth add; on a shared one it
    shows what is left to us."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")

    def once(n: int) -> float:
        recv, send = ctx.Pipe(duplex=False)
        t0 = time.monotonic() + 1.0 + 0.2 * n  # after every process has forked and warmed up
        procs = [ctx.Process(target=_observe, args=(fn, prepare, t0, seconds, send), daemon=True)]
        procs += [ctx.Process(target=_neighbour, args=(fn, prepare, t0, seconds, slot), daemon=True)
                  for _ in range(n - 1)]
        for p in procs:
            p.start()
        try:
            got = recv.recv() if recv.poll(60 + 10 * seconds) else "no answer within the timeout"
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        if not isinstance(got, list):
            raise RuntimeError(f"CPU sharing probe failed in a worker: {got}")
        busy, idle = [], []
        for a, b in got:  # calls wholly inside one slot only
            k = (a - t0) // slot
            if k == (b - t0) // slot and k >= 0:
                (busy if k % 2 == 0 else idle).append(b - a)
        if not busy or not idle:
            raise RuntimeError(f"CPU sharing probe: a call of {statistics.fmean(b - a for a, b in got):.3f} s "
                               f"does not fit in a {slot} s slot")
        return statistics.fmean(busy) / statistics.fmean(idle)

    return {"1": 1.0, **{str(n): once(n) for n in range(2, max_workers + 1)}}


def _samples_bytes(samples) -> int:
    total = 0
    for v in vars(samples).values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif hasattr(v, "batched"):
            total += sum(t.numel() * t.element_size() for t in v.batched.values())
    return total


class OtherLoad:
    """What processes that are not ours (other users of a shared host) do while a block runs: a
    thread samples /proc every ``every`` seconds. ``other_runnable``: the mean number of their
    threads that were runnable, weighted by priority (a nice-0 thread counts 1) -- the demand our
    workers share the cores with; ``other_cores``: the CPU time they got per second. A process is ours when this process is among its ancestors (a Ray cluster it
    started, the engine's workers, the forked sharing probe). Reads 0 where there is no /proc."""

    def __init__(self, every: float = 0.3):
        import threading

        self.every, self.me = every, os.getpid()
        self.other = self.ours = 0.0
        self.seconds = 0.0
        self.runnable: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _snapshot() -> dict[int, tuple[int, float]]:
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return out

    def _is_ours(self, pid: int, snap: dict) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid == self.me:
                return True
            pid = snap.get(pid, (0, 0.0))[0]
            seen += 1
        return False

    @staticmethod
    def _running(pid: int) -> float:
        """Runnable threads of ``pid``, each weighted as the kernel's fair scheduler weighs it against
        a nice-0 thread (1.25 ** -nice: Ray starts its workers at nice 15, so another user's idle-
        priority Ray workers barely take anything from ours)."""
        n = 0.0
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return 0.0
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "R":
                n += 1.25 ** -int(fields[16])
        return n

    def _run(self) -> None:
        last, t_last = self._snapshot(), time.perf_counter()
        while not self._stop.wait(self.every):
            snap, now = self._snapshot(), time.perf_counter()
            ours = {pid for pid in snap if self._is_ours(pid, snap)}
            if snap:
                self.runnable.append(sum(self._running(pid) for pid in snap if pid not in ours))
            for pid, (_, cpu) in snap.items():
                used = cpu - last[pid][1] if pid in last else 0.0
                if used > 0:
                    if pid in ours:
                        self.ours += used
                    else:
                        self.other += used
            self.seconds += now - t_last
            last, t_last = snap, now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    @property
    def other_cores(self) -> float:
        return self.other / self.seconds if self.seconds else 0.0

    @property
    def other_runnable(self) -> float:
        return statistics.fmean(self.runnable) if self.runnable else 0.0


# ------------------------------------------------------------------------------------ Ray


class _Probe:
    """A stand-in engine worker for timing Ray itself (wrapped with ray.remote by the profile)."""

    def __init__(self):
        torch.set_num_threads(1)

    def ping(self, unit=None, packet=None) -> dict:
        now = time.time()
        return {"events": [{"kind": "rollout", "uid": "u", "iteration": 0, "version": 0, "start": now, "end": now,
                            "args": {}}], "rewards": torch.zeros(8)}

    def produce(self, nbytes: int):
        data = torch.zeros(max(1, nbytes // 4))
        return data, {"n": data.numel()}

    def consume(self, data, *args) -> dict:
        return {"n": int(data.numel())}

    def put(self, nbytes: int):
        import ray

        state = {"w": torch.zeros(max(1, nbytes // 4))}
        t0 = time.perf_counter()
        ref = ray.put(state)
        return [ref], time.perf_counter() - t0

    def get(self, refs) -> float:
        import ray

        t0 = time.perf_counter()
        ray.get(refs[0])
        return time.perf_counter() - t0

    def address(self):
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, address: str, port: int, rank: int, world: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world)

    def allreduce(self, numel: int, repeats: int) -> float:
        import torch.distributed as dist

        flat = torch.zeros(max(1, numel))
        dist.all_reduce(flat)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
        return statistics.median(times)


def ray_overheads(unit_bytes: float, weight_bytes: int, trained_params: int, repeats: int = 30) -> dict:
    """Ray's own costs between two actors on this machine (a local cluster, started and stopped here)."""
    import logging

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ours = not ray.is_initialized()
    if ours:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    try:
        remote = ray.remote(num_cpus=0.01)(_Probe)
        a, b = remote.remote(), remote.remote()
        ray.get([a.ping.remote(), b.ping.remote()])

        def call(actor_call) -> float:
            t0 = time.perf_counter()
            ref = actor_call()
            ray.wait([ref], num_returns=1)
            ray.get(ref)
            return time.perf_counter() - t0

        for _ in range(5):
            call(lambda: a.ping.remote())
        call_s = statistics.median(call(lambda: a.ping.remote()) for _ in range(repeats))
        sizes = [max(1024, int(unit_bytes)), max(4 * 2**20, 8 * int(unit_bytes))]
        transfer = []
        for size in sizes:
            times = []
            for _ in range(max(5, repeats // 3)):
                data, small = a.produce.options(num_returns=2).remote(size)
                ray.get(small)
                times.append(call(lambda: b.consume.remote(data)) - call_s)
            transfer.append(max(0.0, statistics.median(times)))
        per_byte = max(1e-12, (transfer[1] - transfer[0]) / (sizes[1] - sizes[0]))
        latency = max(0.0, transfer[0] - per_byte * sizes[0])
        puts, gets = [], []
        for _ in range(max(5, repeats // 3)):
            refs, put_s = ray.get(a.put.remote(weight_bytes))
            puts.append(put_s)
            gets.append(ray.get(b.get.remote(refs)))
        address, port = ray.get(a.address.remote())
        ray.get([a.join.remote(address, port, 0, 2), b.join.remote(address, port, 1, 2)])
        ar = ray.get([a.allreduce.remote(trained_params, repeats), b.allreduce.remote(trained_params, repeats)])
        for actor in (a, b):
            ray.kill(actor)
        return {"call_s": call_s, "transfer_latency_s": latency, "transfer_bytes_per_s": 1.0 / per_byte,
                "transfer_sizes": sizes, "transfer_s": transfer, "put_s": statistics.median(puts),
                "get_s": statistics.median(gets), "allreduce_s": max(ar), "source": "ray micro-benchmarks"}
    finally:
        if ours:
            ray.shutdown()


def engine_run_overheads(cfg, m: dict, iterations: int = 8) -> dict:
    """Run the engine itself (disaggregated, GAP/TSP/TAG off, 1 rollout + 1 trainer CPU worker) and
    read from its timeline what it pays around the units: the dispatch gap before a unit (median),
    the extra before a train unit that waits on another worker's samples, publish and fetch times;
    how much longer a unit takes in an engine worker than the profile's own whole unit
    (``unit_time_factor``), and the unit-to-unit spread inside the workers (``unit_cv``)."""
    from digenrl.config import validate_config
    from digenrl.engine.runtime import run_engine
    from digenrl.engine.timeline import Timeline

    data = cfg.model_dump(mode="json")
    data["cluster"] = {"pools": [{"name": "rollout", "device": "cpu", "count": 1},
                                 {"name": "trainer", "device": "cpu", "count": 1}]}
    data["placement"] = {"mode": "disaggregated", "rollout_pool": "rollout", "trainer_pool": "trainer"}
    data["engine"] = {**data["engine"], "gap": False, "tag": False, "tsp_degree": 1, "max_staleness": 0}
    data["train"] = {**data["train"], "iterations": iterations, "device": "cpu"}
    data["output"] = {**data["output"], "save_samples_every": 0, "checkpoint_every": 0, "eval_every": 0}
    cal = validate_config(data)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_engine(cal, Path(tmp) / "run")
        tl = Timeline.from_chrome_trace(Path(tmp) / "run" / "timeline.json")
    out = timeline_overheads(tl, m)
    out["unit_time_factor"] = unit_time_factors(tl, cal, m)
    out["unit_cv"] = timeline_unit_cv(tl)
    out["calibration_rows"] = [{k: r[k] for k in ("iteration", "wall_s", "samples_per_s", "bubble_fraction")}
                               for r in result.metrics]
    return out


def unit_time_factors(tl, cfg, m: dict, reference: dict[str, float] | None = None) -> dict:
    """How much longer units take inside the engine's worker processes than in the profile (Ray's
    worker process and its threads, samples read from the object store, the driver and the other
    worker beside them): mean engine unit time, over the iterations after the first, / the
    ``reference`` unit time, per unit kind -- by default the profile's composed unit, which at the
    profiled unit size is its round-robin whole unit: the very estimate the cost model scales.
    (Against whole units timed back to back right before and after the run, the factor came out
    ~1.0 while runs measured ~1.2 against the round-robin units: the two estimates of one unit
    differed by ~17% on the 2-core host, so the factor must be taken against the one it scales.)"""
    from digenrl.planner.costmodel import ProfiledTimes, Workload, rollout_unit_time, train_unit_time

    if reference is None:
        w = Workload.from_config(cfg)
        times = ProfiledTimes({"device": {"name": "profile"}, "measurements": m})
        groups = cfg.engine.unit_groups
        reference = {"rollout": rollout_unit_time(times, w, groups)[0],
                     "train": train_unit_time(times, w, groups, 0, 1, cfg.train.micro_batch)}
    out = {}
    for kind, pred in reference.items():
        got = [e.duration for e in tl.events if e.kind == kind and e.iteration > 0]
        if got and pred > 0:
            out[kind] = statistics.fmean(got) / pred
    return out


def unit_spread(series: list[list[float]]) -> float:
    """Coefficient of variation of unit durations from successive differences (von Neumann):
    ``sqrt(mean((x[i+1] - x[i])^2) / 2) / mean(x)`` within each series (one worker's units, or one
    item's timing rounds, in time order). What two workers' units differ by at a barrier is their
    unit-to-unit jitter; a slow drift of the host's speed, which both see alike, does not count."""
    diffs = [(b - a) ** 2 for xs in series for a, b in zip(xs, xs[1:])]
    values = [x for xs in series for x in xs]
    if not diffs or not values:
        return 0.0
    return (statistics.fmean(diffs) / 2) ** 0.5 / statistics.fmean(values)


def timeline_unit_cv(tl) -> dict[str, float]:
    """:func:`unit_spread` of a run's rollout and train units, each worker's in time order, after
    the first (warm-up) iteration."""
    events = sorted(tl.events, key=lambda e: e.start)
    return {kind: unit_spread([[e.duration for e in events if e.kind == kind and e.worker == w and e.iteration > 0]
                               for w in tl.workers]) for kind in ("rollout", "train")}


def timeline_overheads(tl, m: dict) -> dict:
    main = sorted((e for e in tl.events if e.kind in ("rollout", "train", "step")
                   or (e.kind == "sync" and e.args.get("direction") == "fetch")), key=lambda e: e.start)
    calls, transfers = [], []
    last_on: dict[str, object] = {}
    for e in main:
        before = [f for f in main if f.end <= e.start + 1e-9 and f is not e]
        prev = last_on.get(e.worker)
        last_on[e.worker] = e
        if not before or (prev is not None and prev.kind == "sync"):
            continue  # the run's first unit, or a rollout right after its own weight fetch
        trigger = max(before, key=lambda f: f.end)
        gap = e.start - trigger.end
        if e.kind == "train" and trigger.kind == "rollout" and trigger.worker != e.worker:
            transfers.append(gap)
        else:
            calls.append(gap)
    call_s = statistics.median(calls) if calls else 0.0
    fetch = [e.duration for e in tl.events if e.kind == "sync" and e.args.get("direction") == "fetch"]
    publish = [e.duration for e in tl.events if e.kind == "sync" and e.args.get("direction") == "publish"]
    ws = m["weight_sync"]
    out = {"call_s": call_s, "source": "engine calibration run (timeline gaps)", "gaps": len(calls)}
    if transfers:
        out["transfer_latency_s"] = max(0.0, statistics.median(transfers) - call_s)
    if fetch:
        out["get_s"] = max(0.0, statistics.median(fetch) - ws["load_s"])
    if publish:
        out["put_s"] = max(0.0, statistics.median(publish) - ws["pack_s"])
    return out


# ------------------------------------------------------------------------------ load / save


def save_profile(profile: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2, default=str))
    return path


def load_profile(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--profile: file not found: {path}")
    try:
        data = json.loads(read_user_text(path, "--profile"))
    except json.JSONDecodeError as exc:
        raise UserError(f"--profile: {path} is not valid JSON (line {exc.lineno})") from None
    needed = ("device", "model", "measurements", "workload")
    if not isinstance(data, dict) or any(k not in data for k in needed) or data.get("version") != PROFILE_VERSION:
        raise UserError(f"--profile: {path} is not a digenrl profile (version {PROFILE_VERSION}); "
                        "write one with `digenrl profile`")
    return data

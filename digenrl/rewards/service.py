"""Rewards served apart from the rollout workers: a Ray actor and the client a worker holds.

Details: docs/modules.md, `digenrl.rewards.service`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import torch

from digenrl.config.train import RewardConfig
from digenrl.errors import UserError
from digenrl.rewards import CombinedReward, build_reward
from digenrl.rewards.base import Decoded, Scores, score

ACTOR_CONCURRENCY = 16  # threads: calls waiting on the scoring lock (= observable queue) + stats()


class _Latency:
    """Per-reward latency and call counts, shared by the actor and the inline client."""

    def __init__(self):
        self.calls = self.samples = 0
        self.seconds = 0.0
        self.per_reward: dict[str, dict] = {}

    def record(self, n: int, seconds: float, timings: dict[str, float]) -> None:
        self.calls += 1
        self.samples += n
        self.seconds += seconds
        for name, s in timings.items():
            r = self.per_reward.setdefault(name, {"calls": 0, "total_s": 0.0, "max_s": 0.0, "last_s": 0.0})
            r["calls"] += 1
            r["total_s"] += s
            r["max_s"] = max(r["max_s"], s)
            r["last_s"] = s

    def as_dict(self) -> dict:
        per = {name: {**r, "mean_s": r["total_s"] / r["calls"]} for name, r in self.per_reward.items()}
        return {"calls": self.calls, "samples": self.samples, "busy_s": self.seconds, "rewards": per}


class RewardActor:
    """Plain class; :func:`start_reward_actor` wraps it with ``ray.remote`` and its resources."""

    def __init__(self, cfg: RewardConfig, faults=None):
        """``faults``: the engine's :class:`~digenrl.engine.faults.FaultInjector` for this actor
        (``engine.faults``)."""
        self.faults = faults
        self.init_error = None  # raised from ready(): Ray hands the caller the exception itself
        try:
            self.reward: CombinedReward = build_reward(cfg)
        except UserError as exc:
            self.init_error = exc
        self.lock, self.mu = threading.Lock(), threading.Lock()
        self.waiting = self.max_waiting = self.scoring = 0
        self.latency = _Latency()

    def ready(self) -> list[str]:
        if self.init_error is not None:
            raise self.init_error
        return [name for name, _, _ in self.reward.terms]

    def score(self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None):
        """One batch of decoded samples -> ``(total, parts)`` (CPU tensors)."""
        scores = self.score_timed(Decoded(pixels, list(prompts), metadata or [{} for _ in prompts]))
        return scores.total, scores.parts

    def score_timed(self, decoded: Decoded, label: str | None = None) -> Scores:
        """:meth:`score` of a unit's decoded samples (:func:`~digenrl.rewards.base.score`), with the queue
        of the call (``wait_s``, ``queue_depth``). ``label``: what is scored (the engine passes the
        unit's uid; a fault plugin may end the process there: Ray restarts the actor and runs the call
        again, scoring being pure)."""
        if self.faults is not None:
            self.faults.reached(label)
        arrived = time.time()
        with self.mu:
            ahead = self.waiting + self.scoring
            self.waiting += 1
            self.max_waiting = max(self.max_waiting, self.waiting)
        with self.lock:
            with self.mu:
                self.waiting -= 1
                self.scoring = 1
            try:
                scores = score(self.reward, decoded)
                self.latency.record(len(decoded.prompts), scores.end - scores.start, scores.timings)
            finally:
                with self.mu:
                    self.scoring = 0
        scores.wait_s, scores.queue_depth = scores.start - arrived, ahead
        return scores

    def check(self, prompts: list[str], shape: tuple[int, ...], metadata: list[dict] | None = None) -> dict:
        with self.lock:
            return self.reward.check(prompts, shape, metadata)

    def stats(self) -> dict:
        """Per-reward latency (calls, mean / max / last / total seconds), samples scored, and the
        queue depth: calls waiting for the models now and at most so far."""
        with self.mu:
            depth, peak = self.waiting, self.max_waiting
        return {**self.latency.as_dict(), "queue_depth": depth, "max_queue_depth": peak}


def start_reward_actor(
    cfg: RewardConfig, name: str | None = None, max_restarts: int = 0, faults=None, cls: type = RewardActor
):
    """Start the reward actor (of class ``cls``) on the connected Ray cluster with ``cfg.service``'s
    resources and wait until its models are loaded (a bad reward config raises its UserError here).
    Ray restarts it up to ``max_restarts`` times if its process dies (the engine re-queues the units
    whose scores were lost). ``faults``: its fault plugin (:class:`~digenrl.engine.faults.FaultInjector`)."""
    import ray

    svc = cfg.service
    # a restarted actor runs the calls it lost again (scoring is a pure function): no unit loses its scores
    opts = {
        "max_concurrency": ACTOR_CONCURRENCY,
        "max_restarts": max_restarts,
        "max_task_retries": -1 if max_restarts else 0,
    }
    if svc is not None:
        opts.update(num_cpus=svc.num_cpus, num_gpus=svc.num_gpus)
        if svc.resources:
            opts["resources"] = dict(svc.resources)
    if svc is None or not svc.num_gpus:  # asks for no GPU: sees none (Ray would leave them all visible)
        opts["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    if name is not None:
        opts["name"] = name
    return await_ready(ray.remote(cls).options(**opts).remote(cfg, faults))


def await_ready(handle):
    """Wait until the reward actor ``handle`` has built its reward; a bad reward config raises its
    UserError here, and the actor is killed."""
    import ray

    try:
        _get(handle.ready.remote())
    except BaseException:
        ray.kill(handle)
        raise
    return handle


def _get(ref, timeout: float | None = None):
    """ray.get, with a UserError raised inside the actor re-raised as itself."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, UserError):
            raise cause from None
        raise


class RewardClient:
    """A rollout worker's handle on the reward actor: ``submit`` returns an ObjectRef at once."""

    def __init__(self, actor):
        self.actor = actor
        self.pending: list = []

    def submit(self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None):
        return self._track(self.actor.score.remote(pixels.detach().cpu(), list(prompts), metadata))

    def submit_scored(self, decoded: Decoded, label: str | None = None):
        """Like :meth:`submit`, to the :class:`~digenrl.rewards.base.Scores` of a unit's decoded samples
        (what the engine's driver waits on); ``label`` names what is scored (the unit's uid)."""
        return self._track(self.actor.score_timed.remote(decoded, label))

    def _track(self, ref):
        self.in_flight()  # forget the finished ones: holding their refs would pin their results
        self.pending.append(ref)
        return ref

    def result(self, ref, timeout: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return _get(ref, timeout)

    def __call__(self, pixels, prompts, metadata=None):
        return self.result(self.submit(pixels, prompts, metadata))

    def in_flight(self) -> int:
        """This client's submissions not yet scored."""
        import ray

        if self.pending:
            _, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
        return len(self.pending)

    def check(self, prompts, shape, metadata=None) -> dict:
        return _get(self.actor.check.remote(prompts, tuple(shape), metadata))

    def stats(self) -> dict:
        return {**_get(self.actor.stats.remote()), "in_flight": self.in_flight()}


class InlineRewardClient:
    """The same interface without Ray: scores in this process when submitted."""

    def __init__(self, reward: CombinedReward):
        self.reward = reward
        self.latency = _Latency()

    def submit(self, pixels, prompts, metadata=None) -> Future:
        fut: Future = Future()
        try:
            t0 = time.perf_counter()
            out = self.reward(pixels, prompts, metadata)
            self.latency.record(len(prompts), time.perf_counter() - t0, self.reward.last_timings)
            fut.set_result(out)
        except Exception as exc:  # kept in the future, raised by result(), as a remote call would
            fut.set_exception(exc)
        return fut

    def result(self, fut: Future, timeout: float | None = None):
        return fut.result(timeout)

    def __call__(self, pixels, prompts, metadata=None):
        return self.result(self.submit(pixels, prompts, metadata))

    def check(self, prompts, shape, metadata=None) -> dict:
        return self.reward.check(prompts, shape, metadata)

    def stats(self) -> dict:
        return {**self.latency.as_dict(), "queue_depth": 0, "max_queue_depth": 0, "in_flight": 0}


def reward_call_metrics(calls: list[dict]) -> dict[str, float]:
    """An iteration's reward calls -> metrics: ``reward_latency_s`` (mean seconds per call) and
    ``reward_latency_s/<name>`` (mean per reward); for calls to the reward service also
    ``reward_wait_s`` (mean seconds queued) and ``reward_queue_depth`` (the most calls ahead of
    one). Each call: ``seconds``, ``timings`` (per reward) and, from the service, ``wait_s`` and
    ``queue_depth``."""
    if not calls:
        return {}
    row = {"reward_latency_s": sum(c["seconds"] for c in calls) / len(calls)}
    names = dict.fromkeys(name for c in calls for name in c["timings"])
    for name in names:
        mine = [c["timings"][name] for c in calls if name in c["timings"]]
        row[f"reward_latency_s/{name}"] = sum(mine) / len(mine)
    served = [c for c in calls if "queue_depth" in c]
    if served:
        row["reward_wait_s"] = sum(c["wait_s"] for c in served) / len(served)
        row["reward_queue_depth"] = max(c["queue_depth"] for c in served)
    return row


def reward_client(cfg: RewardConfig, actor=None) -> RewardClient | InlineRewardClient:
    """The client for a worker: on ``actor`` (a handle from :func:`start_reward_actor`) when
    given, else inline."""
    return RewardClient(actor) if actor is not None else InlineRewardClient(build_reward(cfg))

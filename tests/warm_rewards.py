"""Warm reward actors: the test suite keeps a finished run's reward actor (``reward.service``) for the
next run, as tests/warm.py keeps its workers (the actor source's ``start_reward`` / ``finish_reward``).

A reward actor's process costs ~2 s of CPU before it builds its reward (Python, a Ray worker, torch);
the suite's Ray-cluster runs started 11 of them, almost all asking the same resources. Kept only
when a mistake could not pass unseen: a service asking a small CPU share alone (no GPU, no custom
resource a test counts), in a run without injected faults. A kept actor is created with no restart
budget: Ray would restart it with its first run's reward config, so a process lost unexpectedly
fails its run instead.
"""

from __future__ import annotations

from digenrl.rewards.service import RewardActor, await_ready, start_reward_actor


class WarmRewardActor(RewardActor):
    """A reward actor that can build the next run's reward in its live process (:meth:`rebuild`)."""

    def rebuild(self, cfg, faults=None) -> None:
        self.__dict__.clear()
        RewardActor.__init__(self, cfg, faults)


#: the most CPU a kept reward actor may hold (the suite's services ask 0.1): never in another run's way
MAX_KEPT_CPUS = 0.25


def reward_kind(cfg) -> tuple | None:
    """What a kept reward actor must match to serve ``cfg``'s run, or None: this run's is fresh."""
    svc = cfg.reward.service
    if cfg.engine.faults or svc.num_gpus or svc.resources or svc.num_cpus > MAX_KEPT_CPUS:
        return None
    return (svc.num_cpus,)


class WarmRewards:
    """At most one kept reward actor (``kept``: its kind and handle) and the one a run holds."""

    def __init__(self):
        self.kept: tuple | None = None
        self.running: tuple | None = None
        self.reused = self.started = 0

    def start(self, cfg, faults):
        """The run's reward actor: the kept one of its kind rebuilt, else a new one."""
        import ray

        kind = reward_kind(cfg)
        if kind is None:
            self.running = None
            return start_reward_actor(cfg.reward, max_restarts=cfg.engine.max_restarts, faults=faults)
        if self.kept is not None and self.kept[0] == kind:
            actor, self.kept = self.kept[1], None
            try:  # (a threaded actor: its calls are not ordered, so the rebuild is waited for)
                ray.get(actor.rebuild.remote(cfg.reward))
            except BaseException:
                ray.kill(actor, no_restart=True)
                raise
            await_ready(actor)  # a bad reward config raises its UserError here, as from a new actor
            self.reused += 1
        else:
            self.clear()
            actor = start_reward_actor(cfg.reward, max_restarts=0, cls=WarmRewardActor)
            self.started += 1
        self.running = (kind, actor)
        return actor

    def finish(self, actor, clean: bool) -> None:
        """The run is over: its reward actor is kept if the run finished, else killed."""
        import ray

        running, self.running = self.running, None
        if clean and running is not None and running[1] is actor:  # (start took or cleared the kept one)
            self.kept = running
        else:
            ray.kill(actor, no_restart=True)

    def clear(self) -> None:
        import ray

        kept, self.kept = self.kept, None
        if kept is not None and ray.is_initialized():
            ray.kill(kept[1], no_restart=True)

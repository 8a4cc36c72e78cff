"""The layout of a run, resolved once: what every process of the run does, decided before it starts.

Details: docs/modules.md, `digenrl.placement.layout`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from digenrl.config.engine import PoolConfig
from digenrl.config.run import RunConfig
from digenrl.distributed.settings import fsdp_refusal, sp_refusal
from digenrl.errors import UserError
from digenrl.placement.plan import Plan, Worker
from digenrl.policy.settings import Settings, single_process_settings
from digenrl.schedule.scheduler import SchedulerConfig

Groups = tuple[tuple[str, ...], ...]  # each group: its lead first, then its followers


@dataclass(frozen=True)
class WorkerLayout:
    """One worker's part of the layout: what its actor does."""

    name: str
    role: str  # rollout | trainer | both
    pool: str
    device: str  # its pool's device type (cpu: a logical CPU device; a GPU type)
    torch_device: str  # where its models live (cpu | cuda): train.device resolved for its pool, once
    rank: int | None  # its rank among the trainer ranks (None: a rollout worker)
    lead: str | None  # the worker whose calls it runs (None: scheduled itself)
    followers: tuple[str, ...]  # the workers that run this one's calls (a lead)
    sp: int  # devices its transformer runs over (sequence parallelism)
    fsdp: int  # its shard group's size (1: not sharded)


@dataclass(frozen=True)
class RunLayout:
    mode: str  # local | colocated | disaggregated
    settings: Settings
    plan: Plan | None = None  # None: a local run
    scheduler: SchedulerConfig | None = None  # at the run's start (a resume replaces start_iteration)
    shard_groups: Groups = ()  # FSDP2 shard groups of the trainer ranks (none when replicated)
    rollout_sp_groups: Groups = ()
    trainer_sp_groups: Groups = ()
    verdict: str = "runs"  # or the one-line reason the engine refuses the combination
    tag_note: str = ""  # engine.tag unset: what it settled to, and why (placement/tag_choice.py)
    bts_priors: tuple[tuple[str, str, float], ...] = ()  # tag auto: (kind, worker, seconds) BTS starts from

    # -- the workers ---------------------------------------------------------------------

    @property
    def workers(self) -> list[Worker]:
        """Every worker, rollout workers first (the order idle workers ask in)."""
        return self.plan.workers() if self.plan is not None else []

    @property
    def trainer_ranks(self) -> list[str]:
        """The workers that train (roles trainer / both), in rank order."""
        return [w.name for w in self.workers if w.role != "rollout"]

    @property
    def leads(self) -> dict[str, str]:
        """Each follower -> the worker whose calls it runs: its FSDP shard group's first rank, else
        its sequence-parallel group's lead (the timeline counts it busy with that one)."""
        out = {r: g[0] for g in self.shard_groups for r in g[1:]}
        for g in self.rollout_sp_groups + self.trainer_sp_groups:
            for name in g[1:]:
                out.setdefault(name, g[0])
        return out

    @property
    def hidden(self) -> set[str]:
        """The followers: the scheduler does not see them."""
        return set(self.leads)

    @property
    def scheduled(self) -> list[Worker]:
        hidden = self.hidden
        return [w for w in self.workers if w.name not in hidden]

    @property
    def sp_members(self) -> set[str]:
        return {n for g in self.rollout_sp_groups + self.trainer_sp_groups for n in g}

    @property
    def sp_followers(self) -> set[str]:
        """The members of a sequence-parallel group that follow its lead (they score nothing)."""
        return {n for g in self.rollout_sp_groups + self.trainer_sp_groups for n in g[1:]}

    @property
    def node_groups(self) -> list[tuple[str, ...]]:
        """The workers that must share one node (an FSDP shard group, a sequence-parallel group:
        their collectives run every forward), overlapping groups merged, in worker order."""
        merged: list[set[str]] = []
        for g in self.shard_groups + self.rollout_sp_groups + self.trainer_sp_groups:
            group = set(g)
            for other in [m for m in merged if m & group]:
                group |= other
                merged.remove(other)
            merged.append(group)
        order = [w.name for w in self.workers]
        return sorted((tuple(n for n in order if n in m) for m in merged), key=lambda g: order.index(g[0]))

    def followers_of(self, name: str) -> tuple[str, ...]:
        """The workers ``name`` leads through every call: its shard group's others (FSDP leads the
        trainer's sequence-parallel groups too), else its sequence-parallel group's."""
        for g in self.shard_groups:
            if g[0] == name:
                return g[1:]
        if self.shard_groups and name in self.trainer_ranks:
            return ()
        for g in self.rollout_sp_groups + self.trainer_sp_groups:
            if g[0] == name:
                return g[1:]
        return ()

    def worker(self, name: str) -> WorkerLayout:
        w = next((w for w in self.workers if w.name == name), None)
        if w is None:
            raise KeyError(f"no worker {name!r} in the layout")
        ranks = self.trainer_ranks
        plan = self.plan
        sharded = w.role != "rollout" and self.settings.fsdp > 1
        return WorkerLayout(
            name=w.name,
            role=w.role,
            pool=w.pool.name,
            device=w.pool.device,
            torch_device="cpu" if w.pool.device.lower() == "cpu" else self.settings.gpu_device,
            rank=ranks.index(name) if name in ranks else None,
            lead=self.leads.get(name),
            followers=self.followers_of(name),
            sp=plan.sp(w.pool),
            fsdp=self.settings.fsdp if sharded else 1,
        )

    # -- what a process does -------------------------------------------------------------

    def will_shard(self, role: str) -> bool:
        """Whether a worker of ``role`` becomes a rank of a sharded (FSDP2) trainer group."""
        return role != "rollout" and bool(self.shard_groups)

    def scheduler_config(self, start_iteration: int = 0) -> SchedulerConfig:
        return dataclasses.replace(self.scheduler, start_iteration=start_iteration)

    # -- readable ------------------------------------------------------------------------

    def to_dict(self) -> dict:
        out = {"mode": self.mode, "verdict": self.verdict, "settings": dataclasses.asdict(self.settings)}
        out |= {"tag_note": self.tag_note, "bts_priors": [list(p) for p in self.bts_priors]}
        if self.plan is not None:
            out["plan"] = {
                **{f.name: getattr(self.plan, f.name) for f in dataclasses.fields(self.plan)},
                "pools": [p.model_dump(mode="json") for p in self.plan.pools],
                "label": self.plan.label(),
            }
            out["workers"] = [dataclasses.asdict(self.worker(w.name)) for w in self.workers]
            out["groups"] = {
                "trainer_ranks": self.trainer_ranks,
                "shard_groups": [list(g) for g in self.shard_groups],
                "rollout_sp_groups": [list(g) for g in self.rollout_sp_groups],
                "trainer_sp_groups": [list(g) for g in self.trainer_sp_groups],
            }
            out["scheduler"] = dataclasses.asdict(self.scheduler)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> RunLayout:
        plan = None
        if "plan" in data:
            fields = {f.name for f in dataclasses.fields(Plan)}
            p = {k: v for k, v in data["plan"].items() if k in fields}
            plan = Plan(**{**p, "pools": tuple(PoolConfig(**q) for q in p["pools"])})
        groups = data.get("groups", {})
        return cls(
            mode=data["mode"],
            settings=Settings(**data["settings"]),
            plan=plan,
            scheduler=SchedulerConfig(**data["scheduler"]) if "scheduler" in data else None,
            shard_groups=_groups(groups.get("shard_groups", [])),
            rollout_sp_groups=_groups(groups.get("rollout_sp_groups", [])),
            trainer_sp_groups=_groups(groups.get("trainer_sp_groups", [])),
            verdict=data["verdict"],
            tag_note=data.get("tag_note", ""),
            bts_priors=tuple(tuple(p) for p in data.get("bts_priors", [])),
        )

    def write(self, run_dir: Path) -> Path:
        """``RUN/layout.json``: what this run's processes do."""
        path = Path(run_dir) / "layout.json"
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def describe(self) -> list[str]:
        """The layout in a few lines (``digenrl config validate`` prints them)."""
        s = self.settings
        lines = []
        if self.plan is not None:
            lines.append(f"plan: {self.plan.label()}")
            for w in self.workers:
                wl = self.worker(w.name)
                what = f"follows {wl.lead}" if wl.lead else "scheduled"
                rank = f", trainer rank {wl.rank}" if wl.rank is not None else ""
                extra = (f", sp {wl.sp}" if wl.sp > 1 else "") + (f", fsdp {wl.fsdp}" if wl.fsdp > 1 else "")
                lines.append(f"  {w.name}: {w.role} on {wl.device} ({what}{rank}{extra})")
        else:
            lines.append("plan: local (one process)")
        fsdp = f"FSDP2 x{s.fsdp}" if s.fsdp > 1 else "replicated"
        if s.fsdp > 1 and len(self.shard_groups) > 1:
            fsdp += f" (HSDP: {len(self.shard_groups)} replica groups)"
        lines.append(
            f"settings: trainer {fsdp}, activation checkpointing "
            f"{'on' if s.activation_checkpointing else 'off'}, "
            f"micro-batch {s.micro_batch}; rollout batch {s.rollout_batch or 'trainer'}; "
            f"colocated batch {s.colocated_batch or 'trainer'}; "
            f"CFG trainer {s.cfg_batching_trainer} / rollout "
            f"{s.cfg_batching_rollout}; VAE tiling {s.vae_tiling}; KL reference {s.kl_reference}; "
            f"weight sync {s.weight_sync}"
            + (" (object store if the group does not form)" if s.weight_sync_fallback else "")
        )
        if s.memory_device:
            lines.append(
                f"memory: a trainer rank needs {s.memory_need_gib:.1f} of {s.memory_have_gib:.1f} GiB "
                f"on {s.memory_device}"
            )
        if self.tag_note:
            lines.append(self.tag_note)
        if self.bts_priors:
            n = len(self.bts_priors)
            lines.append(
                f"BTS starts from the cost model's unit times ({n}; the run's measured ones replace them)"
            )
        lines.append(f"verdict: {self.verdict}")
        return lines


def _groups(rows) -> Groups:
    return tuple(tuple(g) for g in rows)


def consecutive(names: list[str], size: int) -> Groups:
    """``names`` in consecutive groups of ``size`` (none when ``size`` is 1)."""
    return tuple(tuple(names[i : i + size]) for i in range(0, len(names), size)) if size > 1 else ()


def engine_layout(cfg: RunConfig, plan: Plan, settings: Settings, scheduler: SchedulerConfig) -> RunLayout:
    """The layout of an engine run from its plan and resolved settings: the groups follow from them."""
    workers = plan.workers()
    ranks = [w.name for w in workers if w.role != "rollout"]
    return RunLayout(
        mode=plan.placement,
        settings=settings,
        plan=plan,
        scheduler=scheduler,
        shard_groups=consecutive(ranks, settings.fsdp) if len(ranks) > 1 else (),
        rollout_sp_groups=consecutive([w.name for w in workers if w.role == "rollout"], plan.rollout_sp),
        trainer_sp_groups=consecutive([w.name for w in workers if w.role != "rollout"], plan.trainer_sp),
    )


def local_layout(cfg: RunConfig) -> RunLayout:
    """A local run's layout: one process, nothing to place, every ``auto`` as a single process runs it;
    sharding and sequence parallelism are refused (one line: they need the engine)."""

    mode = cfg.placement.mode
    for key, role in (("rollout_sp", "rollout"), ("trainer_sp", "trainer")):
        s = getattr(cfg.engine, key)
        why = sp_refusal(role, s, placement=mode, devices=0) if mode == "local" else None
        if why:
            raise UserError(f"engine.{key}: {s}: {why}")
    n = cfg.train.fsdp
    if mode == "local" and isinstance(n, int) and n > 1:
        raise UserError(f"train.fsdp: {n}: {fsdp_refusal(n, placement='local', ranks=0)}")
    return RunLayout(mode="local", settings=single_process_settings(cfg))

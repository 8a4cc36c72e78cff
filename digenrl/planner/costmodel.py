"""What each unit of work costs on each device type of a cluster: :class:`CostModel`.

Details: docs/modules.md, `digenrl.planner.costmodel`.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from digenrl.placement.devices import DEVICES
from digenrl.planner.calibrate import (
    calibrated_mfu,
    check_profile_matches,
    profiled_overheads,
    unit_time_factor,
)
from digenrl.planner.call_times import (
    AnalyticTimes,
    CallTimes,
    ProfiledTimes,
    rollout_unit_time,
    train_unit_time,
)
from digenrl.planner.constants import FP32_BYTES, FSDP_STEP_SHARE, MIN_UNIT_CV
from digenrl.planner.gpus import ClusterSpec
from digenrl.planner.memory import DeviceSetup, MemoryModel
from digenrl.planner.pair_times import pair_unit_time
from digenrl.planner.params import ColocationCosts, CostParams, EngineOverheads
from digenrl.planner.sp_times import SequenceParallelTimes
from digenrl.planner.workload import Workload


class CostModel:
    """Durations and memory of every unit on every device type of a cluster."""

    def __init__(
        self,
        workload: Workload,
        cluster: ClusterSpec,
        params: CostParams | None = None,
        colocation: ColocationCosts | None = None,
        overheads: EngineOverheads | None = None,
        profile: dict | None = None,
    ):
        if workload.kl_reference == "auto":  # algorithm.kl_reference auto, as placement.resolve resolves it
            workload = replace(workload, kl_reference="train" if cluster.is_cpu else "rollout")
        self.workload, self.cluster = workload, cluster
        self.params = params or CostParams()
        self.colocation = colocation or ColocationCosts()
        self.profile = profile
        self.overheads = overheads or EngineOverheads()
        self.unit_factor: dict[str, float] = {}  # CPU engine: units run this much slower in a worker
        if profile is not None:
            self._calibrate(profile)
        if cluster.is_cpu:
            self.colocation = ColocationCosts(**{**asdict(self.colocation), "switch_latency_s": 0.0})
        self._times: dict = {}

    def cpu_rate(self, busy: int) -> float:
        """Speed of each of ``busy`` processes computing at once on the CPU host, relative to one alone:
        processor sharing of the host's C cores (``host_cores``, default this machine's) with K
        runnable threads of other processes, relative to one worker beside the profile's K_p
        (``other_runnable``): ``min(1, C / (n + K)) / min(1, C / (1 + K_p))``, K = K_p unless
        ``cpu_other_load`` says otherwise; or with ``cpu_sharing: measured`` the profile's
        ``cpu_slowdown`` (what n concurrent workers got at one moment, other load included)."""
        busy = max(1, busy)
        table = (self.profile or {}).get("measurements", {}).get("cpu_slowdown")
        if self.params.cpu_sharing == "measured" and table and self.profiled("cpu"):
            if busy == 1:
                return 1.0
            slow = {int(k): v for k, v in table.items()}
            top = max(slow)
            factor = slow[busy] if busy in slow else slow[top] * busy / top
            return 1.0 / max(1.0, factor)
        # processor sharing of C cores between our ``busy`` workers and K runnable threads of other
        # processes, relative to what one worker got beside the load the profile was measured at
        cores, other = self.cluster.cores(), self.other_load()
        alone = min(1.0, cores / (1 + self.profiled_load()))
        return min(1.0, cores / (busy + other)) / alone

    def unit_cv(self, device: str, kind: str) -> float:
        """Spread (std / mean) of a ``kind`` ("rollout" | "train") unit's duration on ``device``:
        ``CostParams.unit_cv`` if set, else what the profile measured on that device (in the engine
        calibration run when there was one, else across the standalone timing rounds), else 0. A
        spread under ``MIN_UNIT_CV`` counts as none (a GPU's steady kernels: the wait it adds is below
        the model's accuracy, and replicas would multiply the search's time)."""
        if self.params.unit_cv is not None:
            cv = self.params.unit_cv
        elif not self.profiled(device):
            cv = 0.0
        else:
            prof = self.profile or {}
            measured = (
                (prof.get("engine") or {}).get("unit_cv") or prof.get("measurements", {}).get("unit_cv") or {}
            )
            cv = float(measured.get(kind, 0.0))
        return cv if cv >= MIN_UNIT_CV else 0.0

    def has_spread(self) -> bool:
        devices = {p.device for p in self.cluster.pools}
        return any(self.unit_cv(d, k) > 0 for d in devices for k in ("rollout", "train"))

    def profiled_load(self) -> float:
        """K at profiling time: runnable threads of other processes beside which the profile measured."""
        if self.profiled("cpu"):
            return float((self.profile or {}).get("measurements", {}).get("other_runnable", 0.0))
        return 0.0

    def other_load(self) -> float:
        """K predicted for the run: ``CostParams.cpu_other_load``, else the profile's (the load persists)."""
        if self.params.cpu_other_load is not None:
            return self.params.cpu_other_load
        return self.profiled_load()

    # -- calibration ---------------------------------------------------------------------

    def _calibrate(self, profile: dict) -> None:
        """A profile measured on a known GPU type sets the MFU for the types not profiled; a CPU
        profile's Ray measurements set the engine overheads of CPU clusters."""
        check_profile_matches(profile, self.workload)
        curve = calibrated_mfu(profile, self.workload)
        if curve is not None:
            p = self.params
            p.mfu_rollout, p.mfu_half_tokens_rollout, p.mfu_train, p.mfu_half_tokens_train = curve
            p.mfu_source = f"calibrated on {profile['device']['name']}"
        overheads = profiled_overheads(profile)
        if overheads is not None and self.cluster.is_cpu:
            self.overheads = overheads
            if self.params.engine_unit_factor:
                self.unit_factor = unit_time_factor(profile)

    def profiled(self, device: str) -> bool:
        if self.profile is None:
            return False
        dev = self.profile["device"]
        return (dev["kind"] == "cpu" and device == "cpu") or dev.get("table_key") == device

    def times(self, device: str, setup: DeviceSetup | None = None) -> CallTimes:
        """Per-call times on ``device`` run as ``setup`` says (checkpointing, FSDP degree, CFG mode, and
        sequence parallelism over ``setup.sp`` devices of one node)."""
        key = (
            device,
            setup.checkpointing if setup else False,
            setup.shard if setup else 1,
            setup.cfg_batched if setup else True,
            setup.sp if setup else 1,
        )
        if key not in self._times:
            if self.profiled(device):
                t = ProfiledTimes(self.profile)
            else:
                t = AnalyticTimes(
                    self.workload,
                    DEVICES[device],
                    self.params,
                    checkpointing=key[1],
                    shard=key[2],
                    link_bw=self.link_bw(device, key[2]),
                    cfg_batched=key[3],
                )
            sp = key[4]
            self._times[key] = (
                SequenceParallelTimes(t, self.workload, sp, self.link_bw(device, sp)) if sp > 1 else t
            )
        return self._times[key]

    # -- bandwidths ----------------------------------------------------------------------

    def link_bw(self, device: str, ranks: int) -> float:
        """Per-device bandwidth of a ring collective (all-gather, reduce-scatter, all-reduce) over
        ``ranks`` devices of one type, packed on whole nodes. Across nodes, NCCL runs one ring per
        channel and each channel crosses on another device's NIC (one per device, the interconnect's
        figure): the crossings share a node's NICs, so a device moves min(NVLink, NICs x per-NIC)."""
        spec = DEVICES[device]
        per_node = self.cluster.gpus_per_node
        if ranks <= per_node:
            return spec.link_bw
        return min(spec.link_bw, self.cluster.interconnect.bandwidth_gb_s * 1e9 * per_node)

    def network_bw(self) -> float:
        if self.overheads.transfer_bytes_per_s:
            return self.overheads.transfer_bytes_per_s
        return self.cluster.interconnect.bandwidth_gb_s * 1e9

    # -- unit durations ------------------------------------------------------------------

    def _factor(self, device: str, kind: str) -> float:
        return self.unit_factor.get(kind, 1.0) if self.profiled(device) and self.cluster.is_cpu else 1.0

    def rollout_unit(
        self, device: str, groups: float, setup: DeviceSetup | None = None
    ) -> tuple[float, float]:
        """(seconds, of which reward) for a rollout unit of ``groups`` prompt groups on a worker run as
        ``setup`` says (its sequence parallelism and CFG mode; None: one device, CFG batched)."""
        batch = setup.rollout_batch if setup is not None else self.workload.rollout_batch
        total, reward = rollout_unit_time(self.times(device, setup), self.workload, groups, batch)
        f = self._factor(device, "rollout")
        return total * f, reward * f

    def reward_hidden(self, device: str, groups: float, setup: DeviceSetup | None = None) -> float:
        """Seconds of a rollout unit's reward that a rollout-only worker scores beside its next unit
        (``Workload.reward_after_unit``: the engine's ``EngineWorker.score``, after the unit): a remote
        judge's wait wholly (the device is idle meanwhile), a model's time on the device by the share
        ``CostParams.model_reward_overlap``. The worker is busy the rest; the samples' scores are
        ready the whole reward after the unit's forwards and decode."""
        if not self.workload.reward_after_unit:
            return 0.0
        t, b = self.times(device, setup), groups * self.workload.group_size
        wait = t.reward_wait(b)
        on_device = t.reward(b) - wait
        return (wait + self.params.model_reward_overlap * on_device) * self._factor(device, "rollout")

    def train_unit(
        self, device: str, groups: int, tsp_rank: int, tsp_degree: int, setup: DeviceSetup | None = None
    ) -> float:
        """Seconds for a train unit: one mini-batch's share of ``groups`` groups (all of them with
        one optimizer step per iteration), TSP rank ``tsp_rank`` of ``tsp_degree``."""
        mb = setup.micro_batch if setup else self.workload.micro_batch
        t, w, f = self.times(device, setup), self.workload, self._factor(device, "train")
        if setup is not None and setup.pair_batch:  # timestep-pair batches (pair_times.py)
            return pair_unit_time(t, w, groups, tsp_rank, tsp_degree, mb, setup.pair_batch, setup.shard) * f
        return train_unit_time(t, w, groups, tsp_rank, tsp_degree, mb) * f

    def step(
        self, device: str, ranks: int, publish: bool, setup: DeviceSetup | None = None
    ) -> tuple[float, float]:
        """(seconds, of which publish) for one rank's share of the optimizer step."""
        t = self.times(device, setup)
        allreduce = 0.0
        ranks *= setup.sp if setup is not None else 1  # a rank's sp devices each hold a partial gradient
        if ranks > 1:
            grad_bytes = self.workload.trained_params * FP32_BYTES
            if self.profiled(device) and self.cluster.is_cpu:
                bw = self.network_bw()
            else:
                bw = self.link_bw(device, ranks)
            allreduce = 2 * (ranks - 1) / ranks * grad_bytes / bw + self.overheads.allreduce_latency_s
            if setup is not None and setup.shard > 1 and not self.workload.lora:
                allreduce *= FSDP_STEP_SHARE  # the reduce-scatter already ran in the backward
        publish_s = self.publish(device, setup) if publish else 0.0
        agree = t.agree() if self.workload.lora else 0.0  # every rank digests its LoRA weights (ranks agree)
        return allreduce + t.optimizer() + publish_s + agree, publish_s

    def broadcasts(self) -> bool:
        return self.workload.weight_sync == "broadcast"

    def wire(self) -> float:
        """One version over the interconnect: latency + bytes / bandwidth. A broadcast streams it
        bucket after bucket, pipelined, so its time does not grow with the number of receivers."""
        return self.cluster.interconnect.latency_us * 1e-6 + self.workload.sync_bytes / self.network_bw()

    def publish(self, device: str, setup: DeviceSetup | None = None) -> float:
        """Trainer rank 0 shipping a new version after its step: pack it (+ the store's put), and
        over the broadcast also send it -- the receivers take it in while they generate."""
        own = self.times(device, setup).pack() + self.overheads.publish_s
        return own + self.wire() if self.broadcasts() else own

    def sync_fetch(self, device: str) -> float:
        """A rollout worker taking a newer version before its unit: over the object store transfer
        + verified load; over the broadcast (received already) the staged version's load + check."""
        if self.broadcasts():
            return self.overheads.fetch_s + self.times(device).load_staged()
        return self.overheads.fetch_s + self.wire() + self.times(device).load()

    def transfer(self, groups: int) -> float:
        """A rollout unit's samples reaching a trainer."""
        b = groups * self.workload.group_size * self.workload.sample_bytes
        return self.overheads.transfer_latency_s + b / self.network_bw()

    def switch(self, device: str, setup: DeviceSetup) -> float:
        """A colocated device changing phase (paid twice per iteration): latency, re-gathering sharded
        weights before sampling (half each way). Nothing is offloaded (the runtime does not offload)."""
        s = self.colocation.switch_latency_s
        if setup.shard > 1 and self.colocation.regather_sharded_weights:
            s += (
                self.workload.params.total
                * self.workload.dtype_bytes
                * (setup.shard - 1)
                / setup.shard
                / self.link_bw(device, setup.shard)
                / 2
            )
        return s

    # -- memory --------------------------------------------------------------------------

    @property
    def memory(self) -> MemoryModel:
        return MemoryModel(self.workload, self.params, self.colocation)

    def have(self, device: str) -> float:
        return self.memory.have(device)

    def rollout_memory(self, device: str, groups: int, sp: int = 1) -> DeviceSetup:
        """Does a rollout worker of this type (``sp`` devices) hold the model + rollout models + a unit of
        ``groups``, forwarding at its own batch (``Workload.rollout_batch``; ``engine.rollout_batch: auto``:
        the largest that fits, the setup's ``rollout_batch``)?"""
        w, memory = self.workload, self.memory
        batch = w.rollout_batch
        if batch is None and w.rollout_batch_auto and DEVICES[device].kind == "gpu":  # (as the runtime:
            batch = memory.rollout_batch(device, groups, sp)  # auto on CPU is the trainer's batches)
        return memory.rollout(device, groups, sp, batch=batch)

    def trainer_setup(
        self, device: str, ranks: int, tag: bool, groups: int, micro_batch: int | None = None, sp: int = 1
    ) -> DeviceSetup:
        """The cheapest way a trainer rank of this type fits (``tag``: it also rolls out units of
        ``groups``)."""
        fits, miss = self.memory.trainer(device, ranks, tag, groups, sp)
        if not fits:
            return miss
        best = self._best(fits, device, ranks, False, micro_batch)
        return replace(best, rollout_batch=self.sampling_batch(device, groups)) if tag else best

    def colocated_setup(
        self, device: str, ranks: int, groups: int, micro_batch: int | None = None, sp: int = 1
    ) -> DeviceSetup:
        """A colocated device: training state and sampling state at once."""
        fits, miss = self.memory.colocated(device, ranks, groups, sp)
        if not fits:
            return miss
        best = self._best(fits, device, ranks, True, micro_batch)
        return replace(best, rollout_batch=self.sampling_batch(device, groups))

    def sampling_batch(self, device: str, groups: float) -> int | None:
        """Samples per sampling forward of a worker that also trains (``engine.colocated_batch``, as
        ``placement.resolve`` resolves it): N, or ``auto`` on a GPU the whole unit of ``groups`` -- its
        activations are what the memory model already holds there (``MemoryModel.trainer_need``); None:
        the train forwards' batches. Each forward's efficiency follows its tokens (efficiency.py)."""
        w = self.workload
        if w.colocated_batch is not None:
            return w.colocated_batch
        if w.colocated_batch_auto and DEVICES[device].kind == "gpu":
            return max(1, round(groups * w.group_size))
        return None

    def _score(self, device: str, setup: DeviceSetup, ranks: int, colocated: bool) -> float:
        """Seconds a device of this setup spends per iteration on its share of the training
        (+ its phase switches): how the fitting setups are ranked."""
        w = self.workload
        t = self.times(device, setup)
        mb = setup.micro_batch
        per_sample = (t.train_step(mb) + (t.ref_forward(mb) if w.kl_on_trainer else 0.0)) / mb
        score = w.samples * w.trained_steps / max(1, ranks) * per_sample
        if colocated:
            score += 2 * self.switch(device, setup)
        return score

    def _best(
        self,
        fits: list[DeviceSetup],
        device: str,
        ranks: int,
        colocated: bool,
        micro_batch: int | None = None,
    ) -> DeviceSetup:
        """The cheapest fitting setup; with ``micro_batch`` (a run's configured one) only the largest
        micro-batch up to it that fits competes: the run trains at its micro-batch, smaller only when
        memory forces it (the search leaves it free and writes the one it picks into the config)."""
        if micro_batch is not None:
            fits = [s for s in fits if s.micro_batch <= micro_batch] or fits
            top = max(s.micro_batch for s in fits)
            fits = [s for s in fits if s.micro_batch == top]
        return min(fits, key=lambda s: (self._score(device, s, ranks, colocated), s.shard))

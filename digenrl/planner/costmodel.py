"""What each unit of work costs on each device type (DESIGN.md §5, ALGORITHMS.md "Cost shape").

Durations are composed from per-call times, the same way the units run them:

- rollout unit of ``m`` groups (``b = m x G`` samples, generated as ONE batch):
  ``encode(m prompts) + N x step(b) + decode(b) + reward(b) + overhead``, where ``step`` is one
  ``velocity`` call with the model's guidance (two passes for two-pass CFG);
- train unit (the unit's samples x its share of the trained steps, ``T_r = |{j < T : j mod D = r}|``
  for TSP rank r of degree D): for every trained-step position and micro-batch one forward +
  backward of ``recompute_logprob`` (+ a no-grad reference forward when ``kl_beta > 0``);
  DanceGRPO's random steps split a micro-batch into one forward per distinct step;
- step: all-reduce of the trained parameters' fp32 gradients + the AdamW update (+ on trainer
  rank 0 of a disaggregated run the weight publish: ``Policy.weights()`` + checksum);
- weight sync (a rollout worker that changes version): bytes / bandwidth + latency + the verified
  load (two checksums, as ``engine.weight_sync.load`` does).

Per-call times come from a profile (``digenrl profile``: medians vs batch size, interpolated
piecewise-linearly in the batch, extrapolated along the last segment) when the profile was measured
on the same device type, else from the analytic model: FLOPs from the transformer config and the
token count (:mod:`digenrl.planner.shapes`) over ``peak bf16 FLOP/s x MFU``, bounded below by
reading the weights once per pass at ``memory bandwidth x efficiency``. A GPU profile of another
type calibrates the MFU. Every assumption is a named field of :class:`CostParams`,
:class:`ColocationCosts` or :class:`EngineOverheads`.

Memory (:meth:`CostModel.rollout_memory`, :meth:`CostModel.trainer_setup`,
:meth:`CostModel.colocated_setup`): weights, LoRA / optimizer states (AdamW: fp32 weight, grad and
two moments per trained parameter), activations per training sample (with activation
checkpointing or FSDP sharding when needed, and at the time they cost), the rollout side's text
encoder / VAE / reward model. A placement that does not fit is rejected with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from digenrl.errors import UserError
from digenrl.planner.gpus import DEVICES, ClusterSpec, DeviceSpec
from digenrl.planner.shapes import ModelShape, ParamCounts, attention_fraction, forward_flops, model_shape, param_counts

MIN_UNIT_CV = 0.02  # unit-time spreads below this are simulated as none (see CostModel.unit_cv)
WEIGHT_FREE_REWARDS = {"prompt_color", "jpeg_compressibility", "jpeg_incompressibility"}


# ----------------------------------------------------------------------------- parameters


@dataclass
class CostParams:
    """Analytic-model parameters. Defaults are typical values for bf16 DiT training with FlashAttention
    on Hopper/Ampere GPUs; a GPU profile replaces ``mfu_rollout`` / ``mfu_train`` by measured ones."""

    mfu_rollout: float = 0.40  # share of peak bf16 FLOP/s a sampling forward reaches
    mfu_train: float = 0.35  # ... a training forward + backward (smaller kernels, LoRA branches)
    mfu_source: str = "default"
    vae_mfu: float = 0.25  # VAE decoder convolutions
    mem_bw_efficiency: float = 0.70  # share of peak memory bandwidth a weight-streaming pass reaches
    forward_overhead_s: float = 0.002  # per transformer call: kernel launches, Python
    unit_overhead_s: float = 0.010  # per unit: batching, noise, sigmas, host<->device copies
    checksum_bytes_per_s: float = 1.5e9  # sha256 of shipped weights (one CPU core)
    weight_free_reward_s: float = 0.002  # per image (per frame for video): JPEG size, prompt colour, on CPU
    model_reward_s: float = 0.010  # per image (per frame): a CLIP-H class reward model on the device
    model_reward_params: float = 1.0e9  # its weights on the rollout device (bf16)
    # memory
    usable_memory: float = 0.90  # share of device memory the run may use (CUDA context, fragmentation)
    train_act_bytes: float = 34.0  # activation bytes per token x hidden per block in training (bf16, flash attn)
    ckpt_act_bytes: float = 2.0  # ... per block with activation checkpointing (the block input), + one block
    infer_act_bytes: float = 24.0  # peak live bytes per token x hidden in one block at inference
    vae_decode_bytes_per_px: float = 1000.0  # VAE decoder peak per output pixel (one sample at a time)
    vae_tile_px: float = 4.0e6  # tiled decoding caps the pixels decoded at once
    trained_state_bytes: float = 16.0  # per trained parameter: fp32 weight/master + grad + AdamW m, v
    gradient_checkpointing: str = "auto"  # "auto" (only when activations do not fit), "on", "off"
    allow_fsdp: bool = True  # shard weights / optimizer state over the trainer ranks when they do not fit
    fsdp_overlap: float = 0.7  # share of FSDP all-gather / reduce-scatter time hidden behind compute
    # cpu clusters: "measured" = the profile's cpu_slowdown (what n concurrent workers got of this host:
    # shared caches / memory bandwidth, and on a shared host what other processes left at profiling
    # time), "cores" when the profile has none; "cores" = processor sharing of the host's cores
    cpu_sharing: str = "measured"
    # cpu clusters, "cores" sharing: runnable threads of other processes (other users of the host) our
    # workers share the cores with; None = what the profile measured beside its times (``other_runnable``)
    cpu_other_load: float | None = None
    # cpu clusters: scale units by the engine calibration run's ``unit_time_factor`` (a unit in an
    # engine worker / the profile's round-robin whole unit: median 1.12 over 36 profiles on the 2-core host)
    engine_unit_factor: bool = True
    # spread of a unit's duration (coefficient of variation, std / mean); None = the profile's measured
    # ``unit_cv`` on the device it profiled, else 0. With a spread the simulator draws every rollout /
    # train unit from a lognormal of that mean and spread and averages ``replicas`` seeded runs: ranks
    # that meet at a barrier (colocated phases, the all-reduce) wait for the slowest, the expected
    # maximum of their unit times, not the mean (a fixed-duration simulation misses that wait)
    unit_cv: float | None = None
    replicas: int = 8


@dataclass
class ColocationCosts:
    """What a colocated device pays to switch between sampling and training, twice per iteration."""

    switch_latency_s: float = 0.5  # per switch: cache flush, mode change, process-group barrier (0 on CPU)
    offload: str = "auto"  # move the other phase's state to the host: "auto" (only when both do not fit), "always", "never"
    regather_sharded_weights: bool = True  # FSDP-sharded weights are all-gathered before sampling


@dataclass
class EngineOverheads:
    """Costs of the engine itself (Ray): measured by `digenrl profile` on CPU, defaults for GPU clusters."""

    call_s: float = 0.003  # driver -> worker -> driver per unit (a unit starts this long after it is handed out)
    transfer_latency_s: float = 0.002  # rollout samples to a trainer (object store), fixed part
    transfer_bytes_per_s: float | None = None  # None: the cluster interconnect
    publish_s: float = 0.0  # extra (beyond pack) for ray.put of published weights
    fetch_s: float = 0.0  # extra (beyond load) for ray.get of weights
    allreduce_latency_s: float = 0.0005  # per all-reduce call
    source: str = "default"


# ------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """The run's per-iteration work, from a RunConfig."""

    family: str
    shape: ModelShape
    params: ParamCounts
    steps: int  # N denoising steps per rollout
    trained_steps: int  # T trained-step positions per sample
    timestep_mode: str
    group_size: int
    prompts: int  # per iteration
    passes: int  # transformer passes per step (2 with two-pass CFG)
    kl: bool
    lora: bool
    micro_batch: int
    dtype_bytes: int
    reward_kind: str  # "weight_free" | "model"
    video_frames: int

    @classmethod
    def from_config(cls, cfg) -> Workload:
        import torch

        from digenrl.adapters import adapter_class
        from digenrl.algorithms.grpo import select_timesteps

        adapter = adapter_class(cfg.model.adapter)
        shape = model_shape(cfg.model)
        params = param_counts(shape, cfg.model.lora, adapter.default_lora_targets)
        ts, n = cfg.algorithm.timesteps, cfg.sampling.steps
        _, idx = select_timesteps(ts.mode, n, 1, torch.Generator().manual_seed(0), fraction=ts.fraction,
                                  window=ts.window, shift_every=ts.window_shift_every)
        names = {c.name for c in cfg.reward.components}
        return cls(
            family=cfg.model.adapter, shape=shape, params=params, steps=n, trained_steps=idx.shape[1],
            timestep_mode=ts.mode, group_size=cfg.algorithm.group_size,
            prompts=cfg.train.prompts_per_iteration, passes=adapter.guidance_passes(cfg.sampling.guidance),
            kl=cfg.algorithm.kl_beta > 0, lora=cfg.model.lora is not None, micro_batch=cfg.train.micro_batch,
            dtype_bytes=2 if cfg.model.dtype in ("bfloat16", "float16") else 4,
            reward_kind="weight_free" if names <= WEIGHT_FREE_REWARDS else "model",
            video_frames=cfg.model.frames or 1,
        )

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size

    @property
    def trained_params(self) -> int:
        return self.params.lora if self.lora else self.params.total

    @property
    def sync_bytes(self) -> int:
        """What a weight sync ships: LoRA tensors in fp32, or every weight in the model dtype."""
        return self.params.lora * 4 if self.lora else self.params.total * self.dtype_bytes

    @property
    def sample_bytes(self) -> int:
        """One rolled-out sample as it travels to a trainer: the latent trajectory (fp32), behaviour
        log-probs, and its prompt conditioning."""
        t = self.shape.tokens
        cond_dim = self.params.hidden  # order of the text embedding width
        return (self.steps + 1) * t.latent_elements * 4 + self.steps * 4 + self.passes * t.text * cond_dim * 2

    def positions(self, rank: int, degree: int) -> int:
        return len(range(rank, self.trained_steps, degree))

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("shape")
        d["params"] = asdict(self.params)
        d["tokens"] = asdict(self.shape.tokens)
        d["shape_source"] = self.shape.source
        d["forward_tflops_per_sample"] = forward_flops(self.shape) / 1e12
        return d


# ----------------------------------------------------------------------------- call times


def interpolate(table: dict[int, float], b: float) -> float:
    """Piecewise-linear in the batch size; beyond the table, along its last (or first) segment."""
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]] * b / xs[0]
    if b <= xs[0]:
        x0, x1 = xs[0], xs[1]
    elif b >= xs[-1]:
        x0, x1 = xs[-2], xs[-1]
    else:
        i = next(i for i, x in enumerate(xs) if x >= b)
        x0, x1 = xs[i - 1], xs[i]
    y0, y1 = table[x0], table[x1]
    y = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
    if b < xs[0]:  # below the table: a smaller batch costs no more than the smallest measured one, and
        # no less per sample (a noisy first segment extrapolated to b -> 0 would make small batches free)
        return min(table[xs[0]], max(y, table[xs[0]] * b / xs[0]))
    return max(y, min(y0, y1) * 0.5)


class CallTimes:
    """Seconds per call on one device type. ``b`` = batch size (may be fractional in expectations)."""

    source = ""

    def rollout_step(self, b: float) -> float: ...  # one velocity call, all guidance passes, no grad
    def train_step(self, b: float) -> float: ...  # forward + backward of recompute_logprob
    def ref_forward(self, b: float) -> float: ...  # the KL reference forward (no grad)
    def decode(self, b: float) -> float: ...
    def reward(self, b: float) -> float: ...
    def encode(self, prompts: int) -> float: ...
    def optimizer(self) -> float: ...
    def pack(self) -> float: ...  # Policy.weights() + checksum
    def load(self) -> float: ...  # verified load of shipped weights
    rollout_overhead_s = 0.0  # per unit, beyond its calls (analytic model; profiles of version 1 before factors)
    train_overhead_s = 0.0
    rollout_unit_factor = 1.0  # a whole unit / the sum of its calls, as profiled (CPU engine: SDE / loss math)
    train_unit_factor = 1.0


class ProfiledTimes(CallTimes):
    """From a profile.json measured on this device type."""

    def __init__(self, profile: dict):
        self.p = profile
        self.source = f"profile ({profile['device']['name']})"
        m = profile["measurements"]
        self._roll = {int(k): v for k, v in m["rollout_step_s"].items()}
        self._train = {int(k): v for k, v in m["train_step_s"].items()}
        self._ref = {int(k): v for k, v in m.get("ref_forward_s", m["rollout_step_s"]).items()}
        u = m.get("unit_overhead") or {}
        if "rollout_factor" in u:  # whole units measured at the run's unit size: scale by the ratio
            self.rollout_unit_factor, self.train_unit_factor = u["rollout_factor"], u["train_factor"]
        else:  # older profiles: the difference in seconds, measured on a unit of one group
            self.rollout_overhead_s, self.train_overhead_s = u.get("rollout_s", 0.0), u.get("train_s", 0.0)

    def rollout_step(self, b):
        return interpolate(self._roll, b)

    def train_step(self, b):
        return interpolate(self._train, b)

    def ref_forward(self, b):
        return interpolate(self._ref, b)

    def decode(self, b):
        return b * self.p["measurements"]["decode_s_per_sample"]

    def reward(self, b):
        return b * self.p["measurements"]["reward_s_per_sample"]

    def encode(self, prompts):
        return prompts * self.p["measurements"]["encode_s_per_prompt"]

    def optimizer(self):
        return self.p["measurements"]["optimizer_step_s"]

    def pack(self):
        return self.p["measurements"]["weight_sync"]["pack_s"]

    def load(self):
        return self.p["measurements"]["weight_sync"]["load_s"]


class AnalyticTimes(CallTimes):
    """FLOPs / (peak x MFU), bounded below by streaming the weights once per pass."""

    def __init__(self, w: Workload, dev: DeviceSpec, p: CostParams, checkpointing: bool = False, shard: int = 1,
                 link_bw: float | None = None):
        self.w, self.dev, self.p = w, dev, p
        self.checkpointing, self.shard = checkpointing, shard
        self.source = f"analytic ({dev.name}, MFU {p.mfu_rollout:.2f}/{p.mfu_train:.2f} {p.mfu_source})"
        self.flops = forward_flops(w.shape)  # one pass, one sample
        self.weight_bytes = w.params.total * w.dtype_bytes
        self.rollout_overhead_s = self.train_overhead_s = p.unit_overhead_s
        # FSDP: every pass all-gathers the weights (and the backward reduce-scatters full-FT gradients)
        self.fsdp_s = 0.0
        if shard > 1:
            moved = self.weight_bytes * (shard - 1) / shard / (link_bw or dev.link_bw)
            self.fsdp_s = (1 - p.fsdp_overlap) * moved

    def _pass(self, b: float, mfu: float, flop_factor: float, weight_reads: float) -> float:
        compute = b * self.flops * flop_factor / (self.dev.bf16_flops * mfu)
        stream = weight_reads * self.weight_bytes / (self.dev.mem_bw * self.p.mem_bw_efficiency)
        return max(compute, stream) + self.p.forward_overhead_s

    def rollout_step(self, b):
        return self.w.passes * (self._pass(b, self.p.mfu_rollout, 1.0, 1.0) + self.fsdp_s)

    def train_step(self, b):
        a = attention_fraction(self.w.shape)
        backward = 2.0 if not self.w.lora else 1.0 + a  # LoRA: no weight gradients for the frozen base
        factor = 1.0 + backward + (1.0 if self.checkpointing else 0.0)
        reads = 2.0 + (1.0 if self.checkpointing else 0.0)
        fsdp = self.fsdp_s * (3 if not self.w.lora else 2)
        return self.w.passes * (self._pass(b, self.p.mfu_train, factor, reads) + fsdp)

    def ref_forward(self, b):
        return self.w.passes * (self._pass(b, self.p.mfu_train, 1.0, 1.0) + self.fsdp_s)

    def decode(self, b):
        t = self.w.shape.tokens
        return b * t.pixels * self.w.shape.vae_decode_flops_per_px / (self.dev.bf16_flops * self.p.vae_mfu)

    def reward(self, b):
        per = self.p.weight_free_reward_s if self.w.reward_kind == "weight_free" else self.p.model_reward_s
        return b * per * self.w.video_frames

    def encode(self, prompts):
        te = self.w.shape.text_encoder_params
        if not te:
            return 0.0
        flops = 2 * te * self.w.shape.tokens.text
        return prompts * (flops / (self.dev.bf16_flops * self.p.mfu_rollout) + self.p.forward_overhead_s)

    def optimizer(self):
        n = self.w.trained_params / (self.shard if not self.w.lora else 1)
        return 3 * n * self.p.trained_state_bytes / (self.dev.mem_bw * self.p.mem_bw_efficiency) + 0.001

    def pack(self):
        b = self.w.sync_bytes
        return b / self.dev.host_bw + b / self.p.checksum_bytes_per_s

    def load(self):
        b = self.w.sync_bytes
        return b / self.dev.host_bw + 2 * b / self.p.checksum_bytes_per_s


def rollout_unit_time(t: CallTimes, w: Workload, groups: int) -> tuple[float, float]:
    """(seconds, of which reward): encode the prompts, N steps at batch b = groups x G, decode, score."""
    b = groups * w.group_size
    reward = t.reward(b)
    calls = t.encode(groups) + w.steps * t.rollout_step(b) + t.decode(b) + reward
    return max(0.5 * calls, calls * t.rollout_unit_factor + t.rollout_overhead_s), reward


def train_unit_time(t: CallTimes, w: Workload, groups: int, tsp_rank: int, tsp_degree: int, micro_batch: int) -> float:
    """The unit's trained-step positions x micro-batches, each one forward + backward (+ reference)."""
    b = groups * w.group_size
    sizes = [micro_batch] * (b // micro_batch) + ([b % micro_batch] if b % micro_batch else [])
    per_position = 0.0
    for size in sizes:
        if w.timestep_mode == "random":  # samples at the same step share a forward: one per distinct step
            choices = max(1, w.steps - 1)
            k = choices * (1 - (1 - 1 / choices) ** size)
            per_position += k * (t.train_step(size / k) + (t.ref_forward(size / k) if w.kl else 0.0))
        else:
            per_position += t.train_step(size) + (t.ref_forward(size) if w.kl else 0.0)
    calls = w.positions(tsp_rank, tsp_degree) * per_position
    return max(0.5 * calls, calls * t.train_unit_factor + t.train_overhead_s)


# ---------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class DeviceSetup:
    """How a trainer (or colocated) device runs training: the decisions memory forces."""

    fits: bool
    micro_batch: int
    checkpointing: bool = False
    shard: int = 1  # FSDP degree over the trainer ranks
    offload: bool = False  # colocated: the other phase's state moves to the host
    need_bytes: float = 0.0
    have_bytes: float = 0.0
    parts: dict = field(default_factory=dict, compare=False)
    why: str = ""

    def notes(self) -> list[str]:
        out = []
        if self.checkpointing:
            out.append("act. ckpt")
        if self.shard > 1:
            out.append(f"FSDP x{self.shard}")
        if self.offload:
            out.append("offload")
        return out


GiB = 2**30


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


# ------------------------------------------------------------------------------- the model


class CostModel:
    """Durations and memory of every unit on every device type of a cluster."""

    def __init__(self, workload: Workload, cluster: ClusterSpec, params: CostParams | None = None,
                 colocation: ColocationCosts | None = None, overheads: EngineOverheads | None = None,
                 profile: dict | None = None):
        self.w, self.cluster = workload, cluster
        self.p = params or CostParams()
        self.col = colocation or ColocationCosts()
        self.profile = profile
        self.ov = overheads or EngineOverheads()
        self.unit_factor: dict[str, float] = {}  # CPU engine: units run this much slower in a worker
        if profile is not None:
            check_profile_matches(profile, workload)
            self._calibrate(profile)
        if cluster.is_cpu:
            self.col = ColocationCosts(**{**asdict(self.col), "switch_latency_s": 0.0})
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
        if self.p.cpu_sharing == "measured" and table and self.profiled("cpu"):
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
        if self.p.unit_cv is not None:
            cv = self.p.unit_cv
        elif not self.profiled(device):
            cv = 0.0
        else:
            prof = self.profile or {}
            measured = (prof.get("engine") or {}).get("unit_cv") or prof.get("measurements", {}).get("unit_cv") or {}
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
        if self.p.cpu_other_load is not None:
            return self.p.cpu_other_load
        return self.profiled_load()

    # -- calibration ---------------------------------------------------------------------

    def _calibrate(self, profile: dict) -> None:
        """A profile measured on a known GPU type sets the MFU for the types not profiled; a CPU
        profile's Ray measurements set the engine overheads of CPU clusters."""
        dev = profile["device"]
        if dev.get("table_key") in DEVICES and dev["kind"] == "gpu":
            spec = DEVICES[dev["table_key"]]
            m = profile["measurements"]
            flops = forward_flops(self.w.shape) * self.w.passes
            big = [b for b in map(int, m["rollout_step_s"]) if b >= 4] or list(map(int, m["rollout_step_s"]))
            roll = sorted(b * flops / (m["rollout_step_s"][str(b)] * spec.bf16_flops) for b in big)
            a = attention_fraction(self.w.shape)
            factor = 3.0 if not self.w.lora else 2.0 + a
            train = sorted(b * flops * factor / (m["train_step_s"][str(b)] * spec.bf16_flops) for b in big)
            self.p.mfu_rollout = min(0.9, roll[len(roll) // 2])
            self.p.mfu_train = min(0.9, train[len(train) // 2])
            self.p.mfu_source = f"calibrated on {dev['name']}"
        engine = profile.get("engine")
        if engine and self.cluster.is_cpu:
            self.ov = EngineOverheads(
                call_s=engine["call_s"], transfer_latency_s=engine["transfer_latency_s"],
                transfer_bytes_per_s=engine["transfer_bytes_per_s"], publish_s=engine["put_s"],
                fetch_s=engine["get_s"], allreduce_latency_s=engine.get("allreduce_s", 0.0),
                source=f"profile ({engine.get('source', profile['device']['name'])})")
            if self.p.engine_unit_factor:
                self.unit_factor = dict(engine.get("unit_time_factor") or {})

    def profiled(self, device: str) -> bool:
        if self.profile is None:
            return False
        dev = self.profile["device"]
        return (dev["kind"] == "cpu" and device == "cpu") or dev.get("table_key") == device

    def times(self, device: str, setup: DeviceSetup | None = None) -> CallTimes:
        key = (device, setup.checkpointing if setup else False, setup.shard if setup else 1)
        if key not in self._times:
            if self.profiled(device):
                self._times[key] = ProfiledTimes(self.profile)
            else:
                self._times[key] = AnalyticTimes(self.w, DEVICES[device], self.p, checkpointing=key[1], shard=key[2],
                                                 link_bw=self.link_bw(device, key[2]))
        return self._times[key]

    # -- bandwidths ----------------------------------------------------------------------

    def link_bw(self, device: str, ranks: int) -> float:
        """Per-device bandwidth of a collective over ``ranks`` devices of one type."""
        spec = DEVICES[device]
        if ranks <= self.cluster.gpus_per_node:
            return spec.link_bw
        return min(spec.link_bw, self.cluster.interconnect.bandwidth_gb_s * 1e9)

    def network_bw(self) -> float:
        if self.ov.transfer_bytes_per_s:
            return self.ov.transfer_bytes_per_s
        return self.cluster.interconnect.bandwidth_gb_s * 1e9

    # -- unit durations ------------------------------------------------------------------

    def _factor(self, device: str, kind: str) -> float:
        return self.unit_factor.get(kind, 1.0) if self.profiled(device) and self.cluster.is_cpu else 1.0

    def rollout_unit(self, device: str, groups: int) -> tuple[float, float]:
        """(seconds, of which reward) for a rollout unit of ``groups`` prompt groups."""
        total, reward = rollout_unit_time(self.times(device), self.w, groups)
        f = self._factor(device, "rollout")
        return total * f, reward * f

    def train_unit(self, device: str, groups: int, tsp_rank: int, tsp_degree: int,
                   setup: DeviceSetup | None = None) -> float:
        mb = setup.micro_batch if setup else self.w.micro_batch
        t = train_unit_time(self.times(device, setup), self.w, groups, tsp_rank, tsp_degree, mb)
        return t * self._factor(device, "train")

    def step(self, device: str, ranks: int, publish: bool, setup: DeviceSetup | None = None) -> tuple[float, float]:
        """(seconds, of which publish) for one rank's share of the optimizer step."""
        t = self.times(device, setup)
        allreduce = 0.0
        if ranks > 1:
            grad_bytes = self.w.trained_params * 4
            if self.profiled(device) and self.cluster.is_cpu:
                bw = self.network_bw()
            else:
                bw = self.link_bw(device, ranks)
            allreduce = 2 * (ranks - 1) / ranks * grad_bytes / bw + self.ov.allreduce_latency_s
            if setup is not None and setup.shard > 1 and not self.w.lora:
                allreduce *= 0.5  # FSDP: the reduce-scatter already ran in the backward; all-gather only
        publish_s = t.pack() + self.ov.publish_s if publish else 0.0
        agree = t.pack() if self.w.lora else 0.0  # every rank checksums its LoRA weights (ranks must agree)
        return allreduce + t.optimizer() + publish_s + agree, publish_s

    def sync_fetch(self, device: str) -> float:
        """A rollout worker loading a newer version: transfer + verified load."""
        b = self.w.sync_bytes
        return (self.ov.fetch_s + self.cluster.interconnect.latency_us * 1e-6 + b / self.network_bw()
                + self.times(device).load())

    def transfer(self, groups: int) -> float:
        """A rollout unit's samples reaching a trainer."""
        b = groups * self.w.group_size * self.w.sample_bytes
        return self.ov.transfer_latency_s + b / self.network_bw()

    def switch(self, device: str, setup: DeviceSetup) -> float:
        """A colocated device changing phase (paid twice per iteration): latency, offload/reload of
        the other phase's state over PCIe, re-gathering sharded weights before sampling (half each way)."""
        spec = DEVICES[device]
        s = self.col.switch_latency_s
        if setup.offload:
            moved = setup.parts.get("trained state", 0) + setup.parts.get("rollout models", 0)
            s += 2 * moved / spec.host_bw / 2  # out and back in, split over the two switches
        if setup.shard > 1 and self.col.regather_sharded_weights:
            s += self.w.params.total * self.w.dtype_bytes * (setup.shard - 1) / setup.shard / self.link_bw(
                device, setup.shard) / 2
        return s

    # -- memory --------------------------------------------------------------------------

    def _rollout_models(self) -> float:
        sh = self.w.shape
        reward = self.p.model_reward_params if self.w.reward_kind == "model" else 0.0
        return 2 * (sh.text_encoder_params + sh.vae_params + reward)

    def _rollout_acts(self, groups: int) -> float:
        w, t = self.w, self.w.shape.tokens
        b = groups * w.group_size
        acts = b * (t.x + t.text) * w.params.hidden * self.p.infer_act_bytes
        trajectory = b * ((w.steps + 1) * t.latent_elements * 4 + w.passes * t.text * w.params.hidden * 2)
        decode = min(t.pixels, self.p.vae_tile_px) * self.p.vae_decode_bytes_per_px if w.shape.vae_params else 0.0
        return acts + trajectory + decode

    def _train_acts(self, mb: int, checkpointing: bool) -> float:
        w, t = self.w, self.w.shape.tokens
        per_block = (t.x + t.text) * w.params.hidden
        if checkpointing:
            per = per_block * (self.p.ckpt_act_bytes * w.params.blocks + self.p.train_act_bytes)
        else:
            per = per_block * self.p.train_act_bytes * w.params.blocks
        return w.passes * mb * per

    def have(self, device: str) -> float:
        return DEVICES[device].memory * self.p.usable_memory

    def rollout_memory(self, device: str, groups: int) -> DeviceSetup:
        """Does a rollout worker of this type hold the model + rollout models + a unit of ``groups``?"""
        w = self.w
        parts = {"weights": w.params.total * w.dtype_bytes, "lora": w.params.lora * 4 if w.lora else 0,
                 "rollout models": self._rollout_models(), "activations": self._rollout_acts(groups)}
        need, have = sum(parts.values()), self.have(device)
        why = "" if need <= have else (f"a rollout unit of {groups} groups on {device} needs {_gib(need)} "
                                       f"({_parts(parts)}) > {_gib(have)} usable")
        return DeviceSetup(need <= have, w.micro_batch, need_bytes=need, have_bytes=have, parts=parts, why=why)

    def _train_parts(self, shard: int, mb: int, ckpt: bool) -> dict:
        w = self.w
        weights = w.params.total * w.dtype_bytes
        state = w.trained_params * self.p.trained_state_bytes
        return {
            "weights": weights / shard,
            "trained state": state if w.lora else state / shard,
            "reference": weights / shard if (w.kl and not w.lora) else 0.0,
            "activations": self._train_acts(mb, ckpt),
        }

    def _options(self, ranks: int):
        """(micro-batch, checkpointing, shard) in order of preference: cheapest first."""
        p = self.p
        ckpts = {"auto": (False, True), "on": (True,), "off": (False,)}[p.gradient_checkpointing]
        shards = [1] + ([s for s in (2, 4, 8, 16, 32, 64) if s <= ranks] + ([ranks] if ranks > 1 else [])
                        if p.allow_fsdp else [])
        mbs, mb = [], self.w.micro_batch
        while mb >= 1:
            mbs.append(mb)
            mb //= 2
        for mb in mbs:
            for shard in dict.fromkeys(shards):
                for ckpt in ckpts:
                    yield mb, ckpt, shard

    def _score(self, device: str, setup: DeviceSetup, ranks: int, colocated: bool) -> float:
        """Seconds a device of this setup spends per iteration on its share of the training
        (+ its phase switches): how the fitting setups are ranked."""
        w = self.w
        t = self.times(device, setup)
        mb = setup.micro_batch
        per_sample = (t.train_step(mb) + (t.ref_forward(mb) if w.kl else 0.0)) / mb
        score = w.samples * w.trained_steps / max(1, ranks) * per_sample
        if colocated:
            score += 2 * self.switch(device, setup)
        return score

    def _best(self, fits: list[DeviceSetup], device: str, ranks: int, colocated: bool,
              micro_batch: int | None = None) -> DeviceSetup:
        """The cheapest fitting setup; with ``micro_batch`` (a run's configured one) only the largest
        micro-batch up to it that fits competes: the run trains at its micro-batch, smaller only when
        memory forces it (the search leaves it free and writes the one it picks into the config)."""
        if micro_batch is not None:
            fits = [s for s in fits if s.micro_batch <= micro_batch] or fits
            top = max(s.micro_batch for s in fits)
            fits = [s for s in fits if s.micro_batch == top]
        return min(fits, key=lambda s: (self._score(device, s, ranks, colocated), s.shard, s.offload))

    def trainer_setup(self, device: str, ranks: int, tag: bool, groups: int,
                      micro_batch: int | None = None) -> DeviceSetup:
        """The cheapest way a trainer rank of this type fits (``tag``: it also rolls out units of ``groups``)."""
        have = self.have(device)
        fits, last = [], None
        for mb, ckpt, shard in self._options(ranks):
            parts = self._train_parts(shard, mb, ckpt)
            if tag:  # TAG: the rank also samples, with gathered weights and the rollout models
                parts["rollout models"] = self._rollout_models()
                parts["rollout activations"] = max(0.0, self._rollout_acts(groups) - parts["activations"])
                if shard > 1:
                    parts["gathered weights"] = parts["weights"] * (shard - 1)
            need = sum(parts.values())
            last = (need, parts, mb, ckpt, shard)
            if need <= have:
                fits.append(DeviceSetup(True, mb, ckpt, shard, False, need, have, parts))
        if fits:
            return self._best(fits, device, ranks, False, micro_batch)
        need, parts, mb, ckpt, shard = last
        return DeviceSetup(False, mb, ckpt, shard, False, need, have, parts,
                           why=f"a trainer on {device} needs {_gib(need)} ({_parts(parts)}) > {_gib(have)} usable "
                               f"even at micro-batch {mb}" + (f", FSDP x{shard}" if shard > 1 else "")
                               + (", activation checkpointing" if ckpt else ""))

    def colocated_setup(self, device: str, ranks: int, groups: int, micro_batch: int | None = None) -> DeviceSetup:
        """A colocated device: training state and sampling state, at once or with offloading between phases."""
        have = self.have(device)
        offloads = {"auto": (False, True), "always": (True,), "never": (False,)}[self.col.offload]
        fits, last = [], None
        for mb, ckpt, shard in self._options(ranks):
            train = self._train_parts(shard, mb, ckpt)
            roll_models = self._rollout_models()
            gathered = train["weights"] * (shard - 1) if shard > 1 else 0.0
            for offload in offloads:
                if offload:  # each phase holds only its own state
                    need_train = sum(train.values())
                    need_roll = train["weights"] + gathered + roll_models + self._rollout_acts(groups) + (
                        self.w.params.lora * 4 if self.w.lora else 0)
                    need = max(need_train, need_roll)
                else:
                    need = sum(train.values()) + roll_models + gathered + max(
                        0.0, self._rollout_acts(groups) - train["activations"])
                parts = dict(train, **{"rollout models": roll_models, "gathered weights": gathered})
                last = (need, parts, mb, ckpt, shard, offload)
                if need <= have:
                    fits.append(DeviceSetup(True, mb, ckpt, shard, offload, need, have, parts))
                    break  # offloading only when it is needed
        if fits:
            return self._best(fits, device, ranks, True, micro_batch)
        need, parts, mb, ckpt, shard, offload = last
        return DeviceSetup(False, mb, ckpt, shard, offload, need, have, parts,
                           why=f"a colocated device {device} needs {_gib(need)} ({_parts(parts)}) > {_gib(have)} "
                               f"usable even with offloading, micro-batch {mb}" + (f", FSDP x{shard}" if shard > 1 else ""))


def _parts(parts: dict) -> str:
    return ", ".join(f"{k} {_gib(v)}" for k, v in parts.items() if v)


def check_profile_matches(profile: dict, w: Workload) -> None:
    """A profile calibrates only the model it measured (class, transformer config, token counts)."""
    sig = profile.get("model", {})
    mine = w.shape.signature()
    theirs = _norm(sig.get("config"))
    same = all(theirs.get(k) == v for k, v in _norm(mine["config"]).items())
    if sig.get("class") != mine["class"] or not same:
        raise UserError(f"--profile: it was measured on {sig.get('class')} ({sig.get('params', '?')} parameters), "
                        f"not on the configured {mine['class']} ({w.shape.source}); run `digenrl profile` "
                        "with this config")
    tokens = profile.get("workload", {}).get("tokens")
    if tokens and (tokens["x"], tokens["text"]) != (w.shape.tokens.x, w.shape.tokens.text):
        raise UserError(f"--profile: measured at {tokens['x']} image/video + {tokens['text']} text tokens per "
                        f"sample, the config has {w.shape.tokens.x} + {w.shape.tokens.text}; profile this "
                        "resolution / frame count / text length")


def _norm(config) -> dict:
    if not isinstance(config, dict):
        return {}
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in config.items()
            if not k.startswith("_")}



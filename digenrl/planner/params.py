"""The cost model's assumptions, each a named field with its default: the analytic model
(:class:`CostParams`), colocated phase switches (:class:`ColocationCosts`) and the engine's own
overheads (:class:`EngineOverheads`). A profile replaces some of them by measured values
(:mod:`digenrl.planner.calibrate`)."""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.adapters.vae_decode import TILE_PX


@dataclass
class CostParams:
    """Analytic-model parameters. The kernel efficiencies are per device type
    (:func:`~digenrl.planner.efficiency.device_efficiency`: ``gpus.KERNEL_EFFICIENCY``, calibrated on
    veRL-Omni's published step for Hopper GPUs) unless set here -- a GPU profile sets them."""

    # peak share of bf16 FLOP/s a sampling forward / a training forward + backward reaches at large
    # token counts; None = the device table's (gpus.KERNEL_EFFICIENCY)
    mfu_rollout: float | None = None
    mfu_train: float | None = None
    mfu_source: str = "default"
    # per device type, a (sampling, training) pair in place of the device table's (a leave-one-out fit's:
    # planner/uncertainty.py); below mfu_rollout / mfu_train, which win everywhere
    device_mfu: dict[str, tuple[float, float]] | None = None
    # tokens per forward at which a call reaches half its peak (efficiency.py): 0 = no falloff, the
    # analytic model's small calls pay their kernels instead (op_launch_s); a profile at several batch
    # sizes fits them for the device it measured
    mfu_half_tokens_rollout: float = 0.0
    mfu_half_tokens_train: float = 0.0
    # The fitted defaults below: planner/cost_fit.json (benchmarks/peer_calibration.py --write-fits),
    # one fit over every published row and DigenRL's H200 rows (docs/scaling.md, "Calibration").
    # a peer's rollout server, per request (one image): agent loop, prompt encoding, decode, transfers
    # beside the forwards (veRL-Omni's vllm-omni server). Not fitted: only one published contrast (the
    # Qwen-Image LoRA rows at max_num_seqs 1 / 32) carries it, and a fit without that script's rows
    # then puts it anywhere (0.58 s: leave-one-out worst 66%, median 19%, against 42% / 15% held here)
    serve_request_s: float = 0.001
    # a single controller's step cost per worker (dispatch, gather of every phase's data): peer models
    dispatch_s_per_worker: float = 1.167
    # a VLM judge's server (vLLM), per request in flight and decode step: scheduling, sampling,
    # detokenizing on the host (planner/judge.py prices the rest from the judge's architecture)
    serve_seq_step_s: float = 1.83e-4
    vae_mfu: float = 0.25  # VAE decoder convolutions
    mem_bw_efficiency: float = 0.70  # share of peak memory bandwidth a weight-streaming pass reaches
    forward_overhead_s: float = 0.002  # per text-encoder call (and a transformer call of an uncounted family)
    # per kernel a transformer call launches (eager: launch + Python + dispatch), x the kernels counted on
    # the real class (op_counts.py); a backward runs ~2x the forward's kernels. Fitted with the
    # efficiencies (fitted; device-independent: host-bound); None = forward_overhead_s per call instead
    op_launch_s: float | None = 1.61e-5
    # memory-bound ops (norms, adaLN, activations, residuals): elements counted per token x hidden
    # (op_counts.py), streamed at mem_bw_efficiency; False = FLOPs and the weight stream only
    op_traffic: bool = True
    unit_overhead_s: float = 0.010  # per unit: batching, noise, sigmas, host<->device copies
    # sha256 of shipped weights (one CPU core): ``policy.lora.checksum`` as the engine runs it, host copy
    # included, measured on an H200 host: 0.92 GB/s on 38 MB of LoRA-sized tensors, 0.58 GB/s on 2.6 GB
    # of full weights (gpu_realwidth.py ``weight_sync``, benchmarks/gpu_runs/2026-12-04-h200); was 1.5e9
    checksum_bytes_per_s: float = 0.92e9
    weight_free_reward_s: float = 0.002  # per image (per frame for video): JPEG size, prompt colour, on CPU
    # per image (per frame): a CLIP-H class reward model on the device (peer_calibration sets veRL-Omni's
    # VLM judge's); a component's ``seconds_per_image`` overrides it. Kept device-independent: PickScore
    # (ViT-H/14, bf16, 512 px in) measured 0.0032 s at 16 images per call and 0.036 s at 1 on an H200
    # (benchmarks/gpu_runs/2026-12-04-h200), mostly not FLOPs; the tables' rollout pools are slower types
    model_reward_s: float = 0.010
    model_reward_params: float = 0.986e9  # its weights on the rollout device (bf16): PickScore's, counted
    # per image (per frame): a remote judge (``remote``), waited for by the scoring worker, its device idle;
    # unmeasured (the CLIP-H figure): set the component's ``seconds_per_image`` to the judge's latency
    remote_reward_s: float = 0.010
    # share of an on-device model reward's time a rollout-only worker hides behind its next unit
    # (EngineWorker.score runs in another thread on the same device -- and on CUDA its default stream, so
    # the two units' kernels run one after another: what hides is the host-side part and the sampler's
    # launch gaps). Measured: PickScore on 16 images beside FLUX-width sampling at batch 4 on an H200,
    # 0.365 of its time hidden (gpu_dedicated.py ``reward_overlap``, benchmarks/gpu_runs/2026-12-04-h200);
    # a remote judge's wait always hides
    model_reward_overlap: float = 0.365
    # memory
    usable_memory: float = 0.90  # share of device memory the run may use (CUDA context, fragmentation)
    train_act_bytes: float = (
        34.0  # activation bytes per token x hidden per block in training (bf16, flash attn)
    )
    infer_act_bytes: float = 24.0  # peak live bytes per token x hidden in one block at inference
    vae_decode_bytes_per_px: float = 1000.0  # VAE decoder peak per output pixel (one sample at a time)
    vae_tile_px: float = TILE_PX  # tiled decoding caps the pixels decoded at once (the runtime's tile)
    trained_state_bytes: float = 16.0  # per trained parameter: fp32 weight/master + grad + AdamW m, v
    fsdp_overlap: float = 0.7  # share of FSDP all-gather / reduce-scatter time hidden behind compute
    host_bw_efficiency: float = 0.8  # share of the PCIe datasheet rate a pinned host <-> device copy reaches
    # cpu clusters: "measured" = the profile's cpu_slowdown (what n concurrent workers got of this host:
    # shared caches / memory bandwidth, and on a shared host what other processes left at profiling
    # time), "cores" when the profile has none; "cores" = processor sharing of the host's cores
    cpu_sharing: str = "measured"
    # cpu clusters, "cores" sharing: runnable threads of other processes (other users of the host) our
    # workers share the cores with; None = what the profile measured beside its times (``other_runnable``)
    cpu_other_load: float | None = None
    # cpu clusters: scale units by the engine calibration run's ``unit_time_factor`` (a unit in an
    # engine worker / the profile's round-robin whole unit)
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
    regather_sharded_weights: bool = True  # FSDP-sharded weights are all-gathered before sampling


@dataclass
class EngineOverheads:
    """Costs of the engine itself (Ray): measured by `digenrl profile` on CPU, defaults for GPU clusters."""

    call_s: float = (
        0.003  # driver -> worker -> driver per unit (a unit starts this long after it is handed out)
    )
    transfer_latency_s: float = 0.002  # rollout samples to a trainer (object store), fixed part
    transfer_bytes_per_s: float | None = None  # None: the cluster interconnect
    publish_s: float = 0.0  # extra (beyond pack) for ray.put of published weights
    fetch_s: float = 0.0  # extra (beyond load) for ray.get of weights
    allreduce_latency_s: float = 0.0005  # per all-reduce call
    source: str = "default"

"""``digenrl profile``: measure what the cost model needs, on this device, for the configured model;
the profile.json format. The measuring itself is in :mod:`digenrl.planner.measure`.

Details: docs/modules.md, `digenrl.planner.profile`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from digenrl.errors import UserError, read_user_text
from digenrl.placement.devices import match_device_name
from digenrl.planner.constants import (
    CALIBRATION_ITERATIONS,
    DEFAULT_BATCHES,
    MAX_PROFILED_UNIT_SAMPLES,
    PROFILE_VERSION,
    SHARING_MIN_SECONDS,
    SHARING_MIN_TIMES,
)
from digenrl.planner.measure.contention import OtherLoad, cpu_slowdown, private_weights
from digenrl.planner.measure.engine_run import engine_run_overheads
from digenrl.planner.measure.model_times import ModelBench
from digenrl.planner.measure.ray_overheads import ray_overheads
from digenrl.planner.measure.timing import torch_threads
from digenrl.policy.model import pick_device

ENGINE_MODES = {"none": 0, "ray": 1, "run": 2}  # --engine -> the extra progress steps it takes


def batch_sizes(cfg, requested: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(rollout, train) batch sizes: the requested ones (default 1..16) plus every batch the
    workload runs: rollout units of m groups (m | prompts, <= 64 samples), the micro-batch."""
    base = sorted(set(requested or DEFAULT_BATCHES))
    G, P, mb = cfg.algorithm.group_size, cfg.train.prompts_per_iteration, cfg.train.micro_batch
    roll = set(base) | {m * G for m in range(1, P + 1) if P % m == 0 and m * G <= MAX_PROFILED_UNIT_SAMPLES}
    train = {b for b in base if b <= max(mb, G)} | {min(mb, G), mb}
    return sorted(roll), sorted(train)


def device_info(device: torch.device, threads: int) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = match_device_name(name)
        return {
            "kind": "gpu",
            "name": name,
            "table_key": key,
            "torch_device": str(device),
            "memory_bytes": torch.cuda.get_device_properties(device).total_memory,
        }
    return {
        "kind": "cpu",
        "name": f"cpu ({platform.machine()}, {os.cpu_count()} cores, {threads} thread(s))",
        "table_key": "cpu",
        "torch_device": "cpu",
        "threads": threads,
        "cores": os.cpu_count(),
    }


def unit_groups(cfg) -> int:
    """The rollout unit size the run uses (``engine.unit_groups``, at most the prompts per iteration)."""
    return max(1, min(cfg.engine.unit_groups, cfg.train.prompts_per_iteration))


def steps_total(
    cfg, engine: str, requested: list[int] | None = None, device: str = "cpu", sharing: int = 3
) -> int:
    """Progress steps of :func:`run_profile`: building the model, one per rollout and train batch,
    calls + units + timing, the CPU sharing probe, the engine's."""
    roll, train = batch_sizes(cfg, requested)
    extra = 1 if device == "cpu" and sharing else 0
    return 1 + len(roll) + len(train) + 3 + extra + ENGINE_MODES[engine]


def run_profile(
    cfg,
    device: str = "cpu",
    *,
    batches: list[int] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    threads: int | None = 1,
    engine: str = "none",
    min_time: float = 0.3,
    sharing: int = 3,
    on_step: Callable[[str], None] | None = None,
    run_engine: Callable | None = None,
) -> dict:
    """Measure ``cfg``'s model on ``device``; returns the profile dict (see the module docstring).
    ``engine="run"`` needs ``run_engine`` (:func:`digenrl.launch.run_engine`, passed in by the caller:
    the planner does not import the layer that starts runs)."""

    if engine not in ENGINE_MODES:
        raise UserError(f"--engine: expected none, ray or run, got '{engine}'")
    dev = pick_device(device)
    step = on_step or (lambda what: None)
    load = OtherLoad()
    with torch_threads(threads if dev.type == "cpu" else None), load:
        step("building the model")
        bench = ModelBench(cfg, dev, warmup)
        roll_b, train_b = batch_sizes(cfg, batches)
        bench.add_rollout_steps(roll_b, step)
        bench.add_train_steps(train_b, step)
        if not bench.clock.has("rollout") or not bench.clock.has("train"):
            raise UserError(f"profile: the model does not fit this device even at batch 1 ({dev})")
        step("decode, reward, prompt encoding, optimizer step, weight sync")
        bench.add_calls()
        groups = unit_groups(cfg)
        step(f"one rollout unit and one train unit ({groups} group(s))")
        bench.add_units(groups)
        step("timing (round robin)")
        m = bench.measure(repeats, min_time)
        if dev.type == "cpu":  # what other processes wanted from / got of the host's cores while we measured
            m["other_runnable"] = load.other_runnable
            m["other_load_cores"] = load.other_cores
        m["sample_bytes"] = bench.sample_bytes()
        m["peak_memory_bytes"] = bench.clock.peaks
        if dev.type == "cpu" and sharing:  # before Ray starts in this process: the probe forks
            step("CPU sharing between concurrent workers")
            m["cpu_slowdown"] = cpu_sharing(bench, groups, sharing, min_time)
    out = profile_document(cfg, bench, dev, threads)
    out["settings"] = {
        "repeats": repeats,
        "warmup": warmup,
        "min_time_s": min_time,
        "skipped_batches_oom": bench.clock.skipped,
    }
    out["measurements"], out["engine"] = m, None
    if engine != "none":
        out["engine"] = engine_overheads(cfg, m, bench.workload, engine, step, run_engine)
    return out


def cpu_sharing(bench, groups: int, workers: int, min_time: float) -> dict[str, float]:
    """``cpu_slowdown`` at a rollout unit's batch, each probe process with its own weights."""

    work = bench.velocity_call(groups * bench.cfg.algorithm.group_size)
    return cpu_slowdown(
        work,
        max_workers=workers,
        seconds=max(SHARING_MIN_SECONDS, SHARING_MIN_TIMES * min_time),
        prepare=lambda: private_weights(bench.policy),
    )


def engine_overheads(cfg, m: dict, workload, engine: str, step, run_engine=None) -> dict:
    """Ray micro-benchmarks, and with ``engine == "run"`` a calibration run of the engine."""

    step("engine: Ray call / transfer / all-reduce")
    out = ray_overheads(
        m["sample_bytes"] * cfg.algorithm.group_size, m["weight_sync"]["bytes"], workload.trained_params
    )
    if engine == "run":
        step(f"engine: an {CALIBRATION_ITERATIONS}-iteration calibration run")
        if run_engine is None:
            raise ValueError("engine='run' needs run_engine (digenrl.launch.run_engine)")
        out.update(engine_run_overheads(cfg, m, run_engine))
    return out


def profile_document(cfg, bench, dev: torch.device, threads: int | None) -> dict:
    """The profile's header: version, device, model signature, the workload it was measured for."""
    w = bench.workload
    return {
        "version": PROFILE_VERSION,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": device_info(dev, threads if dev.type == "cpu" else torch.get_num_threads()),
        "dtype": cfg.model.dtype,
        "torch": torch.__version__,
        "model": bench.ad.model_signature(),
        "workload": {
            "steps": cfg.sampling.steps,
            "trained_steps": w.trained_steps,
            "timestep_mode": w.timestep_mode,
            "group_size": cfg.algorithm.group_size,
            "prompts_per_iteration": cfg.train.prompts_per_iteration,
            "guidance_passes": w.passes,
            "guidance": cfg.sampling.guidance,
            "micro_batch": cfg.train.micro_batch,
            "kl": w.kl,
            "lora": w.lora,
            "trained_params": w.trained_params,
            "tokens": {"x": w.shape.tokens.x, "text": w.shape.tokens.text},
            "height": cfg.model.height,
            "width": cfg.model.width,
            "frames": cfg.model.frames,
        },
    }


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
    if (
        not isinstance(data, dict)
        or any(k not in data for k in needed)
        or data.get("version") != PROFILE_VERSION
    ):
        raise UserError(
            f"--profile: {path} is not a digenrl profile (version {PROFILE_VERSION}); "
            "write one with `digenrl profile`"
        )
    return data

"""Fitting the cost model to a profile: is it a profile of this model, the MFU a GPU profile
implies, the engine overheads a CPU profile measured."""

from __future__ import annotations

from digenrl.errors import UserError
from digenrl.planner.constants import CALIBRATION_MIN_BATCH, MFU_CAP
from digenrl.planner.gpus import DEVICES
from digenrl.planner.params import EngineOverheads
from digenrl.planner.shapes import attention_fraction, forward_flops
from digenrl.planner.workload import Workload


def check_profile_matches(profile: dict, w: Workload) -> None:
    """A profile calibrates only the model it measured (class, transformer config, token counts)."""
    sig = profile.get("model", {})
    mine = w.shape.signature()
    theirs = _norm(sig.get("config"))
    same = all(theirs.get(k) == v for k, v in _norm(mine["config"]).items())
    if sig.get("class") != mine["class"] or not same:
        raise UserError(
            f"--profile: it was measured on {sig.get('class')} ({sig.get('params', '?')} parameters), "
            f"not on the configured {mine['class']} ({w.shape.source}); run `digenrl profile` "
            "with this config"
        )
    tokens = profile.get("workload", {}).get("tokens")
    if tokens and (tokens["x"], tokens["text"]) != (w.shape.tokens.x, w.shape.tokens.text):
        raise UserError(
            f"--profile: measured at {tokens['x']} image/video + {tokens['text']} text tokens per "
            f"sample, the config has {w.shape.tokens.x} + {w.shape.tokens.text}; profile this "
            "resolution / frame count / text length"
        )


def _norm(config) -> dict:
    if not isinstance(config, dict):
        return {}
    return {
        k: (list(v) if isinstance(v, (list, tuple)) else v)
        for k, v in config.items()
        if not k.startswith("_")
    }


def calibrated_mfu(profile: dict, w: Workload) -> tuple[float, float] | None:
    """(rollout, train) MFU a profile of a known GPU type measured: the median over the batches both
    tables measured, of at least ``CALIBRATION_MIN_BATCH`` (all of them when there are none that
    large), of the FLOPs done / the device's peak; None for a CPU profile or a GPU the table does
    not know."""
    dev = profile["device"]
    if dev.get("table_key") not in DEVICES or dev["kind"] != "gpu":
        return None
    spec = DEVICES[dev["table_key"]]
    m = profile["measurements"]
    flops = forward_flops(w.shape) * w.passes
    batches = [b for b in map(int, m["rollout_step_s"]) if str(b) in m["train_step_s"]]
    big = [b for b in batches if b >= CALIBRATION_MIN_BATCH] or batches
    roll = sorted(b * flops / (m["rollout_step_s"][str(b)] * spec.bf16_flops) for b in big)
    factor = (
        3.0 if not w.lora else 2.0 + attention_fraction(w.shape)
    )  # forward + backward (LoRA: no weight grads)
    train = sorted(b * flops * factor / (m["train_step_s"][str(b)] * spec.bf16_flops) for b in big)
    return min(MFU_CAP, roll[len(roll) // 2]), min(MFU_CAP, train[len(train) // 2])


def profiled_overheads(profile: dict) -> EngineOverheads | None:
    """The engine overheads a profile's Ray measurements (and calibration run) give, None without."""
    engine = profile.get("engine")
    if not engine:
        return None
    return EngineOverheads(
        call_s=engine["call_s"],
        transfer_latency_s=engine["transfer_latency_s"],
        transfer_bytes_per_s=engine["transfer_bytes_per_s"],
        publish_s=engine["put_s"],
        fetch_s=engine["get_s"],
        allreduce_latency_s=engine.get("allreduce_s", 0.0),
        source=f"profile ({engine.get('source', profile['device']['name'])})",
    )


def unit_time_factor(profile: dict) -> dict[str, float]:
    """How much slower a unit runs in an engine worker than in the profile, per unit kind (the
    calibration run's ``unit_time_factor``; empty without one)."""
    return dict((profile.get("engine") or {}).get("unit_time_factor") or {})

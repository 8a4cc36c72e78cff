"""Fitting the cost model to a profile: is it a profile of this model, the kernel-efficiency curve a
GPU profile implies, the engine overheads a CPU profile measured."""

from __future__ import annotations

from digenrl.errors import UserError
from digenrl.placement.devices import DEVICES
from digenrl.planner.constants import MFU_CAP
from digenrl.planner.efficiency import fit_curve
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


def calibrated_mfu(profile: dict, w: Workload) -> tuple[float, float, float, float] | None:
    """(rollout peak, rollout half tokens, train peak, train half tokens) of the kernel-efficiency curve
    (:mod:`~digenrl.planner.efficiency`) a profile of a known GPU type measured: at every batch both
    tables measured, the FLOPs done / (time x the device's peak) at that call's token count, fitted by
    :func:`~digenrl.planner.efficiency.fit_curve` (one batch: the default half and the peak it
    implies); None for a CPU profile or a GPU the table does not know."""
    dev = profile["device"]
    if dev.get("table_key") not in DEVICES or dev["kind"] != "gpu":
        return None
    spec = DEVICES[dev["table_key"]]
    m = profile["measurements"]
    flops = forward_flops(w.shape) * w.passes
    per_sample = (w.shape.tokens.x + w.shape.tokens.text) * w.passes  # tokens of one sample's call
    batches = [b for b in map(int, m["rollout_step_s"]) if str(b) in m["train_step_s"]]
    # forward + backward (LoRA: no weight gradients)
    factor = 3.0 if not w.lora else 2.0 + attention_fraction(w.shape)
    roll = {b * per_sample: b * flops / (m["rollout_step_s"][str(b)] * spec.bf16_flops) for b in batches}
    train = {
        b * per_sample: b * flops * factor / (m["train_step_s"][str(b)] * spec.bf16_flops) for b in batches
    }
    return (*fit_curve(roll, MFU_CAP), *fit_curve(train, MFU_CAP))


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

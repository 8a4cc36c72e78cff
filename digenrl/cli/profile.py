"""``digenrl profile``: measure the configured model on this device, write profile.json, show a table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from digenrl.cli.tables import show
from digenrl.config.run import RunConfig


def run_profile_command(
    cfg: RunConfig,
    device: str,
    out: Path,
    console: Console,
    engine: str | None = None,
    repeats: int = 5,
    sharing: int = 3,
) -> dict:
    from digenrl.errors import UserError
    from digenrl.planner.profile import ENGINE_MODES, run_profile, save_profile, steps_total

    if device not in ("cpu", "cuda"):
        raise UserError(f"--device: expected cpu or cuda, got '{device}'")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device: cuda requested but no CUDA device is visible")
    engine = engine or ("ray" if device == "cpu" else "none")
    if engine not in ENGINE_MODES:
        raise UserError(f"--engine: expected none, ray or run, got '{engine}'")
    if repeats < 1:
        raise UserError(f"--repeats: must be at least 1, got {repeats}")
    if sharing < 0 or sharing == 1:
        raise UserError(f"--cpu-sharing: 0 (skip) or at least 2 workers, got {sharing}")
    progress = Progress(
        TextColumn("[bold]profile"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
    )
    from digenrl.cli.liblog import library_output_beside

    with library_output_beside(console, lambda: Path(out).with_suffix(".log")), progress:
        task = progress.add_task("starting", total=steps_total(cfg, engine, device=device, sharing=sharing))
        seen = {"n": 0}

        def on_step(what: str) -> None:
            progress.update(task, advance=1 if seen["n"] else 0, description=what)
            seen["n"] += 1

        from digenrl.launch import run_engine

        profile = run_profile(
            cfg,
            device,
            repeats=repeats,
            engine=engine,
            sharing=sharing,
            on_step=on_step,
            run_engine=run_engine,
        )
        progress.update(
            task, completed=steps_total(cfg, engine, device=device, sharing=sharing), description="done"
        )
    save_profile(profile, out)
    show(console, profile_table(profile))  # whole words; piped: one line a row
    console.print(f"wrote {out}")
    return profile


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def profile_table(p: dict) -> Table:
    m, w = p["measurements"], p["workload"]
    t = Table(
        title=f"{p['model']['class']} ({p['model']['params'] / 1e6:.2f}M params, {p['dtype']}) on "
        f"{p['device']['name']}, torch {p['torch']}"
    )
    t.add_column("measurement")
    t.add_column("value", justify="right")
    t.add_column("per sample", justify="right")
    for b, s in sorted(m["rollout_step_s"].items(), key=lambda kv: int(kv[0])):
        t.add_row(f"rollout step (x{w['guidance_passes']} pass), batch {b}", _ms(s), _ms(s / int(b)))
    for b, s in sorted(m["train_step_s"].items(), key=lambda kv: int(kv[0])):
        t.add_row(f"train step fwd+bwd, batch {b}", _ms(s), _ms(s / int(b)))
    for b, s in sorted(m["ref_forward_s"].items(), key=lambda kv: int(kv[0])):
        if int(b) == max(map(int, m["ref_forward_s"])):
            t.add_row(f"reference forward, batch {b}", _ms(s), _ms(s / int(b)))
    t.add_row("decode", "", _ms(m["decode_s_per_sample"]))
    t.add_row("reward", "", _ms(m["reward_s_per_sample"]))
    t.add_row("prompt encoding (per prompt)", _ms(m["encode_s_per_prompt"]), "")
    t.add_row("optimizer step", _ms(m["optimizer_step_s"]), "")
    ws = m["weight_sync"]
    t.add_row(
        f"weight sync: {ws['bytes'] / 1e6:.3f} MB in {ws['tensors']} tensors",
        f"pack {_ms(ws['pack_s'])}",
        f"load {_ms(ws['load_s'])}",
    )
    u = m["unit_overhead"]
    g = u.get("groups", 1)
    t.add_row(
        f"rollout unit ({g} group(s) = {g * w['group_size']} samples, {w['steps']} steps)",
        _ms(u["rollout_unit_s"]),
        f"x{u.get('rollout_factor', 1.0):.2f} its calls",
    )
    t.add_row(
        f"train unit ({g} group(s), {w['trained_steps']} trained steps)",
        _ms(u["train_unit_s"]),
        f"x{u.get('train_factor', 1.0):.2f} its calls",
    )
    if m.get("cpu_slowdown"):
        t.add_row(
            "CPU: slowdown with n concurrent workers",
            ", ".join(f"{n}: x{v:.2f}" for n, v in m["cpu_slowdown"].items()),
            "",
        )
    if "other_load_cores" in m:
        t.add_row(
            "CPU: other processes while measuring",
            f"{m['other_load_cores']:.2f} cores",
            f"{m.get('other_runnable', 0.0):.1f} runnable threads",
        )
    for phase, b in m["peak_memory_bytes"].items():
        t.add_row(f"peak memory ({phase})", f"{b / 2**20:.0f} MiB", "")
    e = p.get("engine")
    if e:
        t.add_row(f"engine: call round trip ({e.get('source', '')})", _ms(e["call_s"]), "")
        t.add_row(
            "engine: samples transfer latency",
            _ms(e["transfer_latency_s"]),
            f"{e['transfer_bytes_per_s'] / 1e9:.2f} GB/s",
        )
        t.add_row("engine: weights put / get", _ms(e["put_s"]), _ms(e["get_s"]))
        t.add_row("engine: all-reduce of the gradients", _ms(e.get("allreduce_s", 0.0)), "")
        if e.get("unit_time_factor"):
            t.add_row(
                "engine: a unit in a worker / in the profile",
                ", ".join(f"{k} x{v:.2f}" for k, v in e["unit_time_factor"].items()),
                "",
            )
        if e.get("unit_cv"):
            t.add_row(
                "engine: unit-to-unit spread (std / mean)",
                ", ".join(f"{k} {v:.2f}" for k, v in e["unit_cv"].items()),
                "",
            )
    return t

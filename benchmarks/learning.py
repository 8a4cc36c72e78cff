"""Reward per wall-second: the demo task trained for the same wall time in each engine mode.

    python benchmarks/learning.py [--minutes 2] [--seeds 0,1,2,3,4] [--modes colocated,sync,gap_tsp_tag,full]
                                  [--algorithms flow_grpo[,diffusion_nft,...]] [--tasks colors[,shapes]]
                                  [--set KEY=VALUE ...] [--tiny] [--json FILE]

Samples per second (benchmarks/engine_modes.py) is what the engine buys; reward gained per minute is
what a user buys. Each run trains the default demo (configs/flux_tiny.yaml: a tiny FLUX learning
prompt colours) with one mode's engine knobs (the modes of engine_modes.py) and one
``algorithm.name``, for ``--minutes`` of training wall time counted from its first logged iteration
(Ray start-up and model build are left out), then stops. Per run:

- gain: mean ``reward_mean`` of the last third of the iterations done minus that of the first third
  (the demo's own measure);
- gain per minute (of that wall time) and per 1000 samples trained.

Tasks (``--tasks``): ``colors``, the demo's ``prompt_color``; ``shapes``, ``prompt_shape`` (the
prompt's colour as the shape its object word picks, on gray: it needs spatial structure);
``smallworld``, the pretrained small-world FLUX on four of its GenEval captions
(configs/smallworld_flux.yaml's; docs/smallworld.md). Runs go
seed by seed, every task, algorithm and mode of a seed in turn, so that load drifting on a shared
machine hits them alike, in kept worker processes (tests.warm.warm_workers); the
table gives the mean and standard error over seeds, and per task and mode the best algorithm's gain
per minute over Flow-GRPO's, with its standard error (:func:`ratio_se`).
An ``algorithm.name`` the config does not accept is skipped with one line saying so.
``--eval``: after each run, ``digenrl eval --checkpoint RUN --baseline base`` (the last checkpoint
against the base model, on the task's test prompts; per category where the prompts are GenEval's).
``--tiny``: 2 iterations, one seed, for the smoke test. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")  # as engine_modes.py: equal footing with other load

DEFAULT_MODES = ["colocated", "sync", "gap_tsp_tag", "full"]
RUN_SET = ["output.checkpoint_every=0", "output.save_samples_every=0", "output.tensorboard=false"]
METRICS = ("gain", "gain_per_min", "gain_per_1k_samples", "samples_per_s", "iterations")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.warm (a user's run sets no PYTHONPATH)
#: the learning tasks: each the reward (and prompts, and model) that replace the demo's
TASKS = {
    "colors": [],
    "shapes": ["reward.components=[{name: prompt_shape}]"],
    # configs/smallworld_flux.yaml's task: the pretrained small-world FLUX, GenEval's rules
    "smallworld": [
        f"model.pretrained={ROOT / 'models' / 'smallworld_flux'}",
        "model.lora.targets=null",
        "reward.components=[{name: smallworld, args: {score: flow_grpo}}]",
        f"prompts.file={ROOT / 'configs' / 'smallworld_focus'}",  # its four captions
        "train.lr=1e-3",  # the config's: the demo's 3e-3 drove Flow-GRPO's reward down on it
    ],
}


def engine_modes():
    """The mode definitions of benchmarks/engine_modes.py (one source for both benchmarks), and
    ``local``: the single-process trainer (no Ray; the same units, one at a time)."""
    spec = importlib.util.spec_from_file_location("engine_modes", Path(__file__).with_name("engine_modes.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {**mod.MODES, "local": ["placement.mode=local"]}


class WallTimeUp(Exception):
    """Raised from the per-iteration callback once a run's wall time is spent."""


def gain(rewards: list[float]) -> float:
    """Mean of the last third minus mean of the first third (one iteration each if fewer than 3)."""
    k = max(1, len(rewards) // 3)
    return statistics.fmean(rewards[-k:]) - statistics.fmean(rewards[:k])


def known_algorithm(name: str, overrides: list[str]) -> str | None:
    """None if ``algorithm.name=name`` loads, else the config's one-line reason."""
    from digenrl.config.run import load_config

    try:
        load_config(None, [*overrides, f"algorithm.name={name}"])
    except Exception as exc:  # noqa: BLE001 -- any refusal means: not known (yet)
        return str(exc).splitlines()[0]
    return None


def run_one(overrides: list[str], seconds: float, iterations: int, run_dir: Path) -> dict:
    """Train one configuration until ``seconds`` of wall time after its first logged iteration."""
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer
    from digenrl.launch import run_engine

    cfg = load_config(None, [*overrides, f"train.iterations={iterations}", *RUN_SET])
    rows: list[dict] = []
    stamps: list[float] = []

    def on_iteration(row):
        if stamps and stamps[-1] - stamps[0] >= seconds:
            return  # the rows the engine logs while it stops: past the budget, not counted
        rows.append(row)
        stamps.append(time.perf_counter())
        if stamps[-1] - stamps[0] >= seconds:
            raise WallTimeUp

    try:
        if cfg.placement.mode == "local":
            LocalTrainer(cfg).run(run_dir, on_iteration=on_iteration)
        else:
            run_engine(cfg, run_dir=run_dir, on_iteration=on_iteration)
    except WallTimeUp:
        pass
    rows.sort(key=lambda r: r["iteration"])
    rewards = [r["reward_mean"] for r in rows]
    # the first row's iteration is time 0; the wall time is that of the iterations after it
    elapsed = max(stamps[-1] - stamps[0], 1e-9) if len(stamps) > 1 else float("nan")
    per_iter = cfg.train.prompts_per_iteration * cfg.algorithm.group_size
    g = gain(rewards)
    return {
        "iterations": len(rows),
        "wall_s": elapsed,
        "samples": per_iter * len(rows),
        "samples_per_s": per_iter * (len(rows) - 1) / elapsed,
        "gain": g,
        "gain_per_min": g / (elapsed / 60),
        "gain_per_1k_samples": g / (per_iter * len(rows) / 1000),
        "rewards": rewards,
    }


def eval_before_after(run_dir: Path) -> dict:
    """``digenrl eval --checkpoint RUN --baseline base``'s means per reward: {name: {"before",
    "after"}}, each {"mean", "by_tag"} (by_tag only for tagged prompts)."""
    import torch

    from digenrl.run.evaluate import evaluate_checkpoint, prepare_eval

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's CPU workers: on shared cores more threads only spin
    try:
        report = evaluate_checkpoint(prepare_eval(run_dir, baseline="base"))
    finally:
        torch.set_num_threads(threads)
    keep = lambda r: {k: r[k] for k in ("mean", "by_tag") if k in r}  # noqa: E731
    names = [n for n in report["rewards"] if n != "total"] or ["total"]  # one component: it is the total
    if len(names) > 1:
        names.append("total")
    before, after = report["baseline"]["rewards"], report["rewards"]
    return {n: {"before": keep(before[n]), "after": keep(after[n])} for n in names}


def flat_eval(ev: dict) -> dict[str, float]:
    out = {}
    for name, sides in ev.items():
        for when, r in sides.items():
            out[f"{name}/{when}"] = r["mean"]
            out.update({f"{name}/{when}/{tag}": v for tag, v in r.get("by_tag", {}).items()})
    return out


def mean_se(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan"))


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (task, algorithm, mode): mean and standard error over seeds of each metric."""
    out = []
    for key in dict.fromkeys((r.get("task", "colors"), r["algorithm"], r["mode"]) for r in runs):
        mine = [r for r in runs if (r.get("task", "colors"), r["algorithm"], r["mode"]) == key]
        row = {"task": key[0], "algorithm": key[1], "mode": key[2], "seeds": [r["seed"] for r in mine]}
        for m in METRICS:
            row[m], row[f"{m}_se"] = mean_se([r[m] for r in mine])
        if all("eval" in r for r in mine):  # --eval: "REWARD/before|after[/TAG]": (mean, se) over seeds
            flat = [flat_eval(r["eval"]) for r in mine]
            row["eval"] = {k: mean_se([f[k] for f in flat]) for k in flat[0]}
        out.append(row)
    return out


def ratio_se(a: float, a_se: float, b: float, b_se: float) -> tuple[float, float]:
    """a / b and its standard error by the delta method (independent means):
    se = |a / b| sqrt((se_a / a)^2 + (se_b / b)^2)."""
    r = a / b
    return r, abs(r) * ((a_se / a) ** 2 + (b_se / b) ** 2) ** 0.5


def best_vs_flow_grpo(summary: list[dict]) -> list[dict]:
    """Per (task, mode): the algorithm with the highest mean gain per minute, and its ratio to
    Flow-GRPO's with the standard error (absent where Flow-GRPO was not run; None where Flow-GRPO's
    mean gain per minute is not positive)."""
    out = []
    for task, mode in dict.fromkeys((r["task"], r["mode"]) for r in summary):
        rows = [r for r in summary if (r["task"], r["mode"]) == (task, mode)]
        base = next((r for r in rows if r["algorithm"] == "flow_grpo"), None)
        best = max(rows, key=lambda r: r["gain_per_min"])
        if base is None:
            continue
        if base["gain_per_min"] <= 0:  # a ratio to no gain (or a loss) means nothing
            out.append(
                {"task": task, "mode": mode, "best": best["algorithm"], "ratio": None, "ratio_se": None}
            )
            continue
        ratio, se = ratio_se(
            best["gain_per_min"], best["gain_per_min_se"], base["gain_per_min"], base["gain_per_min_se"]
        )
        out.append({"task": task, "mode": mode, "best": best["algorithm"], "ratio": ratio, "ratio_se": se})
    return out


def compare(
    modes: list[str],
    algorithms: list[str],
    seeds: list[int],
    minutes: float,
    overrides: list[str] = (),
    iterations: int = 100_000,
    log=print,
    on_run=None,
    tasks: list[str] = ("colors",),
    evaluate: bool = False,
) -> dict:
    """Train every (seed, algorithm, mode) for ``minutes``; returns {"runs", "summary", "skipped"}.
    ``on_run(partial result)`` after each run (the script writes its JSON then: a stopped
    benchmark keeps its finished runs). The reusable core (an algorithm comparison at one mode
    calls it with one mode and several algorithms)."""
    import ray

    from digenrl.engine.resources import start_local
    from tests.warm import active, warm_workers

    known = engine_modes()
    if unknown := [m for m in modes if m not in known]:
        raise ValueError(f"--modes: {', '.join(unknown)} not a mode ({', '.join(known)})")
    if unknown := [t for t in tasks if t not in TASKS]:
        raise ValueError(f"--tasks: {', '.join(unknown)} not a task ({', '.join(TASKS)})")
    skipped = {}
    for name in algorithms:
        if (why := known_algorithm(name, list(overrides))) is not None:
            skipped[name] = why
            log(f"skipping algorithm {name!r}: the config does not know it yet ({why})")
    algos = [a for a in algorithms if a not in skipped]
    runs = []
    ray_modes = [m for m in modes if m != "local"]
    started = bool(ray_modes) and start_local({"pool:rollout": 2, "pool:trainer": 1}, log_to_driver=False)
    try:
        kept = contextlib.nullcontext() if active() is not None else warm_workers()  # (the suite's own)
        with tempfile.TemporaryDirectory() as tmp, kept:
            cells = [(t, a, m) for t in tasks for a in algos for m in modes]
            for seed in seeds:  # interleaved: load drift on a shared machine hits every cell alike
                for task, algo, mode in cells:
                    sets = [
                        *TASKS[task],
                        *overrides,  # after the task's: --set train.lr=... changes the task's
                        f"algorithm.name={algo}",
                        *known[mode],
                        f"train.seed={seed}",
                    ]
                    run_dir = Path(tmp) / f"{task}-{algo}-{mode}-{seed}"
                    r = run_one(sets, minutes * 60, iterations, run_dir)
                    r.update(task=task, algorithm=algo, mode=mode, seed=seed)
                    if evaluate:
                        r["eval"] = eval_before_after(run_dir)
                    runs.append(r)
                    if on_run is not None:
                        on_run(result(minutes, seeds, runs, skipped))
                    log(
                        f"{task} / {algo} / {mode} / seed {seed}: {r['iterations']} iterations in "
                        f"{r['wall_s']:.0f} s, gain {r['gain']:+.3f} ({r['gain_per_min']:+.3f}/min, "
                        f"{r['gain_per_1k_samples']:+.3f}/1k samples)"
                    )
    finally:
        if started:
            ray.shutdown()
    return result(minutes, seeds, runs, skipped)


def result(minutes: float, seeds: list[int], runs: list[dict], skipped: dict) -> dict:
    return {
        "minutes": minutes,
        "seeds": list(seeds),
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "runs": runs,
        "summary": (summary := summarize(runs)),
        "best_vs_flow_grpo": best_vs_flow_grpo(summary),
        "skipped": skipped,
    }


def table(result: dict):
    from rich.table import Table

    tab = Table(
        title=f"reward per wall time - {result['minutes']:g} min per run, seeds {result['seeds']}, "
        f"{result['cpu_count']} CPU cores (load average at the end {result['load_average'][0]:.1f})"
    )
    for col in (
        "task",
        "algorithm",
        "mode",
        "iterations",
        "samples/s",
        "gain",
        "gain / min",
        "gain / 1k samples",
    ):
        tab.add_column(col, justify="left" if col in ("task", "algorithm", "mode") else "right")
    pm = lambda r, m, f: f"{r[m]:{f}} ± {r[m + '_se']:.3f}"  # noqa: E731
    for r in result["summary"]:
        tab.add_row(
            r["task"],
            r["algorithm"],
            r["mode"],
            f"{r['iterations']:.0f}",
            f"{r['samples_per_s']:.1f}",
            pm(r, "gain", "+.3f"),
            pm(r, "gain_per_min", "+.3f"),
            pm(r, "gain_per_1k_samples", "+.4f"),
        )
    return tab


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="training wall time per run")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--algorithms", default="flow_grpo", help="comma-separated algorithm.name values")
    parser.add_argument("--tasks", default="colors", help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--set", action="append", default=[], help="a config override for every run")
    parser.add_argument("--eval", action="store_true", help="each run's held-out score before / after")
    parser.add_argument("--tiny", action="store_true", help="2 iterations, one seed (the smoke test)")
    parser.add_argument("--json", type=Path, help="write the runs and the summary here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from rich.console import Console

    console = Console(width=150)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    iterations = 100_000
    if args.tiny:
        seeds, iterations = seeds[:1], 2
    try:
        result = compare(
            [m for m in args.modes.split(",") if m],
            [a for a in args.algorithms.split(",") if a],
            seeds,
            args.minutes,
            args.set,
            iterations,
            log=lambda s: console.print(f"[dim]{s}[/dim]"),
            on_run=(lambda r: args.json.write_text(json.dumps(r, indent=2))) if args.json else None,
            tasks=[t for t in args.tasks.split(",") if t],
            evaluate=args.eval,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console.print(table(result))
    for r in result["summary"]:  # --eval: the held-out score before -> after, each category
        for key, (after, se) in r.get("eval", {}).items():
            if "/after" in key:
                before = r["eval"][key.replace("/after", "/before")][0]
                console.print(
                    f"{r['task']} / {r['algorithm']} / {r['mode']}: {key.replace('/after', '')} "
                    f"{before:.3f} -> {after:.3f} ± {se:.3f}"
                )
    for b in result["best_vs_flow_grpo"]:
        if b["ratio"] is None:
            console.print(f"{b['task']} / {b['mode']}: best {b['best']}; Flow-GRPO gained nothing: no ratio")
            continue
        console.print(
            f"{b['task']} / {b['mode']}: best {b['best']}, gain per minute "
            f"{b['ratio']:.2f} ± {b['ratio_se']:.2f} x Flow-GRPO's"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every driver does around its iterations, written once for the local trainer and the engine.

Details: docs/modules.md, `digenrl.run.cadence`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from digenrl.checkpoint.compat import CheckpointState
from digenrl.checkpoint.load import read_state
from digenrl.checkpoint.store import latest_checkpoint
from digenrl.config.run import RunConfig
from digenrl.errors import RunInterrupted, UserError
from digenrl.policy.lora import save_lora
from digenrl.progress import progress
from digenrl.rewards import reward_metrics
from digenrl.run.diagnose import group_metrics
from digenrl.run.media import save_samples


@dataclass
class RunResult:
    run_dir: Path
    metrics: list[dict]


class RunCadence:
    """The cadence of a run's side work, from ``output``."""

    def __init__(self, cfg: RunConfig):
        self.out, self.iterations = cfg.output, cfg.train.iterations

    def eval_due(self, k: int) -> bool:
        every = self.out.eval_every
        return bool(every) and (k + 1) % every == 0

    def checkpoint_due(self, k: int) -> bool:
        every = self.out.checkpoint_every
        return (bool(every) and (k + 1) % every == 0) or k + 1 == self.iterations

    def samples_due(self, k: int) -> bool:
        every = self.out.save_samples_every
        return (bool(every) and k % every == 0) or k == self.iterations - 1


def resume_history(
    resumed: CheckpointState | None, run_dir: Path | None
) -> tuple[Path | None, list[dict] | None]:
    """Where a (resumed) run writes and the metrics rows it keeps: a resumed run continues in its
    checkpoint's run directory unless ``run_dir`` forks it elsewhere, keeping the rows of the
    iterations the checkpoint holds (rows logged after it are dropped: they are run again)."""
    if resumed is None:
        return run_dir, None
    source = resumed.run_dir
    history = [r for r in _read_rows(source) if r.get("iteration", -1) < resumed.iteration] if source else []
    return run_dir or source or resumed.path, history


def _read_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows, skipping a line cut short by a crash."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def iteration_metrics(
    iteration: int,
    version: int,
    units: list,
    stats: dict,
    wall: float,
    *,
    samples_per_s: float | None = None,
    bubble_fraction: float | None = None,
    **extra,
) -> dict:
    """The metrics row: rewards of the iteration's rolled-out ``units`` (anything with ``rewards``,
    ``reward_parts`` and ``group_ids``, whole groups) and their groups' spread (:mod:`digenrl.run.diagnose`),
    the merged train ``stats``, wall time and throughput. ``samples_per_s``
    defaults to samples / ``wall``; ``bubble_fraction`` is only logged by a driver that measured it."""
    rewards = torch.cat([u.rewards for u in units])
    parts = {name: torch.cat([u.reward_parts[name] for u in units]) for name in units[0].reward_parts}
    n = len(rewards)
    row = {
        "iteration": iteration,
        "version": version,
        **reward_metrics(rewards, parts),  # reward_mean / reward_std / reward/<name>, NaN-safe
        "loss": stats.pop("loss"),
        "samples": n,
        "wall_s": wall,
        "samples_per_s": n / wall if samples_per_s is None else samples_per_s,
    }
    if bubble_fraction is not None:
        row["bubble_fraction"] = bubble_fraction
    row.update(group_metrics(units))  # groups_zero_std, reward_std_in_group: why a reward may not move
    row.update(stats)
    row.update(extra)
    return row


def save_iteration_samples(run_dir: Path, iteration: int, units: list) -> Path:
    """One sample per prompt group of the iteration, captioned with its prompt and reward (``units``:
    anything with ``preview``, ``prompts``, ``rewards`` and ``group_ids``)."""

    G = len(units[0]) // len(units[0].group_ids)
    pixels = torch.cat([u.preview for u in units])
    captions = [f"{u.prompts[j * G]} {u.rewards[j * G]:.2f}" for u in units for j in range(len(u.group_ids))]
    return save_samples(pixels, captions, run_dir / "samples" / f"iter-{iteration:06d}")


def final_files(policy) -> dict[str, bytes]:
    """The final weights as file bytes: LoRA in the diffusers format (``load_lora_weights``), else the
    full transformer as safetensors; with ``train.ema`` the EMA weights. Bytes, so a driver can write
    them from another process or node."""
    with tempfile.TemporaryDirectory() as tmp, policy.averaged():
        out = Path(tmp)
        if policy.lora:
            save_lora(policy.adapter, out)
        else:
            from safetensors.torch import save_file

            save_file(policy.weights(), out / "transformer.safetensors")
        return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def write_final(run_dir: Path, files: dict[str, bytes]) -> Path:
    final = Path(run_dir) / "final"
    final.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (final / name).write_bytes(data)
    return final


# ------------------------------------------------------- stopping mid-run keeps the work


class StopRequest:
    """Ctrl-C during a run. The first press asks the driver to stop cleanly: the local trainer
    abandons the iteration in progress when it is in ``abandonable`` work (rollout and gradients,
    which leave the weights untouched), else finishes it; the engine lets the units already running
    finish. Either way a checkpoint of the last completed iteration follows. A second press stops
    at once (``forced``), keeping only what is already on disk."""

    def __init__(self) -> None:
        self.requested = self.forced = False
        self._abandonable = False

    def press(self) -> None:
        if self.requested or self._abandonable:
            self.forced = self.requested
            self.requested = True
            raise KeyboardInterrupt
        self.requested = True
        progress("interrupted: finishing the work in progress, then a checkpoint (Ctrl-C again: stop now)...")

    @contextlib.contextmanager
    def abandonable(self):
        """Work that a first Ctrl-C may cut short: it changes no state a checkpoint holds."""
        if self.requested:
            raise KeyboardInterrupt
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False


@contextlib.contextmanager
def stop_on_interrupt():
    """A :class:`StopRequest` that SIGINT presses while the ``with`` block runs (main thread only;
    elsewhere, or where SIGINT is ignored, nothing changes)."""
    stop = StopRequest()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is signal.SIG_IGN:
        yield stop
        return
    signal.signal(signal.SIGINT, lambda signum, frame: stop.press())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def checkpoint_to_keep(run_dir: Path, done: int, version: int) -> bool:
    """Whether a run stopping with ``done`` iterations logged, its trainer at ``version``, should
    write a checkpoint now: the trainer's state must be exactly that of the last logged iteration
    (a resumed run keeps the rows before its checkpoint), something was done, and the newest
    checkpoint is older."""
    if done <= 0 or version != done:
        return False
    last = latest_checkpoint(run_dir)
    return last is None or read_state(last).iteration < done


def stopped(exc: BaseException, run_dir: Path, done: int, total: int) -> BaseException:
    """The exception a run stopped by ``exc`` ends with, naming the last checkpoint and how to
    resume: :class:`RunInterrupted` for Ctrl-C (exit 130), ``exc`` itself otherwise (a user error's
    message gets the hint; any other error carries it as a note under its traceback)."""
    last = latest_checkpoint(run_dir) if Path(run_dir).is_dir() else None
    if last is None:
        hint = f"no checkpoint was written ({done} of {total} iterations done, nothing to resume from)"
    else:
        iteration = read_state(last).iteration
        hint = (
            f"last checkpoint: {last} (iteration {iteration}); resume with: digenrl train --resume {run_dir}"
        )
    if isinstance(exc, KeyboardInterrupt):
        return RunInterrupted(f"interrupted with {done} of {total} iterations done; {hint}")
    if isinstance(exc, UserError):
        if hint not in str(exc):
            exc.args = (f"{str(exc).rstrip('. ')}; {hint}",)
        return exc
    exc.add_note(hint)
    return exc

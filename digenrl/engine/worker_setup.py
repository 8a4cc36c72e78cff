"""How an engine worker starts: what it builds (:func:`generates`), with the garbage collector paused
(:func:`gc_paused_then_frozen`), from a checkpoint (:class:`ResumeFrom`), and whether Ray restarted
it (:func:`restarted`)."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def restarted() -> bool:
    """True in an actor that Ray has restarted after its process died."""
    import warnings

    try:
        import ray

        if not ray.is_initialized():  # not in a Ray actor (and do not start Ray by asking)
            return False
        with warnings.catch_warnings():  # (its implementation calls a deprecated Ray API)
            warnings.simplefilter("ignore")
            return ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # noqa: BLE001  (not in a Ray actor: a plain object, e.g. in tests)
        return False


@contextlib.contextmanager
def gc_paused_then_frozen(freeze: bool = True):
    """Build with Python's cyclic garbage collector paused, then freeze what was built. A worker's
    start imports diffusers, peft and transformers and builds the model: some 10^5-10^6 objects that
    live as long as the worker, which the collector would traverse again and again while they are
    made (~20% of an engine worker's start-up CPU on 2 cores) and at every full collection after.
    Frozen objects are still freed by reference counting. ``freeze=False``: paused only -- a process
    kept for another run (the test suite's kept actors) builds its next worker unfrozen, so emptying
    it collects that worker's ~10^4 objects, not the imports' ~5x10^5 again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class ResumeFrom:
    """Where the workers start from: the checkpoint directory, and the driver's copy of the files a
    rollout worker needs (never ``optimizer.pt``) as an ObjectRef nested here, so Ray resolves it
    only in a worker that cannot read the directory."""

    path: str
    rollout_files: Any  # ray.ObjectRef of dict[str, bytes]


def rollout_checkpoint_files(path: Path) -> dict[str, bytes]:
    """The files of a checkpoint a rollout worker loads: all but the optimizer state."""
    return {f.name: f.read_bytes() for f in Path(path).iterdir() if f.is_file() and f.name != "optimizer.pt"}


def generates(cfg, role: str) -> bool:
    """Whether a worker of ``role`` ever encodes prompts or decodes latents: rollout and colocated
    workers, a trainer rank with TAG (it rolls out), and trainer ranks when ``output.eval_every``
    is set (rank 0 evaluates; every rank keeps them, as a rank does not know its rank at build)."""
    return role != "trainer" or cfg.engine.tag or cfg.output.eval_every > 0

"""The search's elastic TAG (``engine.tag: auto``, BTS: the authors' RFC, verl-project/verl-omni#321):
an auto plan is simulated with the engine's own decision code (``sim_bts.py``), a search of both
continuations at every TAG point -- ~0.1 s of CPU per FLUX.1-dev plan on 16 devices, too dear for
every candidate. So the search ranks TAG on / off first, then simulates the ``tag: auto`` twin of
its best disaggregated plans, which joins the ranking where it predicts a shorter iteration."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from digenrl.placement.plan import Plan
from digenrl.planner.bound import DoesNotFit
from digenrl.planner.sim_result import SimResult


def elastic_twins(
    results: list[SimResult],
    run: Callable[[Plan], SimResult],
    refused: Callable[[Plan], str | None],
    top: int,
) -> list[SimResult]:
    """The simulated ``tag: auto`` twins of the ``top`` fastest disaggregated plans of ``results``
    (``refused``: why a twin cannot run under the engine's rules, or None; DoesNotFit: its trainer has
    no room for a rollout beside its training state)."""
    seen = {r.plan.label() for r in results}
    ranked = sorted(results, key=lambda r: (-r.samples_per_s, r.plan.label()))
    out = []
    for r in [r for r in ranked if r.plan.placement == "disaggregated" and r.plan.tag != "auto"][:top]:
        twin = replace(r.plan, tag="auto")
        try:
            if twin.label() in seen or refused(twin):
                continue
        except DoesNotFit:  # a TAG-off plan's trainer without room for a rollout
            continue
        seen.add(twin.label())
        out.append(run(twin))
    return out

"""The algorithms against each other: reward gained per wall-minute on the tiny FLUX demo's tasks.

    python benchmarks/algorithms.py [--minutes 2] [--seeds 0,1,2,3,4] [--mode full]
                                    [--algorithms flow_grpo,diffusion_nft,awm,flow_dppo,grpo_guard,online_dpo]
                                    [--tasks colors,shapes] [--set KEY=VALUE ...] [--tiny] [--json FILE]

The algorithm axis of benchmarks/learning.py at one engine mode (default ``full``: the disaggregated
engine with GAP, TSP, TAG and one-step async, configs/flux_tiny_disaggregated.yaml; ``--mode colocated``
is the default demo's own): every algorithm trains the demo for the
same wall time, seed by seed, and the table gives reward gain per minute and per 1000 samples, mean
and standard error over seeds. Not a test: nothing is asserted.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learning  # noqa: E402  (benchmarks/learning.py, beside this script)

ALGORITHMS = "flow_grpo,diffusion_nft,awm,flow_dppo,grpo_guard,online_dpo"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "full"
    if "--mode" in argv:
        i = argv.index("--mode")
        mode = argv[i + 1]
        del argv[i : i + 2]
    if "--algorithms" not in argv:
        argv += ["--algorithms", ALGORITHMS]
    return learning.main(["--modes", mode, *argv])


if __name__ == "__main__":
    sys.exit(main())

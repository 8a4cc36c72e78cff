"""Weight-sync bandwidth: the Ray object store packet path vs a bucketed gloo broadcast, and the
device fingerprint vs SHA-256.

    python benchmarks/weight_sync.py [--repeats 3] [--json FILE]

Last rows: the trainer ranks' agreement after a step on the LoRA-like payload, the host copy +
SHA-256 the engine ran before (``agree_sha256``) vs ``Policy.agreement_digest`` (``agree_fingerprint``).

Transports, each end to end from the source (this driver) to one receiver (a Ray actor), the
receiver's tensors loaded and verified:
- ``ray_object_store``: engine/weight_sync.py as the engine runs it (``publish``: SHA-256 + put;
  the actor: ``fetch`` + ``verify``: get + key check + SHA-256). The engine then also loads into
  a Policy and checks the SHA-256 once more; that part is left out, so this row is a lower bound
  of the engine's cost;
- ``broadcast_gloo``: digenrl.distributed.broadcast (header, 256 MiB buckets, fingerprints),
  the actor receiving into staging buffers and loading into its own tensors (group set up once,
  not timed).
Payloads: the tiny FLUX's LoRA and full weights (the real classes), and synthetic bf16 state
dicts with FLUX-like tensor shapes: LoRA-like (rank 64 A/B pairs of 3072-wide layers) of
at least 32 MiB and full-like (3072x3072 / 3072x12288 matrices) of at least 384 MiB
(414 MiB: whole matrices). Real FLUX sizes (LoRA
0.72 GB, full 23.8 GB) do not fit this machine; scale by bytes/s.
Not a test: timings are reported, never asserted. The machine may be shared: say so with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from digenrl.distributed.broadcast import SyncGroup, WeightBroadcaster, WeightReceiver  # noqa: E402
from digenrl.distributed.fingerprint import fingerprint, fingerprints  # noqa: E402
from digenrl.distributed.staged import digest, specs_for  # noqa: E402
from digenrl.engine import weight_sync  # noqa: E402
from digenrl.policy.lora import checksum  # noqa: E402


def synthetic(kind: str, target_bytes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 3072), (3072, 64)] if kind == "lora" else [(3072, 3072), (12288, 3072), (3072, 12288)]
    state, total, i = {}, 0, 0
    while total < target_bytes:
        shape = shapes[i % len(shapes)]
        state[f"blocks.{i // len(shapes)}.{i % len(shapes)}.weight"] = torch.randn(shape, generator=gen).to(
            torch.bfloat16
        )
        total += state[f"blocks.{i // len(shapes)}.{i % len(shapes)}.weight"].numel() * 2
        i += 1
    return state


def tiny_flux(lora: bool) -> dict[str, torch.Tensor]:
    from digenrl.config.run import load_config
    from digenrl.policy.model import Policy

    sets = [] if lora else ["model.lora=null"]
    return Policy(load_config(None, sets), device="cpu").weights()


class _Source:
    def __init__(self, state):
        self.state, self.version = state, 1

    def weights(self):
        return self.state


@ray.remote(num_cpus=1)
class Receiver:
    def __init__(self):
        torch.set_num_threads(1)
        self.targets = None

    def ray_load(self, packet) -> int:
        state = weight_sync.fetch(packet)
        weight_sync.verify(state, packet, packet.keys)
        return packet.nbytes

    def open_group(self, port: int) -> bool:
        self.group = SyncGroup(1, 2, "127.0.0.1", port)
        self.receiver = WeightReceiver(self.group)
        return True

    def allocate(self, shapes: dict) -> bool:
        self.targets = {n: torch.empty(s, dtype=getattr(torch, d)) for n, (s, d) in shapes.items()}
        return True

    def broadcast_load(self) -> int:
        got = self.receiver.receive()
        self.receiver.load(got, self.targets)
        return got.nbytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row(transport: str, what: str, nbytes: int, seconds: float) -> dict:
    return {
        "transport": transport,
        "what": what,
        "bytes": nbytes,
        "seconds": round(seconds, 5),
        "bytes_per_s": round(nbytes / seconds) if seconds > 0 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--lora-mib", type=int, default=32, help="size of the LoRA-like payload")
    ap.add_argument("--full-mib", type=int, default=384, help="size of the full-like payload")
    args = ap.parse_args()
    torch.set_num_threads(1)
    payloads = {"lora_tiny_flux": tiny_flux(True), "full_tiny_flux": tiny_flux(False)}
    for kind, mib in (("lora", args.lora_mib), ("full", args.full_mib)):  # named by their real size
        state = synthetic(kind, mib * 2**20)
        payloads[f"{kind}_like_{weight_sync.state_bytes(state) / 2**20:.0f}MiB"] = state
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=2 * 2**30,
        logging_level="ERROR",
    )
    rows = []
    try:
        actor = Receiver.remote()
        port = free_port()
        opened = actor.open_group.remote(port)
        group = SyncGroup(0, 2, "127.0.0.1", port)
        ray.get(opened)
        sender = WeightBroadcaster(group)
        for what, state in payloads.items():
            nbytes = weight_sync.state_bytes(state)

            def via_ray():
                packet, _ = weight_sync.publish(_Source(state))
                ray.get(actor.ray_load.remote(packet))

            rows.append(row("ray_object_store", what, nbytes, median_time(via_ray, args.repeats)))
            ray.get(
                actor.allocate.remote(
                    {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()}
                )
            )

            def via_broadcast():
                done = actor.broadcast_load.remote()
                sender.publish(1, state, specs=specs_for(state))
                ray.get(done)

            rows.append(row("broadcast_gloo", what, nbytes, median_time(via_broadcast, args.repeats)))
            print(
                f"{what}: {nbytes / 2**20:.1f} MiB  ray {rows[-2]['seconds']:.3f} s  broadcast "
                f"{rows[-1]['seconds']:.3f} s",
                flush=True,
            )
    finally:
        ray.shutdown()
    what = list(payloads)[-1]
    big = payloads[what]
    nbytes = weight_sync.state_bytes(big)
    rows.append(
        row(
            "fingerprint",
            what,
            nbytes,
            median_time(lambda: [fingerprint(t) for t in big.values()], args.repeats),
        )
    )
    rows.append(
        row("sha256", what, nbytes, median_time(lambda: checksum(big), args.repeats))
    )  # the engine's check
    # the trainer ranks' agreement after each step, on the LoRA-like payload: before, a host copy and a
    # SHA-256 of it (checksum(policy.weights())); now Policy.agreement_digest's fingerprints + digest
    what = next(k for k in payloads if k.startswith("lora_like"))
    lora = payloads[what]
    nbytes = weight_sync.state_bytes(lora)
    names = list(lora)
    agree_sha = median_time(lambda: checksum({k: v.clone() for k, v in lora.items()}), args.repeats)
    agree_fp = median_time(lambda: digest(names, fingerprints(list(lora.values()))), args.repeats)
    rows.append(row("agree_sha256", what, nbytes, agree_sha))
    rows.append(row("agree_fingerprint", what, nbytes, agree_fp))
    for r in rows:
        print(
            f"{r['transport']:>18} {r['what']:>20} {r['bytes'] / 2**20:9.2f} MiB {r['seconds']:8.4f} s "
            f"{r['bytes_per_s'] / 1e9:7.3f} GB/s"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()

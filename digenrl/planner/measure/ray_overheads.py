"""Ray's own costs between two actors on this machine: actor call round trip, object-store
transfer at two sizes (latency + bytes/s), ``ray.put`` / ``ray.get`` of the weights, a gloo
all-reduce of the gradients."""

from __future__ import annotations

import statistics
import time

import torch

from digenrl.engine.resources import disconnect, start_local
from digenrl.planner.constants import (
    LARGE_TRANSFER_BYTES,
    LARGE_TRANSFER_UNITS,
    RAY_PROBE_CPUS,
    RAY_REPEATS,
    RAY_WARM_CALLS,
    SMALL_TRANSFER_BYTES,
)


class _Probe:
    """A stand-in engine worker for timing Ray itself (wrapped with ray.remote by the profile)."""

    def __init__(self):
        torch.set_num_threads(1)

    def ping(self, unit=None, packet=None) -> dict:
        now = time.time()
        return {
            "events": [
                {
                    "kind": "rollout",
                    "uid": "u",
                    "iteration": 0,
                    "version": 0,
                    "start": now,
                    "end": now,
                    "args": {},
                }
            ],
            "rewards": torch.zeros(8),
        }

    def produce(self, nbytes: int):
        data = torch.zeros(max(1, nbytes // 4))
        return data, {"n": data.numel()}

    def consume(self, data, *args) -> dict:
        return {"n": int(data.numel())}

    def put(self, nbytes: int):
        import ray

        state = {"w": torch.zeros(max(1, nbytes // 4))}
        t0 = time.perf_counter()
        ref = ray.put(state)
        return [ref], time.perf_counter() - t0

    def get(self, refs) -> float:
        import ray

        t0 = time.perf_counter()
        ray.get(refs[0])
        return time.perf_counter() - t0

    def address(self):
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, address: str, port: int, rank: int, world: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world)

    def allreduce(self, numel: int, repeats: int) -> float:
        import torch.distributed as dist

        flat = torch.zeros(max(1, numel))
        dist.all_reduce(flat)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
        return statistics.median(times)


def ray_overheads(
    unit_bytes: float, weight_bytes: int, trained_params: int, repeats: int = RAY_REPEATS
) -> dict:
    """Ray's own costs between two actors on this machine (a local cluster, started and stopped here)."""
    import ray

    ours = start_local({})
    try:
        remote = ray.remote(num_cpus=RAY_PROBE_CPUS)(_Probe)
        a, b = remote.remote(), remote.remote()
        ray.get([a.ping.remote(), b.ping.remote()])

        def call(actor_call) -> float:
            t0 = time.perf_counter()
            ref = actor_call()
            ray.wait([ref], num_returns=1)
            ray.get(ref)
            return time.perf_counter() - t0

        for _ in range(RAY_WARM_CALLS):
            call(lambda: a.ping.remote())
        call_s = statistics.median(call(lambda: a.ping.remote()) for _ in range(repeats))
        sizes = [
            max(SMALL_TRANSFER_BYTES, int(unit_bytes)),
            max(LARGE_TRANSFER_BYTES, LARGE_TRANSFER_UNITS * int(unit_bytes)),
        ]
        transfer = []
        for size in sizes:
            times = []
            for _ in range(max(RAY_WARM_CALLS, repeats // 3)):
                data, small = a.produce.options(num_returns=2).remote(size)
                ray.get(small)
                times.append(call(lambda: b.consume.remote(data)) - call_s)
            transfer.append(max(0.0, statistics.median(times)))
        per_byte = max(1e-12, (transfer[1] - transfer[0]) / (sizes[1] - sizes[0]))
        latency = max(0.0, transfer[0] - per_byte * sizes[0])
        puts, gets = [], []
        for _ in range(max(RAY_WARM_CALLS, repeats // 3)):
            refs, put_s = ray.get(a.put.remote(weight_bytes))
            puts.append(put_s)
            gets.append(ray.get(b.get.remote(refs)))
        address, port = ray.get(a.address.remote())
        ray.get([a.join.remote(address, port, 0, 2), b.join.remote(address, port, 1, 2)])
        ar = ray.get(
            [a.allreduce.remote(trained_params, repeats), b.allreduce.remote(trained_params, repeats)]
        )
        for actor in (a, b):
            ray.kill(actor)
        return {
            "call_s": call_s,
            "transfer_latency_s": latency,
            "transfer_bytes_per_s": 1.0 / per_byte,
            "transfer_sizes": sizes,
            "transfer_s": transfer,
            "put_s": statistics.median(puts),
            "get_s": statistics.median(gets),
            "allreduce_s": max(ar),
            "source": "ray micro-benchmarks",
        }
    finally:
        disconnect(ours)  # and the session directory of the cluster started here

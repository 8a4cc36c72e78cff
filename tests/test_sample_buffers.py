"""Sampling's memory and its outputs' lifetimes (issue 36, items 5 and 8).

- ``sample()`` writes the trajectory into buffers allocated once: the bytes it allocates, counted
  op by op (a dispatch mode that tracks every tensor the ops create until it dies), peak at the
  planner's trajectory term plus one step's working set. On 849bed7 the per-step lists and their
  ``torch.stack`` copies held it twice: a peak of 68 step-latents for a 33-latent trajectory.
- Under ``compile_mode: reduce-overhead`` a compiled forward returns a CUDA-graph buffer that its
  next replay overwrites. Simulated on CPU: the transformer returns one tensor per output shape,
  overwritten at every call. Sampling in several forward batches per step (FLUX) and Wan's sequential
  two-pass CFG must give exactly what they give with fresh outputs (on 849bed7 both kept an output
  across the next forward and changed)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from digenrl.algorithms.sde import sample
from tests.helpers import TINY


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the block that are alive at once (storages counted once)."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, list] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.alive.setdefault(storage.data_ptr(), []).append((weakref.ref(t), storage.nbytes()))
        live = 0
        for ptr, refs in list(self.alive.items()):
            refs[:] = [r for r in refs if r[0]() is not None]
            if refs:
                live += refs[0][1]
            else:
                del self.alive[ptr]
        self.peak = max(self.peak, live)
        return out


class HalfVelocity:
    """A stand-in model (v = x / 2): the bytes counted are sampling's own, not a transformer's."""

    def velocity(self, x, sigma, cond):
        return x * 0.5

    def sigma_input(self, sigma):  # (as Adapter.sigma_input: on the device, here the CPU)
        return sigma


def test_sampling_peak_is_the_planners_trajectory_term():
    from digenrl.config.run import load_config
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.params import CostParams
    from digenrl.planner.workload import Workload

    cfg = load_config(None, [*TINY, "sampling.steps=16"])
    model = MemoryModel(Workload.from_config(cfg), CostParams())
    shape = Workload.from_config(cfg).shape.tokens.latent_elements
    b, n = 4, cfg.sampling.steps
    noise = torch.randn(b, shape)
    step = noise.numel() * noise.element_size()  # one step's latents of the batch
    with LiveBytes() as live:
        traj = sample(
            HalfVelocity(), None, noise, torch.linspace(1, 0, n + 1), "flow_grpo", 0.7, torch.Generator()
        )
    held = sum(t.numel() * t.element_size() for t in (traj.latents, traj.noise, traj.log_probs))
    assert held == model.trajectory_bytes(b)  # x_0..x_N, N noises, N log-probs: (2N + 1) latents
    # a step's working set: the next input, the noise draw, v, the mean's temporaries (~9 latents here)
    assert model.trajectory_bytes(b) <= live.peak <= model.trajectory_bytes(b) + 12 * step, live.peak / step


def static_outputs(net: nn.Module) -> dict:
    """Make ``net`` return, per output shape, one tensor overwritten at every call (a CUDA graph's
    static output); returns those tensors by shape."""
    forward, buffers = net.forward, {}

    def replay(*args, **kwargs):
        out = forward(*args, **kwargs)[0]
        buf = buffers.setdefault(tuple(out.shape), torch.empty_like(out))
        return (buf.copy_(out),)

    net.forward = replay
    return buffers


def _sample(adapter, batches):
    cond = adapter.encode_prompts(["a red cube", "a blue ball", "a green tree", "a cat"])
    noise = adapter.initial_noise(4, torch.Generator().manual_seed(0))
    sigmas = adapter.sigmas(3)
    return sample(
        adapter, cond, noise, sigmas, "flow_grpo", 0.7, torch.Generator().manual_seed(1), None, batches
    )


@pytest.mark.parametrize(
    "preset,sets",
    [
        ("flux_tiny", []),  # two forward batches of 2 per step: one static buffer
        ("wan_tiny", ["model.frames=1", "sampling.cfg_batching=sequential", "sampling.guidance=4"]),
    ],
)
def test_outputs_overwritten_by_the_next_forward_change_nothing(preset, sets):
    from digenrl.adapters import build_adapter
    from digenrl.config.run import load_config

    cfg = load_config(f"configs/{preset}.yaml", [*sets, "model.height=16", "model.width=16"])
    torch.manual_seed(0)
    adapter = build_adapter(cfg.model, cfg.sampling)
    rows = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    batches = [rows] * 3 if preset == "flux_tiny" else None
    fresh = _sample(adapter, batches)
    buffers = static_outputs(adapter.transformer)
    reused = _sample(adapter, batches)
    assert len(buffers) == 1  # every forward returned the same tensor
    assert torch.equal(reused.latents, fresh.latents)
    assert torch.equal(reused.log_probs, fresh.log_probs)

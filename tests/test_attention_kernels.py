"""Every family's transformer call keeps PyTorch's attention off cuDNN's kernel (model.cudnn_attention
off, the default), whose backward failed on the first train step on an H200 (torch 2.11.0+cu130:
benchmarks/gpu_runs/2026-12-04-h200). CPU cannot run that kernel, so each test records, inside every
``scaled_dot_product_attention`` call the real diffusers classes make, whether cuDNN's kernel was
allowed at that moment (torch's own flag, read as its CUDA dispatcher reads it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import recompute_logprob, sample
from digenrl.config.run import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAMILIES = {  # the edit families inherit flux's and qwen_image's velocity
    "flux": "flux_tiny.yaml",
    "sd3": "sd3_tiny.yaml",
    "wan": "wan_tiny.yaml",
    "wan22": "wan2.2_tiny.yaml",
    "hunyuan_video": "hunyuan_tiny.yaml",
    "qwen_image": "qwen_tiny.yaml",
}


@pytest.fixture
def cudnn_seen(monkeypatch):
    """The list that every attention call appends ``torch.backends.cuda.cudnn_sdp_enabled()`` to."""
    seen, real = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def rollout_and_backward(name: str, *overrides: str) -> None:
    """One sampling step, then the trained step's log-prob and its backward, as the trainer runs it."""
    cfg = load_config(CONFIGS / FAMILIES[name], ["sampling.steps=2", *overrides])
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a red square"])
    noise = torch.randn((1, *ad.latent_shape()), generator=torch.Generator().manual_seed(0))
    sigmas, kind, eta = ad.sigmas(2), cfg.sampling.sde, cfg.sampling.noise_level
    with torch.no_grad():
        traj = sample(ad, cond, noise, sigmas, kind, eta, torch.Generator().manual_seed(1))
    ad.transformer.requires_grad_(True)
    lp, _, _ = recompute_logprob(ad, cond, traj.latents[:, 0], traj.latents[:, 1], sigmas, 0, kind, eta)
    lp.sum().backward()


@pytest.mark.parametrize("name", FAMILIES)
def test_no_family_lets_attention_pick_cudnn(name, cudnn_seen):
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default: what the fix has to override
    rollout_and_backward(name)
    assert cudnn_seen and not any(cudnn_seen), cudnn_seen
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each call: nothing else changed


def test_cudnn_attention_on_gives_torch_its_choice_back(cudnn_seen):
    rollout_and_backward("flux", "model.cudnn_attention=true")
    assert cudnn_seen and all(cudnn_seen)


def test_overlapping_calls_in_two_threads_keep_cudnn_off_until_the_last_one_leaves():
    """A call that ends while another thread's is still running must not switch cuDNN back on under it."""
    import threading

    from digenrl.adapters.attention import attention_kernels

    inside, release = threading.Event(), threading.Event()

    def other():
        with attention_kernels(False):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with attention_kernels(False):
        t.start()
        assert inside.wait(10)
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # this call left, the other thread's has not
    release.set()
    t.join(10)
    assert torch.backends.cuda.cudnn_sdp_enabled()

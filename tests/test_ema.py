"""train.ema: the EMA of the trained weights equals its closed form, survives a resume, and is what
periodic eval, final/ and ``digenrl eval --checkpoint`` use."""

import json

import pytest
import torch
from safetensors.torch import load_file

from digenrl.checkpoint.load import read_weights
from digenrl.config.run import load_config
from digenrl.data.prompts import load_prompts
from digenrl.engine.local import LocalTrainer
from digenrl.policy.model import Policy
from digenrl.rewards import build_reward
from digenrl.run.evaluate import evaluate_policy
from tests.helpers import TINY, cli

SMALL = [
    *TINY,
    "placement.mode=local",
    "output.tensorboard=false",
    "train.lr=2e-2",
]
EMA = ["train.ema={decay: 0.8, every: 2, warmup: true}", "train.optimizer_steps=2"]


def cfg_of(*overrides):
    return load_config(None, [*SMALL, *overrides])


def closed_form(weights: list[dict], decay: float, every: int) -> dict:
    """ema_N = (prod of the applied d_n) w_0 + sum over applied n of (1 - d_n) (prod of the later d_m) w_n,
    in float64; d_n = min(decay, (1 + n) / (10 + n)), applied at the steps n with n % every == 0."""
    applied = [n for n in range(1, len(weights)) if n % every == 0]
    d = {n: min(decay, (1 + n) / (10 + n)) for n in applied}
    later = lambda n: torch.tensor([d[m] for m in applied if m > n], dtype=torch.float64).prod()  # noqa: E731
    out = {}
    for name in weights[0]:
        acc = later(0) * weights[0][name].double()
        for n in applied:
            acc = acc + (1 - d[n]) * later(n) * weights[n][name].double()
        out[name] = acc
    return out


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """3 iterations x 2 optimizer steps with the EMA; the weights after every optimizer step."""
    tmp = tmp_path_factory.mktemp("ema")
    trainer = LocalTrainer(cfg_of("train.iterations=3", "output.checkpoint_every=1", *EMA))
    policy, seen = trainer.policy, []
    seen.append({n: p.detach().clone() for n, p in policy.named_params.items()})
    step = policy.optimizer_step

    def recording(publish=True):
        norm = step(publish)
        seen.append({n: p.detach().clone() for n, p in policy.named_params.items()})
        return norm

    policy.optimizer_step = recording
    result = trainer.run(tmp / "run")
    return trainer, result, seen


def test_ema_equals_the_closed_form_after_n_steps(ema_run):
    trainer, _, seen = ema_run
    ema = trainer.policy.ema
    assert len(seen) == 7 and ema.steps == 6 and trainer.policy.version == 3  # 3 iterations, 6 steps
    expected = closed_form(seen, 0.8, 2)
    for name, value in ema.average.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
    # it is an average, not the trained weights
    assert any(not torch.allclose(ema.average[n], seen[-1][n]) for n in ema.average)


def test_final_and_checkpoint_hold_the_ema(ema_run):
    trainer, result, _ = ema_run
    policy = trainer.policy
    with policy.averaged():
        averaged = policy.weights()
    trained = policy.weights()
    final = read_weights(result.run_dir / "final", lora=True)
    assert final.keys() == averaged.keys()
    assert all(torch.equal(final[k], averaged[k]) for k in final)
    assert any(not torch.equal(final[k], trained[k]) for k in final)
    ckpt = result.run_dir / "checkpoints" / "iter-000003"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["ema"] == {"decay": 0.8, "every": 2, "warmup": True, "steps": 6}
    stored = load_file(ckpt / "ema.safetensors")
    assert all(torch.equal(stored[n], policy.ema.average[n]) for n in stored)
    # the checkpoint's weights are the trained ones (what a resume continues from)
    assert all(torch.equal(read_weights(ckpt, lora=True)[k], trained[k]) for k in trained)


def test_resume_restores_the_ema(ema_run, tmp_path):
    trainer, result, _ = ema_run
    resumed = LocalTrainer(
        cfg_of("train.iterations=3", *EMA), resume=result.run_dir / "checkpoints" / "iter-000001"
    )
    assert resumed.policy.ema.steps == 2
    resumed.run(tmp_path / "fork")
    assert resumed.policy.ema.steps == 6
    for name, value in trainer.policy.ema.average.items():
        assert torch.equal(resumed.policy.ema.average[name], value)


def test_ema_is_off_by_default():
    policy = Policy(cfg_of(), device="cpu")
    assert policy.cfg.train.ema is None and policy.ema is None
    before = {n: p.detach().clone() for n, p in policy.named_params.items()}
    with policy.averaged():  # a no-op
        assert all(torch.equal(p, before[n]) for n, p in policy.named_params.items())


def ema_eval(checkpoint, cfg, prompts, use_ema: bool):
    """Reference: the checkpoint's weights, with its ema.safetensors copied in by hand."""
    policy = Policy(cfg, device="cpu", trainable=False)
    from digenrl.checkpoint.load import load_checkpoint

    load_checkpoint(checkpoint, policy, optimizer=False, rng=False)
    if use_ema:
        average = load_file(checkpoint / "ema.safetensors")
        with torch.no_grad():
            for n, p in policy.named_params.items():
                p.copy_(average[n])
    return evaluate_policy(policy, build_reward(cfg.reward), prompts)


def test_eval_and_periodic_eval_use_the_ema(ema_run, monkeypatch, capsys, tmp_path):
    trainer, result, _ = ema_run
    ckpt = result.run_dir / "checkpoints" / "iter-000003"
    code, out, err = cli(monkeypatch, capsys, "eval", "--checkpoint", str(ckpt), "--out", str(tmp_path / "e"))
    assert code == 0, err
    assert len([line for line in out.splitlines() if "EMA" in line]) == 1
    assert "using the EMA weights of iter-000003 (decay 0.8, every 2 of 6 optimizer steps)" in out
    report = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert report["weights"] == "ema" and report["ema"]["steps"] == 6
    cfg = trainer.cfg.model_copy(deep=True)
    cfg.algorithm.kl_beta = 0.0
    prompts = load_prompts(cfg.prompts)
    with_ema = ema_eval(ckpt, cfg, prompts, True).rewards()["total"]["values"]
    without = ema_eval(ckpt, cfg, prompts, False).rewards()["total"]["values"]
    assert report["rewards"]["total"]["values"] == with_ema != without
    # periodic eval (LocalTrainer.evaluate) samples the EMA weights too
    assert trainer.evaluate()["eval/reward_mean"] == pytest.approx(sum(with_ema) / len(with_ema), abs=1e-6)

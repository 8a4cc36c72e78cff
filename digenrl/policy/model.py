"""The trained policy: an adapter's transformer + LoRA (or full weights) + optimizer + version counter.

One ``Policy`` lives in every process that samples or trains (the local trainer, each Ray worker).
Version k = the weights after k iterations; an iteration takes ``train.optimizer_steps`` optimizer
steps (mini-batch PPO) and only its last one bumps the version.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping

import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.nft import OldPolicy
from digenrl.config.run import RunConfig
from digenrl.distributed.checkpointing import checkpoint_blocks
from digenrl.distributed.fingerprint import fingerprints
from digenrl.distributed.fsdp import clip_grad_norm
from digenrl.distributed.precision import fp32_master
from digenrl.distributed.staged import digest, sync_targets
from digenrl.errors import UserError, WeightSyncError
from digenrl.policy.ema import WeightAverage, swapped_in
from digenrl.policy.lora import apply_lora, checksum, full_tensor, load_lora_state_dict, lora_state_dict
from digenrl.policy.settings import single_process_settings


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda requested but no CUDA device is visible")
    return torch.device(name)


class Policy:
    def __init__(
        self,
        cfg: RunConfig,
        device: torch.device | str | None = None,
        trainable: bool = True,
        generates: bool = True,
        layout=None,
    ):
        """``generates=False``: a lean trainer rank (a checkpoint's transformer is loaded alone);
        ``layout``: the run's (:mod:`digenrl.placement.layout`), whose resolved settings this policy runs with
        (None: a policy outside a run, with a single process's settings)."""
        self.cfg = cfg
        # the run layout's settings (digenrl.placement.layout), else a single process's
        self.settings = settings = layout.settings if layout is not None else single_process_settings(cfg)
        self.device = torch.device(device) if device is not None else pick_device(cfg.train.device)
        # the CFG passes batched or one at a time for this role, and the VAE's tiling, as resolved
        sampling = cfg.sampling.model_copy(
            update={"cfg_batching": settings.cfg_batching(trainable), "vae_tiling": settings.vae_tiling}
        )
        # a rank that the layout shards creates its fp32 masters, KL reference, EMA and old policy on its
        # shards (distributed.fsdp.shard_policy): never a full-size copy of them on a sharded rank; and
        # its transformer stays in host memory until sharding moves it to the device, block by block
        self.shard_pending = trainable and layout is not None and layout.will_shard("trainer")
        self.adapter = build_adapter(cfg.model, sampling, self.device, generates, self.shard_pending)
        net = self.adapter.transformer
        self.lora = cfg.model.lora is not None
        if self.lora:
            self.lora_targets = apply_lora(net, cfg.model.lora, self.adapter.default_lora_targets)
        else:
            net.requires_grad_(True)
        self._ref = None  # the KL reference of a full fine-tune: a frozen module, or (sharded) its shards
        if trainable and settings.activation_checkpointing:
            checkpoint_blocks(net)
        self.optimizer = None
        self.ema: WeightAverage | None = None  # train.ema: on the trainer only
        self.old = None  # diffusion_nft: the old policy (an EMA of the trained weights), on trainer ranks
        if trainable and not self.shard_pending:
            # full FT: the KL (online DPO: its reference) needs a frozen copy, on the ranks that train only
            if not self.lora and (cfg.algorithm.kl_beta > 0 or cfg.algorithm.name == "online_dpo"):
                self._ref = copy.deepcopy(net).requires_grad_(False)
            fp32_master(net)  # the optimizer steps fp32 masters; compute stays in model.dtype (autocast)
        self.named_params = {n: p for n, p in net.named_parameters() if p.requires_grad}
        self.params = list(self.named_params.values())
        if trainable:
            self.build_optimizer()  # over the shards again once sharded (it holds no state before a step)
            if not self.shard_pending:
                self.build_averages()
        self.version = 0

    # ------------------------------------------------------------------ optimisation
    def build_optimizer(self) -> None:
        t = self.cfg.train
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)

    def build_averages(self) -> None:
        """``train.ema`` and diffusion_nft's old policy, fp32, shaped like the trained parameters
        (their shards on a sharded rank)."""
        if self.cfg.train.ema is not None:
            self.ema = WeightAverage(self.named_params, self.cfg.train.ema)
        if self.cfg.algorithm.name == "diffusion_nft":
            self.old = OldPolicy(self.named_params, self.cfg.algorithm.nft)

    def optimizer_step(self, publish: bool = True) -> float:
        """Clip the accumulated gradient, step, zero it, update the EMA; ``publish`` (the iteration's
        last step) bumps the version. Returns the pre-clip grad norm."""
        norm = clip_grad_norm(self.params, self.cfg.train.grad_clip)  # (shards and whole parameters)
        if hasattr(norm, "full_tensor"):  # FSDP2 shards: the norm is a DTensor over the mesh
            norm = norm.full_tensor()
        if not torch.isfinite(norm):  # a step now would write NaN into every weight: refuse it, say why
            self.optimizer.zero_grad(set_to_none=True)
            raise UserError(non_finite_gradient(self.cfg, float(norm), self.version))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        if self.old is not None:  # diffusion_nft: blend the old policy after the iteration's last step
            self.old.step(publish)
        if publish:
            self.version += 1
        return float(norm)

    @contextlib.contextmanager
    def averaged(self):
        """Inside the block the network holds the EMA weights (``train.ema``); without EMA, a no-op."""
        if self.ema is None:
            yield
            return
        with swapped_in(self.named_params, self.ema.average):
            yield

    @contextlib.contextmanager
    def old_weights(self):
        """Inside the block the network holds the old policy's weights (diffusion_nft), for forwards
        without gradient."""
        with self._holding(self.old.average):
            yield

    @contextlib.contextmanager
    def _holding(self, values: dict[str, torch.Tensor]):
        """The trained parameters hold ``values`` inside the block. A sharded network drops its
        gathered copies on the way in and out, so no forward reuses the other weights' gather."""
        net = self.adapter.transformer
        _reshard(net)
        with swapped_in(self.named_params, values):
            try:
                yield
            finally:
                _reshard(net)

    @contextlib.contextmanager
    def reference(self):
        """The KL reference: the same network with LoRA disabled (free), the frozen initial copy, or
        (sharded) the initial weights' shards swapped in."""
        net = self.adapter.transformer
        if isinstance(self._ref, dict):
            with self._holding(self._ref):
                yield
        elif self._ref is not None:
            self.adapter.transformer = self._ref
            try:
                yield
            finally:
                self.adapter.transformer = net
        else:
            net.disable_adapters()
            try:
                yield
            finally:
                net.enable_adapters()

    # ------------------------------------------------------------------ weights (sync, checkpoints)
    def weights(self) -> dict[str, torch.Tensor]:
        """What a weight sync ships: LoRA tensors only with LoRA, all weights otherwise (a frozen
        expert's none: ``staged.sync_targets``)."""
        if self.lora:
            return lora_state_dict(self.adapter.transformer)
        return {
            k: full_tensor(v).detach().cpu().clone()
            for k, v in sync_targets(self.adapter.transformer, lora=False).items()
        }

    def weight_names(self) -> frozenset[str]:
        """The names :meth:`weights` ships, read without copying a tensor (a rank that will shard holds
        its whole transformer in host memory: a copy would double it)."""
        from peft.utils import get_peft_model_state_dict

        net = self.adapter.transformer
        return frozenset(get_peft_model_state_dict(net) if self.lora else sync_targets(net, lora=False))

    def weights_checksum(self) -> str:
        """``checksum(self.weights())`` read one tensor at a time (each gathered in turn when sharded: every
        rank calls it), never a copy of the whole model: a rank that will shard holds it in host memory."""
        if self.lora:
            return checksum(self.weights())
        return checksum(_Gathered(sync_targets(self.adapter.transformer, lora=False)))

    def agreement_digest(self) -> str:
        """A short digest of the trained parameters, fingerprinted on their own device (a sharded
        tensor gathered there first: every rank calls it in the same order); trainer ranks compare it
        after each step. One (n, 3) host copy, where ``checksum(weights())`` copied every byte."""
        names = list(self.named_params)
        return digest(names, fingerprints([full_tensor(p.detach()) for p in self.named_params.values()]))

    def load_weights(
        self, state: dict[str, torch.Tensor], version: int, expected_checksum: str | None = None
    ):
        if self.lora:
            load_lora_state_dict(self.adapter.transformer, state, expected_checksum)
        else:
            net = self.adapter.transformer
            result = net.load_state_dict(state, strict=False)
            shipped = sync_targets(net, lora=False)  # (a frozen expert is not in a sync)
            missing = [k for k in result.missing_keys if k in shipped]
            if missing or result.unexpected_keys:
                raise WeightSyncError(
                    f"weight load mismatch: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
                )
            if expected_checksum is not None:
                own = net.state_dict()
                if all(own[k].dtype == v.dtype for k, v in state.items()):
                    if self.weights_checksum() != expected_checksum:
                        raise WeightSyncError("weight checksum mismatch after load")
                else:  # fp32 masters loaded into a compute-dtype copy: verify what arrived, then the cast
                    if checksum(state) != expected_checksum:
                        raise WeightSyncError("weight checksum mismatch of the received weights")
                    if not all(torch.equal(own[k], v.to(own[k].dtype)) for k, v in state.items()):
                        raise WeightSyncError("weights differ from the received ones after load")
        self.version = version


class _Gathered(Mapping):
    """A state dict whose tensors are gathered whole (``full_tensor``) only when read."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def __getitem__(self, name: str) -> torch.Tensor:
        return full_tensor(self.state[name]).detach()

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def _reshard(net) -> None:
    """Free an FSDP2 model's gathered parameter copies (a no-grad forward leaves the root's gathered)."""
    from torch.distributed.fsdp import FSDPModule

    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def compile_transformer(policy: Policy, mode: str = "default") -> None:
    """``engine.compile_rollout``: ``torch.compile`` the transformer's forward in place (``mode``:
    ``engine.compile_mode``). The module, its parameters, its state-dict keys and its LoRA stay what
    they were, so weight loads and checksums are unchanged; the first forwards of each new shape compile."""
    policy.adapter.transformer.compile(mode=mode, dynamic=None)


def non_finite_gradient(cfg, norm: float, version: int) -> str:
    """The one line for a loss / gradient that overflowed: the fields that most likely caused it."""
    likely = [f"train.lr ({cfg.train.lr:g}) too large"]
    if cfg.model.dtype == "float16":
        likely.append("model.dtype float16 overflowing (try bfloat16)")
    if cfg.algorithm.kl_beta > 0:
        likely.append(f"algorithm.kl_beta ({cfg.algorithm.kl_beta:g})")
    return (
        f"train.lr: the loss or its gradient is not finite (grad norm {norm}) in the update from version "
        f"{version}; the weights were not changed. Most likely: {', or '.join(likely)}"
    )

"""Ulysses sequence parallelism for an unchanged diffusers transformer over one process group.

Details: docs/modules.md, `digenrl.distributed.sequence_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from digenrl.distributed.grad_sync import all_reduce_gradients


def sp_mesh(degree: int, device_type: str = "cpu") -> DeviceMesh:
    """This rank's sequence-parallel mesh (dims ``ring`` = 1, ``ulysses`` = ``degree``, as
    diffusers' context parallelism expects): the default group's ranks form consecutive groups
    of ``degree`` (ranks 0..p-1, p..2p-1, ...). Every rank of the default group must call it."""
    world = dist.get_world_size()
    if degree < 2 or world % degree:
        raise ValueError(f"sequence-parallel degree {degree} must be > 1 and divide the {world} ranks")
    mesh = init_device_mesh(
        device_type, (world // degree, 1, degree), mesh_dim_names=("sp_replica", "ring", "ulysses")
    )
    return mesh["ring", "ulysses"]


def enable_sequence_parallel(transformer: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``transformer`` run sequence-parallel over ``mesh`` (from :func:`sp_mesh`), in place."""
    from diffusers import HunyuanVideoTransformer3DModel

    if mesh["ulysses"].size() < 2:
        raise ValueError("sequence parallelism needs a mesh of at least 2 ranks")
    heads = transformer.config.num_attention_heads
    if heads % mesh["ulysses"].size():
        raise ValueError(f"{heads} attention heads do not split over {mesh['ulysses'].size()} ranks")
    if hasattr(transformer, "experts"):  # two experts by noise level (Wan2.2 A14B): each one
        for expert in transformer.experts():
            enable_sequence_parallel(expert, mesh)
    elif isinstance(transformer, HunyuanVideoTransformer3DModel):
        _enable_hunyuan(transformer, mesh["ulysses"].get_group())
    elif getattr(transformer, "_cp_plan", None) is not None:
        _enable_diffusers_ulysses(transformer, mesh)
    else:
        raise ValueError(f"no sequence-parallel plan for {type(transformer).__name__}")
    transformer.sp_degree = mesh["ulysses"].size()  # what a trimmed text rounds up to (adapters)


def sp_problem(
    transformer_class: str, config: dict, image_tokens: int, text_tokens: int, degree: int
) -> str | None:
    """Why a model (diffusers class name, transformer config, tokens per sample) cannot run over
    ``degree`` ranks, or None: its heads, image tokens and, where the text is split too (joint
    attention), text tokens must divide."""
    if "num_attention_heads" not in config:  # Z-Image: no context-parallel plan in diffusers
        return f"{transformer_class} has no sequence-parallel plan"
    heads = config["num_attention_heads"]
    if heads % degree:
        return f"the model's {heads} attention heads do not split over {degree} devices"
    if image_tokens % degree:
        return (
            f"{image_tokens} image tokens per sample do not split over {degree} devices "
            "(model.height/width/frames)"
        )
    if splits_text(transformer_class) and text_tokens % degree:
        return f"model.max_text_len ({text_tokens}) text tokens do not split over {degree} devices"
    return None


def splits_text(transformer_class: str) -> bool:
    """Whether the sequence split covers the text tokens too (joint attention: all but Wan)."""
    import diffusers

    if transformer_class == "HunyuanVideoTransformer3DModel":
        return True
    plan = getattr(getattr(diffusers, transformer_class), "_cp_plan", None) or {}
    return any(isinstance(entry, dict) and "encoder_hidden_states" in entry for entry in plan.values())


def sum_gradients(params: list[torch.Tensor], mesh: DeviceMesh) -> int:
    """Sum the sequence-parallel group's gradient contributions (each rank: its own tokens')."""
    return all_reduce_gradients(params, group=mesh["ulysses"].get_group())


# ---------------------------------------------------------------------- diffusers' context parallelism
def _enable_diffusers_ulysses(transformer: nn.Module, mesh: DeviceMesh) -> None:
    """diffusers' context parallelism with this mesh and the model's ``_cp_plan``: what
    ``ModelMixin.enable_parallelism`` does, with the model's own device (it derives one as the
    global rank modulo the accelerator count, which divides by zero on a CPU-only host)."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig

    cp = ContextParallelConfig(ulysses_degree=mesh["ulysses"].size(), mesh=mesh)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), dist.get_world_size(), next(transformer.parameters()).device, mesh=mesh)
    transformer._parallel_config = config
    for module in transformer.modules():  # the attention processors read it to do the all-to-alls
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(transformer, cp, transformer._cp_plan)


# ---------------------------------------------------------------------- Ulysses all-to-all, written here
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over equal chunks of dim 0: chunk ``s`` goes to rank ``s``. The
    exchange is a permutation of chunks whose transpose is the same exchange, so it is its own
    backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, n, H, D), this rank's n tokens -> (B, p*n, H/p, D): every rank's tokens (in rank
    order), this rank's block of heads."""
    p = dist.get_world_size(group)
    b, n, h, d = x.shape
    chunks = x.reshape(b, n, p, h // p, d).permute(2, 0, 1, 3, 4)  # chunk s: head block s -> rank s
    return _AllToAll.apply(chunks, group).permute(1, 0, 2, 3, 4).reshape(b, p * n, h // p, d)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: (B, p*n, H/p, D) -> (B, n, H, D)."""
    p = dist.get_world_size(group)
    b, pn, hp, d = x.shape
    chunks = x.reshape(b, p, pn // p, hp, d).permute(1, 0, 2, 3, 4)  # chunk s: rank s's tokens
    return _AllToAll.apply(chunks, group).permute(1, 2, 0, 3, 4).reshape(b, pn // p, p * hp, d)


def ulysses_attention(q, k, v, key_valid: torch.Tensor | None, group) -> torch.Tensor:
    """Full attention for this rank's tokens: q, k, v (B, n, H, D) local; ``key_valid`` (B, p*n)
    bool over the gathered keys (rank order) or None. Returns (B, n, H, D)."""
    q, k, v = (seq_to_heads(t, group).transpose(1, 2) for t in (q, k, v))
    mask = None if key_valid is None else key_valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return heads_to_seq(out.transpose(1, 2), group)


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim``. Backward keeps this rank's slice: every rank computes the same
    loss from the gathered tensor, so its gradient is the same on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.world = dim, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.world, ctx.dim)[ctx.rank].contiguous(), None, None


def _local(x: torch.Tensor, dim: int, group, what: str) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim``."""
    p = dist.get_world_size(group)
    if x.shape[dim] % p:
        raise ValueError(f"{x.shape[dim]} {what} do not split over {p} sequence-parallel ranks")
    return x.chunk(p, dim)[dist.get_rank(group)]


# ---------------------------------------------------------------------- HunyuanVideo
class _HunyuanState:
    """What the attention processors share during one forward: the group and the prompt's
    valid-token flags (the transformer reads only the mask's sum: a left-aligned prefix)."""

    def __init__(self, group):
        self.group = group
        self.text_valid: torch.Tensor | None = None  # (B, L) bool, the whole prompt

    def key_valid(self, image_tokens: int) -> torch.Tensor:
        """Valid flags of the gathered keys: rank s contributes [its image tokens, its text slice]."""
        p = dist.get_world_size(self.group)
        valid = self.text_valid
        ones = valid.new_ones(valid.shape[0], image_tokens)
        return torch.cat([torch.cat([ones, text], 1) for text in valid.chunk(p, 1)], 1)


class HunyuanUlyssesProcessor:
    """HunyuanVideo's joint attention over a sequence split: image and text streams project
    (double-stream blocks: each its own projections; single-stream: shared), QK-normalise per
    head and rotate the image tokens, then attend jointly over every rank's tokens through
    :func:`ulysses_attention`, padded text keys masked."""

    def __init__(self, state: _HunyuanState):
        self.state = state

    @staticmethod
    def _project(attn, x, to_q, to_k, to_v, norm_q, norm_k):
        q, k, v = (proj(x).unflatten(2, (attn.heads, -1)) for proj in (to_q, to_k, to_v))
        return (norm_q(q) if norm_q is not None else q), (norm_k(k) if norm_k is not None else k), v

    def _streams(self, attn, image, text):
        """(q, k, v) of the image tokens and of the text tokens, each (B, n, H, D)."""
        if attn.add_q_proj is None:  # single-stream block: one projection over [image; text]
            qkv = self._project(
                attn, torch.cat([image, text], 1), attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k
            )
            n = image.shape[1]
            return tuple(t[:, :n] for t in qkv), tuple(t[:, n:] for t in qkv)
        img = self._project(attn, image, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
        txt = self._project(
            attn,
            text,
            attn.add_q_proj,
            attn.add_k_proj,
            attn.add_v_proj,
            attn.norm_added_q,
            attn.norm_added_k,
        )
        return img, txt

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
    ):
        from diffusers.models.embeddings import apply_rotary_emb

        # attention_mask (built from the local lengths) is not used: the state has the whole prompt's
        n = hidden_states.shape[1]
        (qi, ki, vi), txt = self._streams(attn, hidden_states, encoder_hidden_states)
        if image_rotary_emb is not None:  # this rank's rows of the RoPE table
            qi, ki = (apply_rotary_emb(t, image_rotary_emb, sequence_dim=1) for t in (qi, ki))
        q, k, v = (torch.cat([a, b], 1) for a, b in zip((qi, ki, vi), txt))
        out = ulysses_attention(q, k, v, self.state.key_valid(n), self.state.group).flatten(2, 3).to(q.dtype)
        image, text = out[:, :n], out[:, n:]
        if getattr(attn, "to_out", None) is not None:
            image = attn.to_out[1](attn.to_out[0](image))
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        return image, text


def _enable_hunyuan(transformer: nn.Module, group) -> None:
    """Hooks that split the image tokens (``x_embedder``), the RoPE table (``rope``) and the
    refined text (``context_embedder``), gather the output (``proj_out``), record the prompt mask,
    and the Ulysses processor in every double- and single-stream block."""
    if transformer.config.get("image_condition_type") is not None:
        raise ValueError("sequence parallelism: HunyuanVideo image-to-video (token replace) is not supported")
    state = _HunyuanState(group)

    def record_mask(module, args, kwargs):
        mask = kwargs["encoder_attention_mask"] if "encoder_attention_mask" in kwargs else args[3]
        length = mask.sum(1, keepdim=True)
        state.text_valid = torch.arange(mask.shape[1], device=mask.device)[None] < length

    transformer.register_forward_pre_hook(record_mask, with_kwargs=True)
    transformer.rope.register_forward_hook(
        lambda m, a, out: tuple(_local(t, 0, group, "image tokens") for t in out)
    )
    transformer.x_embedder.register_forward_hook(lambda m, a, out: _local(out, 1, group, "image tokens"))
    transformer.context_embedder.register_forward_hook(lambda m, a, out: _local(out, 1, group, "text tokens"))
    transformer.proj_out.register_forward_hook(lambda m, a, out: _GatherSeq.apply(out, 1, group))
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        block.attn.set_processor(HunyuanUlyssesProcessor(state))

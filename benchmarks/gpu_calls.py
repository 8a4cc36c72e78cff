"""What one call costs on one device: per-forward and per-train-step seconds of real-width diffusers
transformers at batch 1, 2, 4, 8, 16, eager and compiled, and a Ray actor call's round trip (issue 51:
the fixed costs per forward and per call of the planner's cost model).

    python benchmarks/gpu_calls.py --gpu H200 --json OUT/calls.json
    python benchmarks/gpu_calls.py --tiny --device cpu --batches 1 2 --repeats 1 --json F   (a dry run)

Each family is its published transformer (the adapter's ``published_model``, as planner/shapes.py
costs it) at its config's token count (configs/: SD3.5-M and FLUX.1-dev at 512 px, Wan2.1-14B at
240p x 33 frames) with a few blocks in the published mix (FAMILIES), random init, bf16 weights called
under the adapters' autocast on CUDA (fp32 on CPU); eager rows also at half as many blocks, so the
fold can split the fixed cost into per block and the rest. A forward runs under no_grad; a train step
is forward + backward of every parameter (no optimizer). Compiled: ``torch.compile`` of each block
(``--compile-scope blocks``: a block class compiles once) or of the whole transformer as
``engine.compile_rollout`` does (``model``); batches rise, so batch 1 compiles static and batch 2 once
with a dynamic batch. Per model: aten ops one eager forward dispatches and, on CUDA, device kernels
one forward launches (torch.profiler, batch 1). Most needed first: eager rows, the Ray round trip,
compiled forwards, compiled train steps; a row that would start after ``--budget`` seconds is skipped
and named (the call ends within ~4 minutes). The JSON is rewritten after each series.
benchmarks/fold_gpu_check.py folds the rows into fixed seconds per forward and seconds per sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# family -> (real-scale config, tiny config, the blocks to run: full, half)
FAMILIES = {
    "sd3": (
        "sd3.5_medium.yaml",
        "sd3_tiny.yaml",
        dict(num_layers=4, dual_attention_layers=[0, 1]),
        dict(num_layers=2, dual_attention_layers=[0]),
    ),
    "flux": (
        "flux1_dev.yaml",
        "flux_tiny.yaml",
        dict(num_layers=2, num_single_layers=4),
        dict(num_layers=1, num_single_layers=2),
    ),
    "wan": ("wan2.1_t2v_14b_240p.yaml", "wan_tiny.yaml", dict(num_layers=2), dict(num_layers=1)),
}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def median_call(dev, fn, repeats: int, warmups: int = 1) -> tuple[float, float]:
    """(median seconds of ``repeats`` calls, seconds of the ``warmups`` calls before: compilation)."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(warmups):
        fn()
    sync(dev)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def blocks_of(config: dict) -> int:
    return config["num_layers"] + config.get("num_single_layers", 0)


def family_spec(family: str, tiny: bool, half: bool = False) -> dict:
    """The model to build and what the rows record of it: configs, latent shape, tokens, blocks
    (``half``: half as many blocks, whose rows split the fixed cost into per block and the rest)."""
    from digenrl.adapters import adapter_class
    from digenrl.adapters.cost_hooks import hidden_size
    from digenrl.config.run import load_config

    real, small, full_blocks, half_blocks = FAMILIES[family]
    cfg = load_config(ROOT / "configs" / (small if tiny else real), [])
    adapter = adapter_class(cfg.model.adapter)
    published = adapter.published_model(cfg.model)
    config, vae = adapter.presets[cfg.model.preset] if tiny else (published.transformer, published.vae)
    config = {**config, **(half_blocks if half else full_blocks)}
    tokens = adapter.tokens(cfg.model, config, vae)
    grid = adapter.grid(cfg.model, adapter.vae_factors(vae)[0]) if family == "flux" else None
    return {
        "family": family,
        "class": adapter.transformer_class,
        "config_file": f"configs/{small if tiny else real}",
        "published": published.label,
        "published_blocks": blocks_of(published.transformer),
        "blocks_run": blocks_of(config),
        "hidden": hidden_size(config),
        "image_tokens": tokens.x,
        "text_tokens": tokens.text,
        "tokens": tokens.x + tokens.text,
        "config": config,
        "latent": list(adapter.latent_shape_for(cfg.model, config, vae)),
        "grid": grid,
    }


def build(spec: dict, dev, dtype):
    import diffusers

    torch.manual_seed(0)
    with torch.device(dev):
        model = getattr(diffusers, spec["class"])(**spec["config"])
    keep = getattr(model, "_keep_in_fp32_modules", None) or []  # as from_pretrained(torch_dtype=) keeps
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not any(m in name.split(".") for m in keep):
            t.data = t.data.to(dtype)
    return model


def inputs(family: str, spec: dict, batch: int, dev, dtype) -> dict:
    """One call's inputs, with the dtypes the family's adapter passes (digenrl/adapters/)."""
    g = torch.Generator().manual_seed(batch)
    c, text = spec["config"], spec["text_tokens"]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    sigma = torch.rand(batch, generator=g).to(dev)
    if family == "flux":
        rows, cols = spec["grid"]
        ids = torch.zeros(rows, cols, 3)
        ids[..., 1], ids[..., 2] = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
        return dict(
            hidden_states=rand(batch, *spec["latent"]),
            encoder_hidden_states=rand(batch, text, c["joint_attention_dim"]),
            pooled_projections=rand(batch, c["pooled_projection_dim"]),
            timestep=sigma.to(dtype),
            img_ids=ids.reshape(rows * cols, 3).to(dev),
            txt_ids=torch.zeros(text, 3, device=dev),
            guidance=torch.full((batch,), 3.5, device=dev),
        )
    if family == "sd3":
        return dict(
            hidden_states=rand(batch, *spec["latent"]),
            encoder_hidden_states=rand(batch, text, c["joint_attention_dim"]),
            pooled_projections=rand(batch, c["pooled_projection_dim"]),
            timestep=(sigma * 1000).to(dtype),
        )
    return dict(  # wan: the timestep stays fp32 (WanAdapter.timestep)
        hidden_states=rand(batch, *spec["latent"]),
        timestep=sigma * 1000,
        encoder_hidden_states=rand(batch, text, c["text_dim"]),
    )


def calling(model, dev, dtype):
    """The transformer called as the adapters call it: under ``Adapter.autocast()``'s contexts."""
    import contextlib

    from digenrl.adapters.attention import attention_kernels

    def call(kw):
        mixed = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(dev.type, dtype=dtype)
        with attention_kernels(False), mixed:
            return model(**kw, return_dict=False)[0]

    return call


def step_fn(model, call, kw, kind: str):
    params = [p for p in model.parameters() if p.requires_grad]

    def forward():
        with torch.no_grad():
            call(kw)

    def train_step():
        for p in params:
            p.grad = None
        call(kw).float().square().mean().backward()

    return forward if kind == "forward" else train_step


def aten_ops(call, kw) -> tuple[int, int]:
    """(non-view aten ops, view ops) one eager forward dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = [0, 0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[bool(getattr(func, "is_view", False))] += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        call(kw)
    return seen[0], seen[1]


def profiled_events(fn, kind: str = "CUDA") -> list[str]:
    """Names of the events on device ``kind`` torch.profiler records while ``fn`` runs (CUDA: every
    kernel, memcpy and memset it launches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[getattr(ProfilerActivity, kind)]) as prof:
        fn()
    return [e.name for e in prof.events() if e.device_type == getattr(DeviceType, kind)]


def ray_round_trip(calls: int) -> dict:
    """Median seconds of ``ray.get(actor.noop.remote())`` on a real Ray actor (after 10 warm-up calls)."""
    import ray

    from digenrl.engine.resources import start_local

    started = start_local({})

    @ray.remote(num_cpus=0)
    class Noop:
        def noop(self):
            return None

    actor = Noop.remote()
    try:
        for _ in range(10):
            ray.get(actor.noop.remote())
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(actor.noop.remote())
            times.append(time.perf_counter() - t0)
    finally:
        ray.kill(actor)
        if started:
            ray.shutdown()
    times.sort()
    return {
        "median_s": statistics.median(times),
        "p90_s": times[int(0.9 * (len(times) - 1))],
        "calls": calls,
        "ray": ray.__version__,
        "started_here": started,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument(
        "--repeats", type=int, default=5, help="calls timed per row (after 1 warm-up, compiled 2)"
    )
    ap.add_argument("--ray-calls", type=int, default=200, help="round trips timed (0: no Ray)")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds: later rows are skipped")
    ap.add_argument("--no-half", action="store_true", help="no eager rows at half depth")
    ap.add_argument("--compile-scope", default="blocks", choices=["blocks", "model"])
    ap.add_argument("--compile-mode", default="default", help="engine.compile_mode")
    ap.add_argument("--compile-backend", default="inductor", help="inductor, or eager (a dry run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu", default="H200", help="the GPU type the rows are for (fold_gpu_check.py)")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a dry run of the code on CPU")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    import diffusers

    from digenrl.distributed.blocks import transformer_blocks

    res: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "gpu": args.gpu if dev.type == "cuda" else None,
        "tiny": args.tiny,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "args": vars(args) | {"json": None},
        "models": {},
        "rows": [],
        "ray_call": None,
        "skipped": [],
        "errors": {},
        "seconds": {},
    }

    def save():
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1, default=float))

    def section(name, fn):
        if time.perf_counter() - t_start > args.budget:
            res["skipped"].append(name)
            print(f"gpu_calls: {name} skipped (time bound {args.budget:.0f} s)", flush=True)
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001  (recorded; the other series still run)
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        res["seconds"][name] = time.perf_counter() - t0
        print(f"gpu_calls: {name} done in {res['seconds'][name]:.1f} s", flush=True)
        save()

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)  # every family, shape and grad mode keeps its graphs
    specs = {f: family_spec(f, args.tiny) for f in args.families}  # by name: "flux", "flux/half"
    halves = [] if args.no_half else [f"{f}/half" for f in args.families]
    specs |= {h: family_spec(h.split("/")[0], args.tiny, half=True) for h in halves}
    models = {}

    def prepare(name):
        spec = specs[name]
        models[name] = model = build(spec, dev, dtype)
        ops, views = aten_ops(calling(model, dev, dtype), inputs(spec["family"], spec, 1, dev, dtype))
        res["models"][name] = {k: v for k, v in spec.items() if k not in ("config", "grid")} | {
            "params": sum(p.numel() for p in model.parameters()),
            "aten_ops_per_forward": ops,
            "view_ops_per_forward": views,
            "kernels_per_forward": {},
        }

    def series(name, mode, kind):
        spec, model = specs[name], models[name]
        family = spec["family"]
        call = calling(model, dev, dtype)
        if mode == "compiled" and not getattr(model, "_digenrl_compiled", False):
            for m in transformer_blocks(model) if args.compile_scope == "blocks" else [model]:
                m.compile(backend=args.compile_backend, mode=args.compile_mode, dynamic=None)
            model._digenrl_compiled = True
        for batch in sorted(args.batches):
            if time.perf_counter() - t_start > args.budget:
                res["skipped"].append(f"{name}/{mode}/{kind}/b{batch}: time bound")
                break
            kw = inputs(family, spec, batch, dev, dtype)
            fn = step_fn(model, call, kw, kind)
            try:
                # compiled: a second warm-up call (dynamo's second graph for a new batch may
                # compile on the call after the one that made the batch dynamic)
                median, warm = median_call(dev, fn, args.repeats, 2 if mode == "compiled" else 1)
            except torch.OutOfMemoryError:  # the largest batches may not fit: a limit, not a failure
                res["skipped"].append(f"{name}/{mode}/{kind}/b{batch}: out of memory")
                del kw, fn
                break
            row = dict(family=family, mode=mode, kind=kind, batch=batch, median_s=median, warmup_s=warm)
            keys = ("blocks_run", "published_blocks", "hidden", "tokens")
            res["rows"].append(row | {k: spec[k] for k in keys})
            kernels = res["models"][name]["kernels_per_forward"]
            if kind == "forward" and batch == min(args.batches) and dev.type == "cuda":
                try:  # a profiler that cannot start (no CUPTI) costs the count, not the rows
                    kernels[mode] = len(profiled_events(lambda f=fn: (f(), sync(dev))))
                except Exception as exc:  # noqa: BLE001
                    res["models"][name]["kernels_error"] = f"{type(exc).__name__}: {exc}"
            del kw, fn
        for p in model.parameters():
            p.grad = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for name in specs:
        section(f"{name}/build", lambda n=name: prepare(n))

    def all_series(names, mode, kind):
        for name in [n for n in names if n in models] if mode in args.modes else []:
            section(f"{name}/{mode}/{kind}", lambda n=name: series(n, mode, kind))

    for names in (args.families, halves):  # eager: full depth, then half (the per-block split)
        all_series(names, "eager", "forward")
        all_series(names, "eager", "train_step")
    if args.ray_calls > 0:
        section("ray_call", lambda: res.update(ray_call=ray_round_trip(args.ray_calls)))
    all_series(args.families, "compiled", "forward")
    all_series(args.families, "compiled", "train_step")
    res["seconds"]["total"] = time.perf_counter() - t_start
    print(json.dumps({k: v for k, v in res.items() if k != "args"}, indent=1, default=float))
    save()
    sys.exit(1 if res["errors"] else 0)


if __name__ == "__main__":
    main()

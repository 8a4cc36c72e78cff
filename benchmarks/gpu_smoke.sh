#!/usr/bin/env bash
# The GPU check: what the planner's defaults need measured, then 2 iterations of the tiny FLUX on CUDA
# through Ray, checked. Sized to finish within ~8 minutes on one GPU (BUDGET seconds: a part that
# would start after BUDGET - 60 s is skipped and reported).
#
#   bash benchmarks/gpu_smoke.sh [OUT_DIR]          (exits non-zero if any part failed)
#   DEVICE=cpu bash benchmarks/gpu_smoke.sh OUT     (a dry run of every part at tiny sizes, any machine:
#                                                    its numbers mean nothing)
#   PARTS="dedicated fold" ...                      (only these parts; default: all, in this order)
#   PARTS="calls fold" ...                          (the call costs alone: one GPU call of ~4 minutes)
#
# Parts (each prints "NAME: ok (S s)" / "NAME: FAILED"; the JSON files land in OUT):
# - dedicated: benchmarks/gpu_dedicated.py -> dedicated.json: per-sample sampling time and MFU at batch
#   1, 2, 4, 8 of a real-width FLUX (the kernel-efficiency curve of digenrl/planner/efficiency.py),
#   compiled vs eager sampling (engine.compile_rollout), a model reward's seconds per image on the
#   device (PickScore ViT-H/14, CLIPScore ViT-L/14, random init);
# - realwidth: benchmarks/gpu_realwidth.py -> realwidth.json: the same FLUX's peak memory per phase vs
#   the static prediction, rollout step vs FluxPipeline, train step and MFU with and without
#   activation checkpointing, fingerprint / packing bandwidth, the on-policy ratio on GPU kernels;
# - calls: benchmarks/gpu_calls.py -> calls.json: seconds per forward and per train step at batch 1, 2,
#   4, 8, 16 of SD3.5-M's, FLUX.1-dev's and Wan2.1-14B's transformers at their published widths (a few
#   blocks each), eager and compiled, their kernels per forward, and a Ray actor call's round trip
#   (the fixed costs per forward and per call of the planner's cost model, issue 51; within ~4 minutes);
# - fold: benchmarks/fold_gpu_check.py -> fold.json: each planner default the files measure, its
#   value now and the measured one (docs/real_scale.md, "The GPU check, and folding it into the planner"), and
#   calls.json's fixed seconds per forward and seconds per sample (``call_costs``);
# - colocated / disaggregated: `digenrl train` of the tiny FLUX, colocated on every visible GPU (>= 2
#   GPUs: the nccl all-reduce), and with >= 2 GPUs disaggregated (1 rollout GPU + the rest as
#   trainer ranks, GAP, TAG, TSP, one-step async: the weight sync between GPU workers); each run
#   must leave 2 metrics rows, timeline.json / .png and final weights;
# - train_variants: benchmarks/gpu_train_variants.py -> train_variants.json: the same FLUX's train step
#   with fp32 masters and with LoRA (attention off cuDNN's kernel, the default), and once with
#   model.cudnn_attention on (its backward failed on the first GPU run; reported, not counted);
# - fsdp_dtype: benchmarks/gpu_fsdp_dtype.py -> fsdp_dtype.json: one FSDP2 rank (NCCL, world size 1) of
#   the real-width FLUX in bf16: the root's inputs and the blocks' rotary tables keep their dtypes, the
#   sharded velocity equals the unsharded one bit for bit;
# - shared: two processes on one GPU -- a disaggregated `digenrl` run whose rollout worker and trainer
#   rank both use GPU 0 (Ray shown two logical GPUs, CUDA_VISIBLE_DEVICES left alone), weights through
#   the Ray object store (the broadcast's fallback path): 2 metrics rows, every sync by object store;
# - gpu_ready: benchmarks/gpu_ready.py -> gpu_ready.json: every family's bf16 timestep and guidance as its
#   diffusers pipeline passes them (dtype and bits), and Wan2.2's experts run in the same order on the
#   FSDP2 shares of a unit whose rows need different experts (issue 53);
# - profile: `digenrl profile --device cuda` -> profile.json (`digenrl plan --profile`).
# GPUs are counted as this process sees them: nvidia-smi's, narrowed by CUDA_VISIBLE_DEVICES when set.
# On one GPU the script says what it cannot check (NCCL between ranks needs two).
set -uo pipefail

OUT=${1:-${OUT:-$(mktemp -d)}}
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
PARTS=${PARTS:-dedicated realwidth train_variants fsdp_dtype gpu_ready calls fold colocated shared disaggregated profile}
BUDGET=${BUDGET:-480}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"

if [ "$DEVICE" = cpu ]; then  # the dry run: tiny widths, logical CPU devices
  NGPU=${NGPU:-2}
  KIND=cpu
  POOL_DEVICE=cpu
  DEDICATED=(--tiny --device cpu --double 1 --single 1 --steps 2 --repeats 1 --curve-batches 1 2
             --compile-backend eager --compile-batch 2 --reward-images 2)
  REALWIDTH=(--tiny --device cpu --double 1 --single 1 --batch 1 --steps 2)
  FSDP_DTYPE=(--tiny --device cpu --double 1 --single 1)
  TRAIN_VARIANTS=(--tiny --device cpu --double 1 --single 1 --steps 2 --batch 1 --variants cudnn)
  GPU_READY=(--device cpu --families flux wan22)
  CALLS=(--tiny --device cpu --batches 1 2 --repeats 1 --modes eager --ray-calls 0)
else
  visible_gpus() {  # the GPUs this process may use: nvidia-smi's, narrowed by CUDA_VISIBLE_DEVICES when set
    local listed ids id n=0
    listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ -z "${CUDA_VISIBLE_DEVICES+set}" ]; then echo "${listed:-0}"; return; fi
    IFS=, read -ra ids <<< "${CUDA_VISIBLE_DEVICES// /}"
    for id in "${ids[@]}"; do  # CUDA stops at the first entry that names no device (-1, empty)
      if [ -z "$id" ] || [[ "$id" == -* ]]; then break; fi
      n=$(( n + 1 ))
    done
    echo $(( n < ${listed:-0} ? n : ${listed:-0} ))
  }
  NGPU=$(visible_gpus)
  if [ "${NGPU:-0}" -lt 1 ]; then
    echo "gpu_smoke: no GPU visible (nvidia-smi -L, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})" >&2
    exit 1
  fi
  FIRST_GPU=${CUDA_VISIBLE_DEVICES:+${CUDA_VISIBLE_DEVICES%%,*}}
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader ${FIRST_GPU:+-i "$FIRST_GPU"} | head -1)
  case "$GPU_NAME" in *H200*) KIND=H200;; *H100*) KIND=H100;; *H800*) KIND=H800;; *A100*) KIND=A100;; *H20*) KIND=H20;; *) KIND=H100;; esac
  POOL_DEVICE=gpu
  DEDICATED=(--gpu "$KIND")
  REALWIDTH=(--gpu "$KIND")
  FSDP_DTYPE=(--device cuda)
  TRAIN_VARIANTS=(--gpu "$KIND" --variants fp32_master lora cudnn)
  GPU_READY=(--device cuda)
  CALLS=(--gpu "$KIND")
fi
echo "gpu_smoke: $NGPU $DEVICE device(s) ($KIND); output in $OUT; parts: $PARTS"
if [ "$NGPU" -lt 2 ]; then  # say plainly what one device cannot check
  echo "gpu_smoke: one device: NCCL between ranks (FSDP2 all-gather / reduce-scatter, the NCCL weight" \
       "broadcast, a lost NCCL peer) and the disaggregated run need 2 GPUs and are NOT checked here;" \
       "one device checks its memory against the static prediction, compile and the on-policy ratio" \
       "in the trainer's grad mode (realwidth, dedicated), one FSDP2 rank's dtypes (fsdp_dtype) and two" \
       "processes sharing the GPU through the object store (shared)"
fi

FAILED=()
part() {  # part NAME COMMAND...: run it if PARTS lists it and the budget allows; record a failure
  local name=$1 t0=$SECONDS; shift
  if [[ " $PARTS " != *" $name "* ]]; then return 0; fi
  if [ "$SECONDS" -gt $(( BUDGET - 60 )) ]; then
    echo "$name: skipped (time budget: ${SECONDS} s of ${BUDGET} s used)"; FAILED+=("$name(skipped)"); return 0
  fi
  if "$@"; then echo "$name: ok ($(( SECONDS - t0 )) s)"; else echo "$name: FAILED ($(( SECONDS - t0 )) s)" >&2; FAILED+=("$name"); fi
}

COMMON=(train.device="$DEVICE" train.iterations=2 train.prompts_per_iteration=4 engine.unit_groups=1
        model.height=32 model.width=32 sampling.steps=8 algorithm.group_size=8)
if [ "$DEVICE" = cpu ]; then  # the dry run's runs at the test suite's tiny size (tests/helpers.py TINY)
  COMMON+=(train.prompts_per_iteration=2 model.height=16 model.width=16 sampling.steps=4 algorithm.group_size=4)
fi

train() {  # train NAME override...
  local name=$1; shift
  local sets=()
  for kv in "${COMMON[@]}" "$@"; do sets+=(--set "$kv"); done
  if command -v digenrl >/dev/null && digenrl train --help >/dev/null 2>&1; then
    digenrl train "${sets[@]}" --run-dir "$OUT/$name" || return 1
  else  # no console script: call the engine directly
    "$PY" - "$OUT/$name" "$@" "${COMMON[@]}" <<'EOF' || return 1
import sys
from digenrl.config.run import load_config
from digenrl.launch import run_engine
run_engine(load_config(None, sys.argv[2:]), run_dir=sys.argv[1])
EOF
  fi
  check_run "$OUT/$name"
}

check_run() {  # check_run RUN_DIR: two metrics rows, the timeline, final weights
  "$PY" - "$1" <<'EOF'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
assert [r["iteration"] for r in rows] == [0, 1], rows
for name in ("timeline.json", "timeline.png", "config.yaml"):
    assert (run / name).is_file(), name
assert any((run / "final").iterdir()), "no final weights"
trace = json.loads((run / "timeline.json").read_text())["traceEvents"]
kinds = {e["args"]["kind"] for e in trace if e["ph"] == "X"}
assert {"rollout", "train", "step"} <= kinds, kinds
print(f"{run.name}: {rows[-1]['samples_per_s']:.1f} samples/s, bubble {rows[-1]['bubble_fraction']:.0%}, "
      f"reward {rows[-1]['reward_mean']:.3f}")
EOF
}

disaggregated() {
  if [ "$NGPU" -lt 2 ]; then echo "disaggregated: needs 2 devices, $NGPU visible"; return 0; fi
  local tsp=$(( NGPU - 1 < 2 ? 1 : 2 ))
  train disaggregated placement.mode=disaggregated \
    "cluster.pools=[{name: rollout, device: $POOL_DEVICE, count: 1}, {name: trainer, device: $POOL_DEVICE, count: $((NGPU - 1))}]" \
    engine.gap=true engine.tag=true engine.tsp_degree=$tsp engine.max_staleness=1
}

shared() {  # two processes on one GPU: rollout worker and trainer rank on GPU 0, weights by object store
  RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 "$PY" - "$OUT/shared" "$DEVICE" "$POOL_DEVICE" "${COMMON[@]}" \
    <<'EOF' || return 1
import json, pathlib, sys
import ray
from digenrl.config.run import load_config
from digenrl.launch import run_engine
run_dir, device, pool = sys.argv[1:4]
quiet = dict(include_dashboard=False, logging_level="WARNING")
if device == "cuda":  # one GPU shown to Ray as two, CUDA_VISIBLE_DEVICES left alone: both on GPU 0
    ray.init(num_gpus=2, **quiet)
else:  # the dry run: logical CPU devices
    ray.init(num_cpus=2, resources={"pool:rollout": 1, "pool:trainer": 1}, **quiet)
pools = f"cluster.pools=[{{name: rollout, device: {pool}, count: 1}}, {{name: trainer, device: {pool}, count: 1}}]"
sets = [*sys.argv[4:], "placement.mode=disaggregated", "engine.weight_sync=object_store", "engine.tag=false", pools]
run_engine(load_config(None, sets), run_dir=run_dir)
ray.shutdown()
trace = json.loads((pathlib.Path(run_dir) / "timeline.json").read_text())["traceEvents"]
syncs = [e["args"] for e in trace if e.get("ph") == "X" and e["args"]["kind"] == "sync"]
assert syncs and {s["transport"] for s in syncs} == {"object_store"}, syncs
print(f"shared: {len(syncs)} weight syncs through the object store, both workers on {device}")
EOF
  check_run "$OUT/shared"
}

profile() {
  digenrl profile --device "$DEVICE" --out "$OUT/profile.json" && test -s "$OUT/profile.json"
}

part dedicated timeout 240 "$PY" "$HERE/gpu_dedicated.py" "${DEDICATED[@]}" --json "$OUT/dedicated.json"
part realwidth timeout 180 "$PY" "$HERE/gpu_realwidth.py" "${REALWIDTH[@]}" --json "$OUT/realwidth.json"
part train_variants timeout 240 "$PY" "$HERE/gpu_train_variants.py" "${TRAIN_VARIANTS[@]}" --json "$OUT/train_variants.json"
part fsdp_dtype timeout 120 "$PY" "$HERE/gpu_fsdp_dtype.py" "${FSDP_DTYPE[@]}" --json "$OUT/fsdp_dtype.json"
part gpu_ready timeout 240 "$PY" "$HERE/gpu_ready.py" "${GPU_READY[@]}" --json "$OUT/gpu_ready.json"
part calls timeout 240 "$PY" "$HERE/gpu_calls.py" "${CALLS[@]}" --json "$OUT/calls.json"
part fold "$PY" "$HERE/fold_gpu_check.py" "$OUT" --json "$OUT/fold.json"
part colocated train colocated placement.mode=colocated \
  "cluster.pools=[{name: gpus, device: $POOL_DEVICE, count: $NGPU}]" placement.rollout_pool=gpus placement.trainer_pool=gpus \
  engine.max_staleness=0
part shared shared
part disaggregated disaggregated
part profile profile

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_smoke: failed or skipped: ${FAILED[*]} ($SECONDS s)" >&2
  exit 1
fi
echo "gpu_smoke: all ok ($SECONDS s)"

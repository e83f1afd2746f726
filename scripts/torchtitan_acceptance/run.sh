#!/usr/bin/env bash
# torchtitan 0.3.0's own trainer on CPUs (qwen3 debugmodel_moe: 8 MoE layers, 64 experts, top-8;
# FSDP2 over 2 gloo ranks + EP 2, SelectiveAC, AdamW), N steps with torchtitan's own dispatcher and
# N steps with flexdispatch's (--override.imports), same seed; then the per-step loss and grad-norm
# gaps (compare.py). An acceptance run by hand (docs/integrations.md records its results); CI never
# runs it (about half a minute per step on 2 cores).
#
#   bash scripts/torchtitan_acceptance/run.sh              # N=10
#   TT_STEPS=4 TT_FP32=1 bash scripts/torchtitan_acceptance/run.sh
#
#   TT_STEPS    steps per run (default 10)
#   TT_FP32=1   fp32 parameters under FSDP2 (--training.mixed_precision_param float32); default:
#               the config's bf16 parameters
#   TT_WORK     where the assets and logs go (default: a new temporary folder)
#   TT_DEPS     where the trainer's own dependencies go (default ~/.cache/flexdispatch/...)
#   TT_INSTALL=1  install them there when missing (else: print the command)
#   PYTHON      interpreter (default: the venv's python)
#
# The trainer runs through tt_train_cpu.py beside this file, which patches five things in its own
# process before torchtitan starts (none edits an installed file; see its docstring); assets:
# make_assets.py (a tokenizer and a c4_test stand-in made from the standard library's sources).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
PYTHON=${PYTHON:-$root/.venv/bin/python}
steps=${TT_STEPS:-10}
work=${TT_WORK:-$(mktemp -d)}
if [[ ! "$steps" =~ ^[1-9][0-9]{0,4}$ ]]; then
  echo "run.sh: TT_STEPS=$steps is not a number of steps: pass an integer in [1, 99999]" >&2
  exit 2
fi

# The trainer's own dependencies the suite does not need, in a folder of their own put on the
# trainer's PYTHONPATH only: torchtitan 0.3.0 pins datasets<4.8, which pins huggingface-hub<2 (the
# venv's transformers needs 2.x), so they cannot share the venv. torchdata depends on torch:
# --no-deps, or pip would bring a CUDA build.
deps=${TT_DEPS:-${XDG_CACHE_HOME:-$HOME/.cache}/flexdispatch/torchtitan-trainer-deps}
if ! PYTHONPATH="$deps" "$PYTHON" -c 'import datasets, tensorboard, torchdata' >/dev/null 2>&1; then
  install=("$PYTHON" -m pip install -q --target "$deps")
  if [[ "${TT_INSTALL:-0}" == 1 ]]; then
    "${install[@]}" "datasets>=3.6,<4.8" tensorboard
    "${install[@]}" --no-deps torchdata
  else
    echo "run.sh: the trainer needs datasets<4.8, tensorboard and torchdata in $deps (TT_DEPS):" >&2
    echo "  TT_INSTALL=1 bash $0   (or: ${install[*]} 'datasets>=3.6,<4.8' tensorboard && ${install[*]} --no-deps torchdata)" >&2
    exit 2
  fi
fi

mkdir -p "$work"
"$PYTHON" "$here/make_assets.py" "$work" >&2
args=(--module qwen3 --config qwen3_moe_debug --training.steps "$steps" --training.seq_len 128
      --training.local_batch_size 1 --training.disable_cuda_graphs
      --parallelism.expert_parallel_degree 2 --parallelism.data_parallel_shard_degree 2
      --parallelism.spmd_backend partial_dtensor --debug.seed 42 --metrics.log_freq 1
      --hf_assets_path "$work/assets/tokenizer" --dump_folder "$work/outputs")
if [[ "${TT_FP32:-0}" == 1 ]]; then
  args+=(--training.mixed_precision_param float32)
fi
flex=(--override.imports flexdispatch.integrations.torchtitan.flexdispatch_override)

train() {  # name, extra args...: one run, its log in $work/NAME.log; its exit code
  local name=$1 rc=0 t0=$SECONDS
  shift
  echo "== $name ($steps steps)" >&2
  (cd "$work" && PYTHONPATH="$root:$deps${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 \
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 \
    "$here/tt_train_cpu.py" "${args[@]}" "$@" > "$work/$name.log" 2>&1) || rc=$?
  echo "== $name: exit code $rc, $((SECONDS - t0)) s" >&2
  return "$rc"
}
rc=0
train default || rc=1
train flexdispatch "${flex[@]}" || rc=1
grep -h "flexdispatch dispatches on rank 0" "$work/flexdispatch.log" >&2 || true
"$PYTHON" "$here/compare.py" "$work/default.log" "$work/flexdispatch.log" --steps "$steps" || rc=1
echo "logs: $work" >&2
exit "$rc"

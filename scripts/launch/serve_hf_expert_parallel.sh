#!/usr/bin/env bash
# Serve a prompt with a local Hugging Face MoE checkpoint, expert-parallel, on ONE node (torchrun):
# one process per GPU (NCCL), or NPROC_PER_NODE CPU processes over gloo.
#
#   NPROC_PER_NODE=2 scripts/launch/serve_hf_expert_parallel.sh /path/to/ckpt --prompt "Hello"
#   NPROC_PER_NODE=2 scripts/launch/serve_hf_expert_parallel.sh /path/to/ckpt --input-ids 1 2 3 --check
#
# Arguments go to serve_hf_expert_parallel.py (see its docstring: --max-new-tokens, --worst-case,
# --check). Environment as torchrun_single_node.sh: NPROC_PER_NODE (default: GPU count, else 2),
# MASTER_PORT (static rendezvous on 127.0.0.1, else --standalone), FLEXDISPATCH_VENV, PYTHON,
# TORCHRUN, FLEXDISPATCH_DRY_RUN=1 (print the command instead of running it), FLEXDISPATCH_DEVICE=cpu
# (gloo on the CPU even with GPUs visible). More processes than GPUs is refused before torchrun.
set -euo pipefail
# shellcheck source=scripts/launch/_launcher.sh
source "$(dirname "${BASH_SOURCE[0]}")/_launcher.sh"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  NPROC_PER_NODE=$(( gpus > 0 ? gpus : 2 ))
fi
check_port
if [[ -n "${MASTER_PORT:-}" ]]; then
  rdzv=(--nnodes 1 --node-rank 0 --rdzv-backend static --master-addr 127.0.0.1 --master-port "$MASTER_PORT")
else
  rdzv=(--standalone --nnodes 1)
fi
check_devices "$NPROC_PER_NODE"
store_note
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
args=("${launcher[@]}" "${rdzv[@]}" --nproc-per-node "$NPROC_PER_NODE" --max-restarts 0
      "$root/scripts/launch/serve_hf_expert_parallel.py" "$@")
if [[ "${FLEXDISPATCH_DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${args[@]}"; echo
  exit 0
fi
# the agent's pid for its workers (exec keeps this shell's pid: flexdispatch.launch.lifetime)
export FLEXDISPATCH_LAUNCHER_PID=$$
exec "${args[@]}"

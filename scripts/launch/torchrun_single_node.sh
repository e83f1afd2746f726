#!/usr/bin/env bash
# Launch a flexdispatch sub-command on ONE node with torchrun: one process per GPU (NCCL), or
# NPROC_PER_NODE CPU processes over gloo on a machine without GPUs.
#
#   NPROC_PER_NODE=8 scripts/launch/torchrun_single_node.sh                    # flexdispatch demo
#   FLEXDISPATCH_CMD=bench scripts/launch/torchrun_single_node.sh --tokens 4096 # flexdispatch bench
#
# Every worker runs `python -m flexdispatch.cli $FLEXDISPATCH_CMD "$@"`; the sub-command sees the
# launcher's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), joins the
# launcher's process group (NCCL on CUDA, gloo otherwise) and rank 0 prints the report.
#
# Environment:
#   NPROC_PER_NODE    processes on this node (default: the GPU count from nvidia-smi, else 2)
#   FLEXDISPATCH_CMD  sub-command: demo (default), bench, doctor, ...
#   MASTER_PORT       set: static rendezvous on 127.0.0.1:MASTER_PORT; unset: torchrun --standalone
#                     (c10d rendezvous on a free local port; works offline)
#   FLEXDISPATCH_VENV virtual environment (default: <repo>/.venv when it exists)
#   PYTHON            interpreter (default: the venv's python, else python3)
#   TORCHRUN          launcher command (default: the venv's torchrun, else `$PYTHON -m torch.distributed.run`)
#   FLEXDISPATCH_DRY_RUN=1  print the command instead of running it
#   FLEXDISPATCH_DEVICE=cpu gloo on the CPU even with GPUs visible (they are hidden from the workers)
#
# Before torchrun, `python -m flexdispatch.launch.devices` compares NPROC_PER_NODE with the GPUs visible:
# more processes than GPUs is refused with one line (exit 2) naming both and what to pass.
#   GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME  interface of the process-group sockets (default lo:
#                     loopback only; torchrun's rendezvous store itself is not bound, see
#                     docs/security.md: the script says so on stderr before torchrun starts)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun waits for a worker to end after SIGTERM before
#                     SIGKILL when torchrun itself is signalled (default here 5; torchrun's own is
#                     30). For a failed worker group torchrun waits a fixed 30 s instead; a worker
#                     whose collective fails first SIGKILLs the stopped workers of its job, so a
#                     stopped or hung worker ends the job within --timeout plus a few seconds
#
# Every variable above is checked before anything starts (MASTER_PORT 1-65535, NPROC_PER_NODE a
# positive integer, FLEXDISPATCH_CMD a sub-command, PYTHON a Python 3.10+, TORCHRUN a command, the
# interface names real ones): a bad one is one line on stderr naming it, exit 2.
set -euo pipefail
# shellcheck source=scripts/launch/_launcher.sh
source "$(dirname "${BASH_SOURCE[0]}")/_launcher.sh"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  NPROC_PER_NODE=$(( gpus > 0 ? gpus : 2 ))
fi
cmd=${FLEXDISPATCH_CMD:-demo}
check_port
if [[ -n "${MASTER_PORT:-}" ]]; then
  rdzv=(--nnodes 1 --node-rank 0 --rdzv-backend static --master-addr 127.0.0.1 --master-port "$MASTER_PORT")
else
  rdzv=(--standalone --nnodes 1)
fi
check_devices "$NPROC_PER_NODE"
store_note
# One node: the workers' process-group sockets (gloo pairs, NCCL bootstrap) listen on the loopback
# interface only, unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are exported (docs/security.md).
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
args=("${launcher[@]}" "${rdzv[@]}" --nproc-per-node "$NPROC_PER_NODE" --max-restarts 0
      -m flexdispatch.cli "$cmd" "$@")
if [[ "${FLEXDISPATCH_DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${args[@]}"; echo
  exit 0
fi
# the agent's pid for its workers (exec keeps this shell's pid: flexdispatch.launch.lifetime)
export FLEXDISPATCH_LAUNCHER_PID=$$
exec "${args[@]}"

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
#   MASTER_PORT       the port of the rendezvous store this script serves on 127.0.0.1 (unset: a
#                     free one); torchrun joins it (c10d rendezvous; works offline)
#   FLEXDISPATCH_VENV virtual environment (default: <repo>/.venv when it exists)
#   PYTHON            interpreter (default: the venv's python, else python3)
#   TORCHRUN          launcher command (default: the venv's torchrun, else `$PYTHON -m torch.distributed.run`)
#   FLEXDISPATCH_DRY_RUN=1  print the command instead of running it
#   FLEXDISPATCH_DEVICE=cpu gloo on the CPU even with GPUs visible (they are hidden from the workers)
#
# Before torchrun, `python -m flexdispatch.launch.devices` compares NPROC_PER_NODE with the GPUs visible:
# more processes than GPUs is refused with one line (exit 2) naming both and what to pass.
#   GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME  interface of the process-group sockets (default lo:
#                     loopback only; the stores listen on 127.0.0.1 only, see below and
#                     docs/security.md)
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
check_devices "$NPROC_PER_NODE"
# One node, nothing listens beyond the loopback interface (docs/security.md): the workers'
# process-group sockets (gloo pairs, NCCL bootstrap) on lo, unless GLOO_SOCKET_IFNAME /
# NCCL_SOCKET_IFNAME are exported; the stores on 127.0.0.1. torchrun's own stores bind every
# interface (PyTorch's TCPStore, whatever the address given), so this script serves the rendezvous
# store itself on 127.0.0.1 (python -m flexdispatch.launch.store, which ends with torchrun) and
# torchrun joins it as a client; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 keeps torchrun from making a
# second store for the workers, whose own store flexdispatch binds to 127.0.0.1 (rank 0, from
# MASTER_ADDR=127.0.0.1: --local-addr).
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
rdzv_args() {  # rdzv_args PORT: torchrun's rendezvous on the store at 127.0.0.1:PORT
  rdzv=(--nnodes 1 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$1" --rdzv-conf is_host=false
        --rdzv-id "flexdispatch-$$" --local-addr 127.0.0.1)
}
if [[ "${FLEXDISPATCH_DRY_RUN:-0}" == "1" ]]; then
  rdzv_args "${MASTER_PORT:-PORT}"
  args=("${launcher[@]}" "${rdzv[@]}" --nproc-per-node "$NPROC_PER_NODE" --max-restarts 0
        -m flexdispatch.cli "$cmd" "$@")
  printf '%q ' "${args[@]}"; echo
  exit 0
fi
fifo_dir=$(mktemp -d)
mkfifo "$fifo_dir/port"
"$PYTHON" -m flexdispatch.launch.store --port "${MASTER_PORT:-0}" > "$fifo_dir/port" &
store_pid=$!
port=""
read -r -t 120 port < "$fifo_dir/port" || true
rm -rf "$fifo_dir"
if [[ ! "$port" =~ ^[0-9]+$ ]]; then
  kill "$store_pid" 2>/dev/null || true
  exit 2  # NOTE: the store said why (a port in use), in one line
fi
rdzv_args "$port"
args=("${launcher[@]}" "${rdzv[@]}" --nproc-per-node "$NPROC_PER_NODE" --max-restarts 0
      -m flexdispatch.cli "$cmd" "$@")
# the agent's pid for its workers (exec keeps this shell's pid: flexdispatch.launch.lifetime); the
# store, this shell's child, is then torchrun's and ends with it
export FLEXDISPATCH_LAUNCHER_PID=$$
exec "${args[@]}"

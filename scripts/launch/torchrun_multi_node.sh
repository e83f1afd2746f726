#!/usr/bin/env bash
# Launch a flexdispatch sub-command across NODES with torchrun: run this script once on every node
# (by hand, from Slurm's srun -- see slurm_flexdispatch.sbatch -- or in every pod of a Kubeflow
# PyTorchJob -- see k8s_pytorchjob.yaml). R = NNODES * NPROC_PER_NODE ranks, L = NPROC_PER_NODE.
#
#   # node 0                                      # node 1
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 \   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 \
#     scripts/launch/torchrun_multi_node.sh         scripts/launch/torchrun_multi_node.sh
#
# Every worker runs `python -m flexdispatch.cli $FLEXDISPATCH_CMD "$@"`; flexdispatch reads L from
# the launcher's LOCAL_WORLD_SIZE, so hierarchical dispatch and the node-aware byte counts see the
# real node boundaries. Rank 0 (on NODE_RANK 0) prints the report.
#
# Environment:
#   NNODES           number of nodes (default: $PET_NNODES, else 1); with c10d also MIN:MAX, an
#                    elastic job of MIN to MAX nodes (torchrun's --nnodes 1:4)
#   NODE_RANK        this node's index 0..NNODES-1 (default: $PET_NODE_RANK, else 0); static only
#                    (c10d assigns node ranks by arrival: NODE_RANK is neither read nor checked)
#   MASTER_ADDR      address of node 0, reachable from every node (default 127.0.0.1); a host
#                    name, an IPv4 address or an IPv6 one, bracketed ([fd00::1]) or not
#   MASTER_PORT      a free TCP port on node 0 (default 29500)
#   NPROC_PER_NODE   processes per node = GPUs per node (default: $PET_NPROC_PER_NODE, else the
#                    GPU count from nvidia-smi, else 2 CPU processes over gloo)
#   RDZV_BACKEND     static (default: $PET_RDZV_BACKEND, else static: fixed NODE_RANKs, nothing
#                    elastic) or c10d (rendezvous at RDZV_ENDPOINT, node ranks assigned by arrival)
#   RDZV_ENDPOINT    c10d's host:port (default: $PET_RDZV_ENDPOINT, else MASTER_ADDR:MASTER_PORT)
#   RDZV_ID          job id for c10d (default: $PET_RDZV_ID, else flexdispatch)
#   (A Kubeflow elastic PyTorchJob exports PET_NNODES=MIN:MAX, PET_RDZV_BACKEND=c10d and
#   PET_RDZV_ENDPOINT: the recipe reads them as they are.)
#   FLEXDISPATCH_CMD sub-command: demo (default), bench, doctor, ...
#   FLEXDISPATCH_VENV, PYTHON, TORCHRUN, FLEXDISPATCH_DRY_RUN, FLEXDISPATCH_DEVICE: as in
#                    torchrun_single_node.sh (NPROC_PER_NODE > GPUs on this node is refused there)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds before a worker that ignores SIGTERM is SIGKILLed
#                    (default here 5, torchrun's 30), as in torchrun_single_node.sh
#   FLEXDISPATCH_IFNAME  the network interface the ranks talk over (e.g. eth0, ib0): exported as
#                    GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (where those are not set), so the
#                    process-group sockets listen there only (docs/security.md); one node on
#                    127.0.0.1 defaults to lo
#
# Communication settings (export them before this script; they reach every worker):
#   NCCL_SOCKET_IFNAME=eth0          interface for NCCL's bootstrap / socket transport (also set
#                                    GLOO_SOCKET_IFNAME for gloo jobs on CPU clusters)
#   NCCL_IB_HCA=mlx5_0,mlx5_1,...    InfiniBand/RoCE adapters NCCL may use (^mlx5_4 excludes one)
#   NCCL_IB_GID_INDEX=3              RoCE v2 GID index (clusters on RoCE)
#   NCCL_IB_DISABLE=1                no InfiniBand (TCP only), for debugging
#   NCCL_NET_GDR_LEVEL=SYS           allow GPUDirect RDMA across the PCIe topology
#   NCCL_DEBUG=INFO                  print NCCL's transport choice (WARN in production)
#   NVSHMEM_* are read by DeepEP's internode and low-latency kernels (NVSHMEM >= 3.3.9):
#   NVSHMEM_IB_ENABLE_IBGDA=1        GPU-initiated RDMA (DeepEP V1 sets it itself when it needs it)
#   NVSHMEM_IBGDA_NIC_HANDLER=gpu    who rings the NIC doorbell (gpu or auto)
#   NVSHMEM_DISABLE_P2P=1            no NVLink inside NVSHMEM (0 lets low-latency mode use NVLink)
#   NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=eth0   interface of NVSHMEM's UID bootstrap
#   NVSHMEM_HCA_LIST=mlx5_0:1,...    adapters NVSHMEM may use
#   NVSHMEM_DEBUG=INFO               NVSHMEM start-up diagnostics
#   NVSHMEM_DIR=/opt/nvshmem         where DeepEP's build found NVSHMEM (runtime: LD_LIBRARY_PATH)
# `flexdispatch doctor` lists every NCCL_*/NVSHMEM_*/GLOO_* variable a process sees.
# Every variable the script reads is checked before anything starts: a bad one is one line on
# stderr naming it, exit 2.
set -euo pipefail
# shellcheck source=scripts/launch/_launcher.sh
source "$(dirname "${BASH_SOURCE[0]}")/_launcher.sh"
NNODES=${NNODES:-${PET_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${PET_NODE_RANK:-0}}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_BACKEND=${RDZV_BACKEND:-${PET_RDZV_BACKEND:-static}}
check_port
check_host MASTER_ADDR "node 0's address"
case "$RDZV_BACKEND" in
  static)
    check_int NNODES 1 100000 "a number of nodes" "static rendezvous: MIN:MAX needs RDZV_BACKEND=c10d"
    check_int NODE_RANK 0 99999 "a node index"
    if (( 10#$NODE_RANK >= 10#$NNODES )); then
      refuse NODE_RANK "is not below NNODES=$NNODES: nodes are numbered 0..NNODES-1"
    fi ;;
  c10d)
    # NOTE: NODE_RANK is not read: c10d numbers the nodes as they arrive
    if [[ "$NNODES" =~ ^([0-9]{1,6}):([0-9]{1,6})$ ]]; then
      lo=$((10#${BASH_REMATCH[1]})) hi=$((10#${BASH_REMATCH[2]}))
      if (( lo < 1 || lo > hi || hi > 100000 )); then
        refuse NNODES "is not MIN:MAX nodes with 1 <= MIN <= MAX <= 100000"
      fi
    else
      check_int NNODES 1 100000 "a number of nodes" "or MIN:MAX for an elastic job"
    fi
    host=$MASTER_ADDR
    [[ "$host" == *:* && "$host" != \[* ]] && host="[$host]"  # NOTE: an IPv6 address
    RDZV_ENDPOINT=${RDZV_ENDPOINT:-${PET_RDZV_ENDPOINT:-$host:$MASTER_PORT}}
    check_endpoint RDZV_ENDPOINT "the rendezvous host:port" ;;
  *)
    refuse RDZV_BACKEND "must be static or c10d" ;;
esac
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  if [[ -n "${PET_NPROC_PER_NODE:-}" && "${PET_NPROC_PER_NODE}" =~ ^[0-9]+$ ]]; then
    NPROC_PER_NODE=$PET_NPROC_PER_NODE
  else
    gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    NPROC_PER_NODE=$(( gpus > 0 ? gpus : 2 ))
  fi
fi
if [[ "$RDZV_BACKEND" == static ]]; then
  rdzv=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-backend static
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
else
  rdzv=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
        --rdzv-id "${RDZV_ID:-${PET_RDZV_ID:-flexdispatch}}")
fi
# The interface the user names carries the process-group sockets (docs/security.md).
if [[ -n "${FLEXDISPATCH_IFNAME:-}" ]]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$FLEXDISPATCH_IFNAME}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$FLEXDISPATCH_IFNAME}
elif [[ "$NNODES" == "1" && "$MASTER_ADDR" == "127.0.0.1" ]]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
fi
cmd=${FLEXDISPATCH_CMD:-demo}
check_devices "$NPROC_PER_NODE"
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

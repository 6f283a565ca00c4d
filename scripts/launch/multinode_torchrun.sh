#!/usr/bin/env bash
# Launch `omni train` on N nodes with torchrun. Run this script once on every node (same
# command, same environment); torchrun's c10d rendezvous gathers the nodes and gives each one
# a block of consecutive global ranks, so Omni's rank order (TP innermost, then CP, DP, PP
# outermost) keeps tensor-parallel groups inside a node. See docs/parallelism.md.
#
# Environment:
#   MASTER_ADDR      (required) host name or address of the rendezvous node, reachable from all nodes
#   NNODES           (required) number of nodes
#   NODE_RANK        (optional) this node's index 0..NNODES-1. The c10d rendezvous assigns node
#                    ranks itself and torchrun ignores --node-rank with it; NODE_RANK is used only
#                    with RDZV_BACKEND=static (fixed node ranks, MASTER_ADDR = node 0)
#   MASTER_PORT      (optional, default 29500) rendezvous port
#   NPROC_PER_NODE   (optional, default 8) ranks (GPUs) per node
#   RUN_ID           (optional, default omni) rendezvous id: the same on every node of one job,
#                    different for two jobs that share MASTER_ADDR:MASTER_PORT
#   RDZV_BACKEND     (optional, default c10d) c10d | static
#   OMNI             (optional) the omni executable; default: the repository's .venv/bin/omni (the
#                    README's install) if it exists, else `omni` on the PATH
#   TORCHRUN         (optional) the torchrun executable; default: the torchrun beside OMNI
#   DRY_RUN          (optional) 1: print the torchrun command instead of running it
#
# Arguments: the `omni train` overrides. Without any, the example layout below is used.
#
# Example, 2 nodes x 8 GPUs (on each node):
#   MASTER_ADDR=node0 NNODES=2 scripts/launch/multinode_torchrun.sh \
#       experiment=demo parallel.dp_replicate=2 parallel.dp_shard=8
set -euo pipefail

: "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host (e.g. the first node)}"
: "${NNODES:?set NNODES to the number of nodes}"
MASTER_PORT="${MASTER_PORT:-29500}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
RUN_ID="${RUN_ID:-omni}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ -z "${OMNI:-}" ]; then
  if [ -x "$ROOT/.venv/bin/omni" ]; then OMNI="$ROOT/.venv/bin/omni"; else OMNI=omni; fi
fi
# torchrun is installed with torch, in the same bin folder as omni (no activated venv needed).
TORCHRUN="${TORCHRUN:-$(dirname "$(command -v "$OMNI" || echo "$OMNI")")/torchrun}"

if [ "$#" -gt 0 ]; then
  OVERRIDES=("$@")
else
  # Example layout for 2 nodes x 8 GPUs (16 ranks). HSDP: parameters sharded over the 8 GPUs
  # of a node, gradients all-reduced across the 2 nodes.
  OVERRIDES=(experiment=demo "parallel.dp_replicate=${NNODES}" "parallel.dp_shard=${NPROC_PER_NODE}")
  # Alternative for a model that does not fit one node's FSDP shards (needs heads and KV heads
  # divisible by 4 and layers divisible by 2, e.g. model=llama3_8b): pipeline stages across the
  # nodes, TP x DP inside each node:
  #   OVERRIDES=(model=llama3_8b parallel.dp_replicate=2 parallel.dp_shard=1 parallel.tp=4 parallel.pp=2)
fi

# NCCL hints (uncomment what your cluster needs):
# export NCCL_SOCKET_IFNAME=eth0        # the network interface for bootstrap / socket traffic
# export NCCL_IB_HCA=mlx5               # the InfiniBand adapters to use
# export NCCL_IB_DISABLE=1              # no InfiniBand: use TCP sockets
# export NCCL_DEBUG=INFO                # log topology and transport choices at start-up
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # fail fast on a failed collective instead of hanging

if [ "$RDZV_BACKEND" = static ]; then
  : "${NODE_RANK:?RDZV_BACKEND=static needs NODE_RANK (0..NNODES-1)}"
  RDZV=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
else
  RDZV=(--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id "$RUN_ID")
fi

# The layout checks that TP groups fit inside a node: tell it the node size (unless given).
case " ${OVERRIDES[*]} " in
  *" parallel.gpus_per_node="*) ;;
  *) OVERRIDES+=("parallel.gpus_per_node=${NPROC_PER_NODE}") ;;
esac

CMD=("$TORCHRUN"
  --nnodes "$NNODES"
  --nproc-per-node "$NPROC_PER_NODE"
  "${RDZV[@]}"
  --no-python "$OMNI" train
  "${OVERRIDES[@]}")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${CMD[*]}"
  exit 0
fi
exec "${CMD[@]}"

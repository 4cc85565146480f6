# Shared launch settings of the examples (sourced). Multi-node is plain torchrun across nodes:
#   NNODES          number of nodes (1)
#   NPUS_PER_NODE   processes per node = accelerators per node (8)
#   MASTER_ADDR     address of node 0, reachable from every node (localhost for one node)
#   MASTER_PORT     a free port on node 0 (6000)
#   CURRENT_IP      this node's address; NODE_RANK is derived from it (0 when it equals MASTER_ADDR)
NNODES=${NNODES:-1}
NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
CURRENT_IP=${CURRENT_IP:-$MASTER_ADDR}
if [ "$NNODES" -gt 1 ]; then
  case "$MASTER_ADDR" in
    localhost|127.*|::1)
      echo "error: NNODES=$NNODES but MASTER_ADDR=$MASTER_ADDR: on several nodes set MASTER_ADDR to node 0's" \
           "address that every node can reach (and CURRENT_IP to this node's)" >&2
      exit 2 ;;
  esac
fi
if [ -z "${NODE_RANK:-}" ]; then
  if [ "$CURRENT_IP" = "$MASTER_ADDR" ]; then NODE_RANK=0; else
    echo "error: set NODE_RANK (1..$((NNODES - 1))) on the nodes other than MASTER_ADDR=$MASTER_ADDR" >&2; exit 2
  fi
fi
WORLD_SIZE=$((NPUS_PER_NODE * NNODES))
DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
  --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
PYTHON=${PYTHON:-python}

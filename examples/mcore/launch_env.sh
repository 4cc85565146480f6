# Shared launch settings of the examples (sourced by the launchers). Multi-node is plain torchrun: no Ray, no
# head / worker scripts; every node runs the SAME launcher command, each with its own NODE_RANK.
#
#   NNODES          number of nodes (1)
#   NPUS_PER_NODE   processes per node = accelerators per node (8), the same on every node
#   NODE_RANK       this node's rank: 0 on the master node, 1 .. NNODES-1 on the others, each once
#                   (required when NNODES > 1; 0 on one node)
#   MASTER_ADDR     the address of the master node (NODE_RANK 0), reachable from every node, the same on every
#                   node (required when NNODES > 1; localhost on one node)
#   MASTER_PORT     a free TCP port on the master node (6000), the same on every node
#   CURRENT_IP      optional (MindSpeed-RL's name): this node's address; when given, it is checked against
#                   NODE_RANK (0 exactly on the node whose CURRENT_IP is MASTER_ADDR)
#
# Two nodes, 8 devices each (data, checkpoints, tokenizer and --save at the same paths on both nodes; --save on a
# filesystem both nodes see):
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/mcore/qwen25/grpo_qwen25_7b.sh
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/mcore/qwen25/grpo_qwen25_7b.sh
_launch_fail() {
  local n=2 other="1"
  case "${NNODES:-}" in ''|*[!0-9]*|0|1) ;; *) n=$NNODES; [ "$n" -gt 2 ] && other="<1 .. $((n - 1))>" ;; esac
  echo "error: $*" >&2
  echo "       multi-node recipe: the same command on every node, each with its own NODE_RANK:" >&2
  echo "         master node:  NNODES=$n NODE_RANK=0 MASTER_ADDR=<master's address> bash $0" >&2
  echo "         other nodes:  NNODES=$n NODE_RANK=$other MASTER_ADDR=<master's address> bash $0" >&2
  exit 2
}
_launch_is_count() { case "$1" in ''|*[!0-9]*) return 1 ;; *) [ "$1" -ge 1 ] ;; esac; }

NNODES=${NNODES:-1}
NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-6000}
_launch_is_count "$NNODES" || _launch_fail "NNODES=$NNODES must be a whole number >= 1"
_launch_is_count "$NPUS_PER_NODE" || _launch_fail "NPUS_PER_NODE=$NPUS_PER_NODE must be a whole number >= 1"
_launch_is_count "$MASTER_PORT" || _launch_fail "MASTER_PORT=$MASTER_PORT must be a port number"

if [ "$NNODES" -gt 1 ]; then
  if [ -z "${MASTER_ADDR:-}" ]; then
    _launch_fail "NNODES=$NNODES but MASTER_ADDR is not set: set it to the master node's (NODE_RANK 0) address," \
                 "the same on every node"
  fi
  case "$MASTER_ADDR" in
    localhost|127.*|::1)
      _launch_fail "NNODES=$NNODES but MASTER_ADDR=$MASTER_ADDR: set MASTER_ADDR to the master node's address" \
                   "that every node can reach" ;;
  esac
  if [ -z "${NODE_RANK:-}" ]; then
    _launch_fail "NNODES=$NNODES but NODE_RANK is not set: set NODE_RANK on every node, 0 on the master node" \
                 "(MASTER_ADDR=$MASTER_ADDR) and 1..$((NNODES - 1)) on the others"
  fi
else
  MASTER_ADDR=${MASTER_ADDR:-localhost}
  NODE_RANK=${NODE_RANK:-0}
fi
case "$NODE_RANK" in
  ''|*[!0-9]*) _launch_fail "NODE_RANK=$NODE_RANK must be a whole number in 0..$((NNODES - 1))" ;;
esac
if [ "$NODE_RANK" -ge "$NNODES" ]; then
  _launch_fail "NODE_RANK=$NODE_RANK is out of range for NNODES=$NNODES (0..$((NNODES - 1)))"
fi
if [ "$NNODES" -gt 1 ] && [ -n "${CURRENT_IP:-}" ]; then
  if [ "$CURRENT_IP" = "$MASTER_ADDR" ] && [ "$NODE_RANK" -ne 0 ]; then
    _launch_fail "CURRENT_IP=$CURRENT_IP is MASTER_ADDR, so this is the master node: it needs NODE_RANK=0," \
                 "not $NODE_RANK"
  fi
  if [ "$CURRENT_IP" != "$MASTER_ADDR" ] && [ "$NODE_RANK" -eq 0 ]; then
    _launch_fail "NODE_RANK=0 belongs to the master node MASTER_ADDR=$MASTER_ADDR, but CURRENT_IP=$CURRENT_IP:" \
                 "give this node a NODE_RANK in 1..$((NNODES - 1))"
  fi
fi

WORLD_SIZE=$((NPUS_PER_NODE * NNODES))
DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
  --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
PYTHON=${PYTHON:-python}
echo "launch: node $NODE_RANK of $NNODES x $NPUS_PER_NODE processes (world size $WORLD_SIZE)," \
     "master $MASTER_ADDR:$MASTER_PORT" >&2

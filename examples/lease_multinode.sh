#!/bin/bash
# Training nodes plus loaned inference nodes as one job that goes on when the loan ends
# (docs/design.md, "A multi-node GPU deployment"). Run this on every node, training nodes
# first (HOST, the rendezvous endpoint, is a training node: the rendezvous lives in its
# torchrun agent). cluster.toml lists the groups, the loaned ones with `loaned = true`:
#
#   [[node_groups]]            # group 0: the job's own
#   gpu = "h800"
#   num_nodes = 2
#   [[node_groups]]            # group 1: lent by the inference service
#   gpu = "h20"
#   num_nodes = 2
#   loaned = true
#
#   NODE_GROUP=0 HOST=train-node-0 bash examples/lease_multinode.sh   # on each training node
#   NODE_GROUP=1 HOST=train-node-0 bash examples/lease_multinode.sh   # on each loaned node
#
# The lender's side, on storage every node sees:
#   echo reclaimed > /shared/lease    # every rank saves the step in flight; the loaned nodes'
#                                     # ranks and torchrun agents leave, the training nodes go on
#   echo lent > /shared/lease         # then start this script on the loaned nodes again
set -euo pipefail
: "${NODE_GROUP:?the index of this node's [[node_groups]] table in cluster.toml, 0 first}"
: "${HOST:?a training node's address: the rendezvous endpoint}"
source .venv/bin/activate

# Each node says its group (its device's GPU type would do where the groups' types differ),
# so the ranks take the cluster file's order whatever order the rendezvous numbers the nodes.
export BALLONET_NODE_GROUP="$NODE_GROUP"
# torch 2.13's store shared by the agents does not survive members that leave and join
# (pytorch#135712); `ballonet train --lease` under torchrun refuses to start without this.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

own_nodes=2 all_nodes=4   # --nnodes MIN:MAX: the training nodes alone, or with the loaned ones
exec torchrun --nnodes "$own_nodes:$all_nodes" --nproc-per-node 8 \
    --rdzv-backend c10d --rdzv-endpoint "$HOST:29500" --rdzv-id lent-job \
    --rdzv-conf keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=30 \
    --max-restarts 100 \
    -m ballonet train --cluster cluster.toml --lease /shared/lease \
    --corpus /shared/corpus --checkpoint-dir /shared/ckpt --checkpoint-every 100 --resume --steps 100000

#!/bin/bash
# Ballonet on several nodes under Slurm: one torchrun agent per node, c10d rendezvous on
# the first node, requeued after a preemption. Submit from the repository with
# `sbatch examples/slurm_multinode.sh` (after `bash scripts/setup.sh`); run.toml holds the
# run's settings (`ballonet train --help`), the flags below override it.
#SBATCH --job-name=ballonet
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; it starts the node's ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=B:TERM@240          # 4 minutes before the limit: SIGTERM to this script (below)
#SBATCH --requeue
#SBATCH --open-mode=append
set -uo pipefail
source .venv/bin/activate

head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# Each rank checks that torchrun put as many ranks on its node as --nodes implies (and, on a
# cluster file of several node groups, as its group has GPUs per node): one line otherwise.
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$SLURM_GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" \
    --shutdown-timeout 200 \
    -m ballonet train --config run.toml --nodes "$SLURM_NNODES" \
    --checkpoint-dir "checkpoints/$SLURM_JOB_NAME" --resume &
step=$!

# Preemption (the time limit, or `scancel --signal=TERM --batch`): pass SIGTERM on to the
# agents, which pass it to the ranks; every rank finishes its step, they all save it, and
# the job is requeued to go on from that step (--resume).
preempted=0
trap 'preempted=1; kill -TERM "$step"' TERM
wait "$step"
code=$?
if [ "$preempted" = 1 ]; then
    wait "$step"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$code"

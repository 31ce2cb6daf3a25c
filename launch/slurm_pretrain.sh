#!/bin/bash
# Pretraining on a SLURM cluster: one DeepSpeed launcher per node, no ssh between nodes.
#
#   sbatch --nodes 8 launch/slurm_pretrain.sh configs/pretrain/vit_l16_i21k.yaml [key=value ...]
#
# The job requeues itself after a node failure (--requeue) and the relaunched command resumes
# from the newest complete checkpoint in output_dir, which must be on storage every node sees.
#SBATCH --job-name=vit-pretrain
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=72:00:00
#SBATCH --requeue
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch launch/slurm_pretrain.sh CONFIG [key=value ...]}
shift
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}

# The hostfile DeepSpeed wants, from the nodes SLURM gave this job.
HOSTFILE=$(mktemp -p "${SLURM_SUBMIT_DIR:-.}" hostfile.XXXXXX)
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$GPUS_PER_NODE/" > "$HOSTFILE"
trap 'rm -f "$HOSTFILE"' EXIT

# Network settings every node needs; adjust the interface / HCA names to the cluster.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export NCCL_ASYNC_ERROR_HANDLING=1   # a dead peer ends the job instead of hanging it
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
  deepspeed --hostfile '$HOSTFILE' --no_ssh --node_rank \$SLURM_NODEID \
    --master_addr '$MASTER_ADDR' --master_port '$MASTER_PORT' \
    launch/pretrain.py --config '$CONFIG' $*"

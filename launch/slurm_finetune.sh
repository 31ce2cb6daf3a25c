#!/bin/bash
# Fine-tuning on SLURM, one torchrun per node, across as many allocations as the run needs,
# with nobody watching (the twin of launch/slurm_pretrain.sh):
#
#   sbatch --nodes 2 launch/slurm_finetune.sh CONFIG [key=value ...]
#   SBATCH_SIGNAL=B:USR1@600 MAX_REQUEUES=20 sbatch --nodes 2 launch/slurm_finetune.sh CONFIG ...
#
# Before the time limit SLURM sends SIGUSR1 to this shell, which passes it to every rank: each
# finishes its step, a complete checkpoint is written, the ranks exit with code 4, and the job
# requeues itself; the next allocation resumes from that checkpoint. A node failure or a
# preemption is requeued by SLURM itself (--requeue). output_dir must be on storage every node
# sees. `scancel JOBID` stops for good (the ranks checkpoint if they can within KillWait);
# `scancel --batch --signal=USR1 JOBID` checkpoints now and requeues.
#
# Environment (read at submission; the job inherits it):
#   SBATCH_SIGNAL    sbatch's own variable: B:USR1@SECONDS stops that long before the time limit
#                    (default 300, listed at the end: one step + the checkpoint + closing
#                    MLflow + SLURM's up-to-60 s timing slack). Keep B:USR1 and SIGUSR1 in
#                    checkpoint.stop_signals.
#   MAX_REQUEUES     requeue at most this many times (counted by SLURM_RESTART_COUNT, which node
#                    failures and preemptions raise too); default 50
#   REQUEUE_ON_TERM  1: requeue after a SIGTERM too (scancel, a preemption that cancels), unless
#                    the step ended with 0, 2 or 3; stop such a job with scancel while it is
#                    pending. Default 0: scancel stops for good
#   REQUEUE_ON_CRASH 1 (default): requeue a step that crashed (1, 5 a stalled rank, 137 the OOM
#                    killer, ...) after completing a checkpoint in this allocation; one that
#                    crashed before any is left to a person (it would crash the same way). 0: never
#   GPUS_PER_NODE    ranks per node; default SLURM_GPUS_ON_NODE, else 8; refused when it is
#                    not the number of GPUs SLURM gave the node (CUDA_VISIBLE_DEVICES)
#   MASTER_PORT      rendezvous port on the first node; default 10000 + job id % 20000 (the
#                    next free one if another process of that node holds it)
#   ACCELERATE_USE_DEEPSPEED=true  fine-tune under DeepSpeed, as `accelerate launch` with a
#                    DeepSpeed config would: ACCELERATE_DEEPSPEED_ZERO_STAGE=0|1|2|3 (default 2),
#                    or ACCELERATE_DEEPSPEED_CONFIG_FILE=FILE (its "auto" values are the run's)
#   NCCL_DEBUG, NCCL_SOCKET_IFNAME, OMP_NUM_THREADS: defaults at the end, passed to every node
# Exit code: the trainer's (0 finished, 1 a crash, 2 bad input, 3 a person must decide, 4 stopped
# with a checkpoint, 5 a stalled rank). torchrun turns every code of a rank into 1; the trainer's
# rank 0 writes the code it chose to the file named in VITSCALE_JOB_STATUS (a
# .job-status-JOBID.* file in the submit directory, removed when the script ends), which this
# script reads, and another rank its 2, 3 or 5; the script writes a stop it passes on there.
#SBATCH --job-name=vit-finetune
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# sbatch runs a copy of this script from its spool directory: the shared part is found next to
# the original (SLURM knows its path), else in the checkout the job was submitted from.
SCRIPT_NAME=slurm_finetune.sh
ORIGINAL=$(scontrol show job "${SLURM_JOB_ID:-}" 2>/dev/null \
           | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' || true)
for ROOT in "$(dirname "${BASH_SOURCE[0]}")/.." "$(dirname "${ORIGINAL:-.}")/.." \
            "${SLURM_SUBMIT_DIR:-.}"; do
  [[ -f $ROOT/launch/slurm_job.sh ]] && break
done
[[ -f $ROOT/launch/slurm_job.sh ]] || {
  echo "launch/slurm_job.sh not found: submit from the repository root" >&2; exit 2; }
ROOT=$(cd "$ROOT" && pwd)   # the trainer by its full path: the job runs in the submit dir
# shellcheck source=launch/slurm_job.sh
source "$ROOT/launch/slurm_job.sh"   # signal traps first; takes CONFIG off "$@"

# One torchrun per node (it handles SIGTERM itself: it stops the ranks, SIGKILL 30 s later).
# shellcheck disable=SC2016  # expanded on each node, by design
run_step '
  exec torchrun --nnodes "$1" --node_rank "$SLURM_NODEID" --nproc_per_node "$2" \
    --master_addr "$3" --master_port "$4" "$5" --config "$6" "${@:7}"
' "$SLURM_JOB_NUM_NODES" "$GPUS_PER_NODE" "$MASTER_ADDR" "$MASTER_PORT" \
  "$ROOT/launch/finetune.py" "$CONFIG" "$@"

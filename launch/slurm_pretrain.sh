#!/bin/bash
# Pretraining on SLURM, one DeepSpeed launcher per node (no ssh between nodes), across as many
# allocations as the run needs, with nobody watching:
#
#   sbatch --nodes 8 launch/slurm_pretrain.sh CONFIG [key=value ...]
#   SBATCH_SIGNAL=B:USR1@600 MAX_REQUEUES=20 sbatch --nodes 8 launch/slurm_pretrain.sh CONFIG ...
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
#   DEEPSPEED_TIMEOUT minutes the ranks wait for a node that does not come (default 10)
#   NCCL_DEBUG, NCCL_SOCKET_IFNAME, OMP_NUM_THREADS: defaults at the end, passed to every node
# Exit code: the trainer's (0 finished, 1 a crash, 2 bad input, 3 a person must decide, 4 stopped
# with a checkpoint, 5 a stalled rank; DeepSpeed passes the ranks' code on). The ranks tell
# this script about checkpoints and their exit code, and it tells them of a stop, through a
# .job-status-JOBID.* file in the submit directory, removed when the script ends.
#SBATCH --job-name=vit-pretrain
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=72:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# sbatch runs a copy of this script from its spool directory: the shared part is found next to
# the original (SLURM knows its path), else in the checkout the job was submitted from.
SCRIPT_NAME=slurm_pretrain.sh
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

# One DeepSpeed launcher per node, no ssh between nodes. Each node writes the hostfile DeepSpeed
# wants (every node, GPUS_PER_NODE slots) to its own disk: nothing shared to write, nothing
# another node must see. DeepSpeed's launcher gives a node's ranks the hostfile's GPUs 0..N-1,
# not the ones SLURM gave the node: where those are others (4,5,6,7: a shared node without
# device cgroups), --include names them for this node.
# shellcheck disable=SC2016  # expanded on each node, by design
run_step '
  nodes=$1 per_node=$2
  shift 2
  all=$(seq -s, 0 $((per_node - 1)))
  mine=$all slots=$per_node
  if [[ ${CUDA_VISIBLE_DEVICES:-} =~ ^[0-9]+(,[0-9]+)*$ && $CUDA_VISIBLE_DEVICES != "$all" ]]; then
    mine=$CUDA_VISIBLE_DEVICES
    given=$(tr , "\n" <<< "$mine" | wc -l)
    if (( given != per_node )); then  # (the batch shell checked only the first node)
      echo "error: GPUS_PER_NODE=$per_node ranks per node, but SLURM gave $(hostname) $given" \
           "GPU(s) (CUDA_VISIBLE_DEVICES=$mine): set GPUS_PER_NODE=$given, or submit with" \
           "--gpus-per-node=$per_node" >&2
      exit 2
    fi
    last=$(tr , "\n" <<< "$mine" | sort -n | tail -n 1)
    (( last < per_node )) || slots=$((last + 1))
  fi
  # (a $TMPDIR passed on from the submitting machine may not exist here)
  hostfile=$(mktemp "${TMPDIR:-/tmp}/vitscale-hostfile.XXXXXX" 2>/dev/null \
             || mktemp /tmp/vitscale-hostfile.XXXXXX) || exit 1
  include="" n=0
  while read -r node; do
    if (( n++ == SLURM_NODEID )); then
      echo "$node slots=$slots" && include+="@$node:$mine"
    else
      echo "$node slots=$per_node" && include+="@$node:$all"
    fi
  done <<< "$nodes" > "$hostfile"
  [[ $mine == "$all" ]] && include="" || include="--include=${include#@}"
  rc=0
  deepspeed --hostfile "$hostfile" ${include:+"$include"} --no_ssh --node_rank "$SLURM_NODEID" \
    --master_addr "$1" --master_port "$2" "$3" --config "$4" "${@:5}" || rc=$?
  rm -f "$hostfile"
  exit "$rc"
' "$NODES" "$GPUS_PER_NODE" "$MASTER_ADDR" "$MASTER_PORT" "$ROOT/launch/pretrain.py" "$CONFIG" "$@"

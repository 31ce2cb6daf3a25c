# shellcheck shell=bash
# What launch/slurm_pretrain.sh and launch/slurm_finetune.sh share, sourced first thing by both:
# the SIGUSR1/SIGTERM traps of the batch shell, the requeue decision, the node list and network
# settings, and run_step, which starts one task per node and waits for it. The caller sets
# SCRIPT_NAME, sources this (which takes CONFIG, the first argument, off "$@"), then calls
# run_step with its per-node command.

# Signals first, so that none arrives before its trap.
GOT_USR1=0 GOT_TERM=0 REQUEUED=0 INTERRUPTED=0 STEP_PID=""
say() { echo "[${SCRIPT_NAME:-slurm} $(date '+%F %T')] $*"; }
# shellcheck disable=SC2317  # (trap handlers: called, though shellcheck cannot see it)
on_usr1() {
  GOT_USR1=1 INTERRUPTED=1
  say "SIGUSR1: the time limit is near; asking every rank to checkpoint and stop"
  # srun forwards SIGUSR1 to its step, and slurmstepd on every node delivers it to every process
  # of the step, not only to the task srun started. The launchers ignore it (trap '' in
  # run_step), so none of them dies or passes on a SIGTERM; each rank has its own handler.
  # A rank still starting (importing, or not yet started by its launcher) has it ignored and
  # would train on: the stop is written down too, and each rank reads it once its handlers are
  # in place (pretrain/job_status.py).
  if [[ -n $STEP_PID ]]; then
    if [[ -n ${VITSCALE_JOB_STATUS:-} ]]; then
      echo "stop $(kill -l USR1) $(date +%s)" >> "$VITSCALE_JOB_STATUS" 2>/dev/null || true
    fi
    kill -USR1 "$STEP_PID" 2>/dev/null || true
  fi
}
# shellcheck disable=SC2317
on_term() {
  GOT_TERM=1 INTERRUPTED=1
  if (( REQUEUED )); then return; fi   # scontrol requeue ends this shell with a SIGTERM
  # scancel, a preemption or the time limit: SLURM itself sends SIGTERM to every process of every
  # step (SIGKILL KillWait later), so there is nothing to pass on; wait for the step to end.
  say "SIGTERM: the job is being ended; the ranks checkpoint if they can within KillWait"
}
trap on_usr1 USR1
trap on_term TERM
CLEANUP=()   # files this shell made, removed when it ends or requeues (a hostfile, ...)
cleanup() { if (( ${#CLEANUP[@]} )); then rm -f "${CLEANUP[@]}"; fi; }
trap cleanup EXIT

# Network settings every node needs (srun passes this environment on), unless set already;
# adjust to the cluster
NODE_ENV_DEFAULTS=(NCCL_DEBUG=WARN "NCCL_SOCKET_IFNAME=^lo,docker" OMP_NUM_THREADS=8)
if [[ ${1:-} == -h || ${1:-} == --help ]]; then   # the caller's header is its manual
  if [[ -z ${BASH_SOURCE[1]:-} ]]; then
    echo "launch/slurm_job.sh is what slurm_pretrain.sh and slurm_finetune.sh share; run one" \
         "of those with --help"
    exit 0
  fi
  sed -n '2,/^#SBATCH/{/^#SBATCH/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[1]}"
  echo "Defaults: sbatch $(sed -n 's/^#SBATCH //p' "${BASH_SOURCE[1]}" | tr '\n' ' ')(options" \
       "given to sbatch win); ${NODE_ENV_DEFAULTS[*]}"
  exit 0
fi
if [[ -z ${SLURM_JOB_ID:-} ]]; then
  echo "error: not in a SLURM job (no SLURM_JOB_ID): submit it, sbatch --nodes N" \
       "launch/$SCRIPT_NAME CONFIG [key=value ...]; --help says more" >&2
  exit 2
fi
if [[ -z ${1:-} ]]; then
  echo "error: no CONFIG: sbatch launch/$SCRIPT_NAME CONFIG [key=value ...]; --help says more" >&2
  exit 2
fi
CONFIG=$1
shift   # the caller's "$@": the key=value overrides from here on

MAX_REQUEUES=${MAX_REQUEUES:-50}
REQUEUE_ON_TERM=${REQUEUE_ON_TERM:-0}
REQUEUE_ON_CRASH=${REQUEUE_ON_CRASH:-1}
RESTARTS=${SLURM_RESTART_COUNT:-0}
[[ $MAX_REQUEUES =~ ^[0-9]+$ ]] || { echo "error: MAX_REQUEUES=$MAX_REQUEUES is not a number" >&2; exit 2; }
[[ $REQUEUE_ON_TERM == [01] ]] || {   # (checked now: it is read only once a SIGTERM came)
  echo "error: REQUEUE_ON_TERM=$REQUEUE_ON_TERM: give 1 (requeue after a SIGTERM too) or 0" >&2
  exit 2; }
[[ $REQUEUE_ON_CRASH == [01] ]] || {
  echo "error: REQUEUE_ON_CRASH=$REQUEUE_ON_CRASH: give 1 (requeue a crash after a checkpoint) or 0" >&2
  exit 2; }
[[ $RESTARTS =~ ^[0-9]+$ ]] || RESTARTS=0
say "job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s), SLURM_RESTART_COUNT=$RESTARTS" \
    "(requeued $RESTARTS of at most MAX_REQUEUES=$MAX_REQUEUES times)"
if [[ -n ${SBATCH_SIGNAL:-} && $SBATCH_SIGNAL != B:USR1@* ]]; then
  say "warning: SBATCH_SIGNAL=$SBATCH_SIGNAL is not B:USR1@SECONDS; this shell will not hear" \
      "of the time limit and will not requeue the job"
fi

# shellcheck disable=SC2034  # used by the scripts that source this
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
[[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || {
  echo "error: GPUS_PER_NODE=$GPUS_PER_NODE is not a number of ranks per node" >&2; exit 2; }
# the GPUs SLURM gave this (the first) node, by index or UUID (not "NoDevFiles": none bound)
if [[ ${CUDA_VISIBLE_DEVICES:-} =~ ^(([0-9]+|GPU-[^,]+|MIG-[^,]+),?)+$ ]]; then
  IFS=, read -ra GIVEN <<< "$CUDA_VISIBLE_DEVICES"
  if (( ${#GIVEN[@]} != GPUS_PER_NODE )); then
    echo "error: GPUS_PER_NODE=$GPUS_PER_NODE ranks per node, but SLURM gave this node" \
         "${#GIVEN[@]} GPU(s) (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES): set" \
         "GPUS_PER_NODE=${#GIVEN[@]}, or submit with --gpus-per-node=$GPUS_PER_NODE" >&2
    exit 2
  fi
fi
NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")   # one per line
# shellcheck disable=SC2034
MASTER_ADDR=${NODES%%$'\n'*}
# Below Linux's ephemeral ports (32768 on): no connection of the node's holds it by chance.
PORT_GIVEN=${MASTER_PORT:-}
MASTER_PORT=${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}
[[ $MASTER_PORT =~ ^[0-9]+$ ]] && (( MASTER_PORT >= 1024 && MASTER_PORT <= 65535 )) || {
  echo "error: MASTER_PORT=$MASTER_PORT is not a port number (1024-65535)" >&2; exit 2; }
# The batch shell runs on the first node, where rank 0 listens: a port another job of that
# node holds would fail the rendezvous after minutes; take the next free one, or, when the
# port was given, say so now.
port_taken() {
  python3 - "$1" 2>/dev/null <<'PY'
import socket, sys
with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store does
    try:
        s.bind(("", int(sys.argv[1])))
    except OSError:
        sys.exit(0)
sys.exit(1)
PY
}
if [[ $MASTER_ADDR == "$(hostname)" || $MASTER_ADDR == "$(hostname -s)" ]] \
    && command -v python3 > /dev/null; then
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    port_taken "$MASTER_PORT" || break
    if [[ -n $PORT_GIVEN ]]; then
      echo "error: MASTER_PORT=$MASTER_PORT is in use on $MASTER_ADDR; give another, or unset" \
           "it for a free one" >&2
      exit 2
    fi
    say "port $MASTER_PORT is in use on $MASTER_ADDR; trying $((MASTER_PORT + 1))"
    MASTER_PORT=$((MASTER_PORT + 1))
  done
fi

for setting in "${NODE_ENV_DEFAULTS[@]}"; do
  name=${setting%%=*}
  export "$name=${!name:-${setting#*=}}"
done
export NCCL_ASYNC_ERROR_HANDLING=1   # a dead peer ends the job instead of hanging it

# Ask SLURM to requeue this job, unless it has been requeued MAX_REQUEUES times already.
requeue() {
  if (( RESTARTS >= MAX_REQUEUES )); then
    say "not requeued: this job has been requeued $RESTARTS times, MAX_REQUEUES=$MAX_REQUEUES;" \
        "submit the same command again to resume from the newest complete checkpoint"
    return 1
  fi
  say "requeueing job $SLURM_JOB_ID (requeue $((RESTARTS + 1)) of at most $MAX_REQUEUES);" \
      "the next allocation resumes from the newest complete checkpoint"
  cleanup   # SLURM ends this shell once the job is requeued
  REQUEUED=1
  scontrol requeue "$SLURM_JOB_ID" && return 0
  REQUEUED=0
  say "scontrol requeue failed; submit the same command again to resume"
  return 1
}

# run_step PROGRAM ARG...: PROGRAM (bash) runs once per node with ARG... as its "$@"; the trainer's
# key=value overrides go in as arguments, never into PROGRAM's text, so each reaches the trainer
# as one argument, unchanged, and SLURM_NODEID is read on each node. Exits with the trainer's
# code after requeueing the job when the stop came from the time limit, or when the step
# crashed after completing a checkpoint (the next allocation starts past where this one did).
run_step() {
  local program=$1 rc code arg checkpoints=0 chosen=""
  shift
  for arg in "$@"; do
    if [[ $arg == checkpoint.stop_signals=* && $arg != *SIGUSR1* ]]; then
      say "warning: $arg leaves out SIGUSR1: the ranks will ignore the stop before the time limit"
    fi
  done
  if (( GOT_USR1 )); then   # the time limit was near before anything started
    say "not starting: the time limit is closer than the stop margin"
    requeue || true
    exit 4
  fi
  # The trainer's rank 0 writes a line here per complete checkpoint and the exit code it chose,
  # any other rank its 2, 3 or 5 (pretrain/job_status.py): torchrun turns every code into 1.
  # On storage every node sees.
  if VITSCALE_JOB_STATUS=$(mktemp -p "${SLURM_SUBMIT_DIR:-.}" ".job-status-$SLURM_JOB_ID.XXXXXX")
  then
    CLEANUP+=("$VITSCALE_JOB_STATUS")
  else
    VITSCALE_JOB_STATUS=""
    say "warning: cannot write to ${SLURM_SUBMIT_DIR:-.}; a crash will not be requeued, and" \
        "torchrun's 1 stands for every code of the trainer's"
  fi
  export VITSCALE_JOB_STATUS
  # trap '' is kept across exec and inherited by the launchers and the ranks: the launchers
  # ignore SIGUSR1 (and the deepspeed runner, which has no SIGTERM handler with --no_ssh,
  # survives a SIGTERM while launch.py stops the ranks); each rank installs its own handlers.
  # No --kill-on-bad-exit: the ranks of one node exiting with 4 must not cut short rank 0 closing
  # MLflow; --wait still ends the step 5 minutes after a node's task ends (a dead node).
  srun --ntasks-per-node=1 --kill-on-bad-exit=0 --wait=300 \
    bash -c "trap '' USR1 TERM; $program" per-node "$@" &
  STEP_PID=$!
  # A trapped signal makes `wait` return early (status > 128) while the step runs on: wait again.
  while :; do
    INTERRUPTED=0 rc=0
    wait "$STEP_PID" || rc=$?
    (( INTERRUPTED && rc > 128 )) || break
  done
  STEP_PID=""
  if [[ -f $VITSCALE_JOB_STATUS ]]; then   # (unreadable: decided on the step's code alone)
    checkpoints=$(grep -c '^checkpoint ' "$VITSCALE_JOB_STATUS" || true)
    # rank 0's last code, but a 2 or 3 from any rank first, then a stalled rank's 5: a rank
    # that alone met bad input or stalled leaves rank 0 to fail as a crash (its peer gone)
    chosen=$( { sed -n 's/^exit \([23]\)$/\1/p' "$VITSCALE_JOB_STATUS"
                sed -n 's/^exit \(5\)$/\1/p' "$VITSCALE_JOB_STATUS"
                sed -n 's/^exit \([0-9][0-9]*\)$/\1/p' "$VITSCALE_JOB_STATUS" | tail -n 1
              } | head -n 1 || true)
  fi
  checkpoints=${checkpoints:-0}
  code=$rc
  # the code the trainer chose wins: torchrun says 1 for any, and a launcher may report the
  # code of a rank it ended after rank 0 had chosen its own (or srun a signal's)
  if (( rc != 0 )) && [[ -n $chosen ]]; then code=$chosen; fi
  say "the step ended with exit code $rc$( (( code == rc )) || echo " (the trainer's: $code)")," \
      "$checkpoints checkpoint(s) completed in this allocation"

  if (( code == 0 )); then say "finished"; exit 0; fi
  if (( code == 2 || code == 3 )); then
    say "not requeued: exit code $code means a person must look (2 bad input, 3 see the log)"
  elif (( GOT_USR1 )) || (( GOT_TERM && REQUEUE_ON_TERM == 1 )); then
    requeue || true
  elif (( GOT_TERM )); then  # scancel, a preemption or the time limit, with REQUEUE_ON_TERM=0
    say "not requeued: SIGTERM ended the job (scancel, a preemption, the time limit) and" \
        "REQUEUE_ON_TERM=0; scontrol requeue $SLURM_JOB_ID or resubmit to resume"
  elif (( code == 4 )); then
    say "not requeued: the ranks stopped on a signal that did not come through this shell;" \
        "scontrol requeue $SLURM_JOB_ID or resubmit to resume"
  elif (( REQUEUE_ON_CRASH == 1 && checkpoints > 0 )); then
    # a crash (an NCCL timeout, a stalled rank's 5, storage that stayed away, the OOM killer)
    # after progress: the next allocation resumes from a newer checkpoint than this one did
    say "the step failed (exit code $code) after a checkpoint; see the log above"
    requeue || true
  else
    say "not requeued: the step failed (exit code $code)" \
        "$( (( REQUEUE_ON_CRASH == 1 )) && echo "before completing a checkpoint in this" \
           "allocation, and would fail the same way again;" || echo "and REQUEUE_ON_CRASH=0;")" \
        "see the log above, then scontrol requeue $SLURM_JOB_ID or resubmit to resume"
  fi
  exit "$code"
}

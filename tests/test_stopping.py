"""pretrain/stopping.py on two real gloo ranks with real signals: the ranks agree on a stop that
reached only one of them, and a rank stuck where no Python handler runs leaves at once on a
signal when its peer is gone (instead of making the launcher wait to SIGKILL it)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_port

pytestmark = pytest.mark.faults

RANK = r'''
import logging, os, sys, time
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
# a rank ends as the launchers end one: without the interpreter's C++ teardown, in which torch
# 2.14 aborted now and then ("terminate called without an active exception", exit -6)
from pretrain.interpreter import exit_without_teardown as leave
from pretrain.stopping import StopSignals
mode, out = sys.argv[2], sys.argv[3]
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
dist.init_process_group("gloo")
rank = dist.get_rank()
stop = StopSignals(["SIGTERM", "SIGUSR1"], grace_period_s=30)
open(f"{out}/ready{rank}", "w").close()
if mode == "agree":  # step boundaries every 50 ms until the ranks agree to stop
    for step in range(1, 2000):
        time.sleep(0.05)
        name = stop.agreed()
        if name:
            print(f"rank {rank} stops after step {step} on {name}", flush=True)
            stop.ending()
            time.sleep(rank)  # rank 1 reports 1 s late: its signal is that much older
            stop.report_save(0.0, name)
            stop.restore()
            dist.destroy_process_group()  # as the trainer does (pretrain.distributed.leave)
            leave(4)
    leave(99)
if mode == "finish":  # the run is over; rank 1 gets there seconds after rank 0
    time.sleep(4 * rank)
    stop.ending()
    stop.restore()
    dist.destroy_process_group()
    print(f"rank {rank} finished", flush=True)
    leave(0)
if mode == "decoder":  # two ranks of one node build their transforms without simplejpeg
    os.environ["LOCAL_RANK"] = str(rank)
    from pretrain.data import transforms
    transforms.simplejpeg = None
    transforms.TrainTransform(32)
    stop.ending()
    stop.restore()
    dist.destroy_process_group()
    leave(0)
# "stuck": rank 1 leaves; rank 0 blocks in a system call that signals restart (as in a
# collective library's wait), so no Python signal handler runs on its main thread
if rank == 1:
    os._exit(0)
read, _ = os.pipe()
os.read(read, 1)
sys.exit(98)
'''


@pytest.fixture
def started():
    """The rank processes a test starts; whatever is left of them is killed afterwards."""
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()


def start_ranks(tmp_path, mode, started):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script), str(REPO), mode, str(tmp_path)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    started.extend(procs)
    deadline = time.time() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert all(p.poll() is None for p in procs) and time.time() < deadline
        time.sleep(0.05)
    return procs


def test_a_signal_to_one_rank_stops_both_after_the_same_step(tmp_path, started, fault_ledger):
    procs = start_ranks(tmp_path, "agree", started)
    time.sleep(0.5)
    procs[1].send_signal(signal.SIGUSR1)  # only rank 1 hears it
    outs, errs = zip(*(p.communicate(timeout=60) for p in procs))
    assert [p.returncode for p in procs] == [4, 4], outs
    steps = {line.split(" after step ")[1].split()[0] for line in outs}
    assert len(steps) == 1 and all(line.endswith("on SIGUSR1\n") for line in outs), outs
    # rank 0 speaks for both, with the time since the signal reached rank 1 (the only one it
    # reached, and where the scheduler's kill would come first); rank 1 says nothing
    reports = re.findall(r"INFO SIGUSR1: checkpoint written in 0.0 s, ([\d.]+) s after the "
                         r"signal reached the first rank\n", errs[0])
    assert len(reports) == 1 and float(reports[0]) >= 1.0, errs
    assert "checkpoint written" not in errs[1], errs
    fault_ledger.record(1, 0)


def test_a_missing_jpeg_decoder_is_warned_about_once_per_node(tmp_path, started):
    """Without simplejpeg every rank decodes with PIL; the first rank of the node says so."""
    procs = start_ranks(tmp_path, "decoder", started)
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert errs[0].count("WARNING JPEG decoder: PIL") == 1, errs
    assert "WARNING" not in errs[1] and errs[1].count("INFO JPEG decoder: PIL") == 1, errs


def test_ranks_that_finish_seconds_apart_both_exit(tmp_path, started):
    """The heartbeat ends on every rank together, though the ranks finish at their own pace: a
    rank left in a heartbeat its peer no longer joins would hang at exit (gloo's 30 min)."""
    procs = start_ranks(tmp_path, "finish", started)
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs


def test_a_stuck_rank_whose_peer_is_gone_leaves_at_once_on_a_signal(tmp_path, started,
                                                                     fault_ledger):
    procs = start_ranks(tmp_path, "stuck", started)
    assert procs[1].wait(timeout=30) == 0
    time.sleep(1)
    started = time.monotonic()
    procs[0].send_signal(signal.SIGTERM)
    _, err = procs[0].communicate(timeout=20)  # without the heartbeat: os.read forever
    took = time.monotonic() - started
    assert procs[0].returncode == 1, err
    assert "SIGTERM received while another rank is gone: no checkpoint can be written" in err
    print(f"\nthe stuck rank left {took:.1f} s after SIGTERM (heartbeat every 2 s)")
    fault_ledger.record(2, 0)


TWO_ENDINGS = r'''
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from pretrain.stopping import exit_now
started = threading.Event()
def words(why):  # ending the MLflow run, say: it takes a moment
    started.set()
    time.sleep(1)
    open(sys.argv[2], "w").write(why)
threading.Thread(target=exit_now, args=(5, "stalled", words)).start()
started.wait()  # the first ending is under way
exit_now(1, "a signal while a peer is gone", lambda why: None)
'''


def test_a_second_ending_does_not_cut_the_first_ones_last_words_short(tmp_path):
    """The stall watchdog and the signal watcher can both end a rank within a second (a stall
    on every rank: one ends first, its launcher signals the others); the first to start ends
    the process, after its last words (the MLflow run ended FAILED, saying why)."""
    words = tmp_path / "words"
    proc = subprocess.run([sys.executable, "-c", TWO_ENDINGS, str(REPO), str(words)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr
    assert words.read_text() == "stalled"

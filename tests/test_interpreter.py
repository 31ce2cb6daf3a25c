"""A launcher ends without the interpreter's teardown (pretrain/interpreter.py), and loses
nothing by it: its exit code, its output, its threads' work and its exit handlers are those of
a normal exit; a crash still exits as Python does, traceback and all."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import atexit, ctypes, gc, os, sys, threading, time, weakref
    sys.path.insert(0, {repo!r})
    from pretrain import interpreter

    class Teardown:
        def __del__(self):  # runs in the interpreter's teardown, if there is one
            os.write(1, b" teardown")

    class Node:  # a plain object for a reference cycle, watched through a weak reference
        __slots__ = ("me", "__weakref__")

    def main(end):
        assert not gc.isenabled()  # paused while the run starts
        cycle = Node()
        cycle.me = cycle
        left = weakref.ref(cycle)
        del cycle
        interpreter.training_starts()
        assert left() is None  # the start's garbage was freed, not kept for good
        assert gc.isenabled() and gc.get_freeze_count() > 0
        atexit.register(lambda: print(" atexit", end=""))
        def late():
            time.sleep(0.3)
            print(" thread", end="")
        threading.Thread(target=late).start()  # not a daemon: the exit waits for it
        print("main", end="")  # no newline, no flush
        ctypes.CDLL(None).printf(b" C")  # into the C library's buffer: no newline, no flush
        if end == "crash":
            raise ValueError("a crash")
        if end != "return":
            sys.exit(int(end) if end.isdigit() else end)

    keep = Teardown()
    keep.me = keep  # a cycle, frozen with the rest: only collected if unfrozen again
    with interpreter.launcher():
        main(sys.argv[1])
""")


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("launcher") / "launch.py"
    path.write_text(SCRIPT.format(repo=str(REPO)))
    return path


def launch(*args, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """The script's output as a pipe buffers it (a job's log, a launcher's reader)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, *map(str, args)], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300, env=env)


@pytest.mark.parametrize("end,code", [("return", 0), ("4", 4), ("0", 0)])
def test_a_launcher_exits_with_its_code_and_all_its_output_but_no_teardown(script, end, code):
    proc = launch(script, end)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "main thread atexit C"  # and no " teardown"
    assert proc.stderr == ""


def test_a_launcher_that_does_not_train_keeps_its_collector_and_skips_the_teardown(tmp_path):
    tool = tmp_path / "tool.py"  # as evaluate.py, export.py, prepare_data.py... are run
    tool.write_text(textwrap.dedent(f"""
        import gc, os, sys
        sys.path.insert(0, {str(REPO)!r})
        from pretrain import interpreter

        class Teardown:
            def __del__(self):
                os.write(1, b" teardown")

        keep = Teardown()
        with interpreter.launcher(pause_collector=False):
            interpreter.training_starts()  # nothing to do outside a training launcher
            print(f"enabled={{gc.isenabled()}} frozen={{gc.get_freeze_count()}}", end="")
    """))
    proc = launch(tool)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "enabled=True frozen=0"  # and no " teardown"


def test_a_crash_exits_as_python_does(script):
    proc = launch(script, "crash")
    assert proc.returncode == 1
    # (the order is Python's: printing the traceback flushes the output written so far)
    assert sorted(proc.stdout.split()) == ["C", "atexit", "main", "teardown", "thread"]
    assert "Traceback" in proc.stderr and proc.stderr.strip().endswith("ValueError: a crash")


def test_an_exit_with_a_message_prints_it_as_python_does(script):
    proc = launch(script, "a message")
    assert proc.returncode == 1
    assert {"main", "thread", "atexit", "C"} <= set(proc.stdout.split())
    assert proc.stderr == "a message\n"


def test_output_that_cannot_be_written_at_exit_is_reported_with_pythons_code(script):
    with open("/dev/full", "w") as full:  # every write: no space left on the device
        proc = launch(script, "return", stdout=full)
    assert proc.returncode == 120
    assert "Exception ignored on flushing sys.stdout: OSError(28, " in proc.stderr


def test_an_error_in_a_thread_shutdown_hook_is_reported_and_the_exit_goes_on(tmp_path):
    """As in Python's own exit: an exception from what runs when the threads are shut down
    (where concurrent.futures' process pool wakes its manager, and 3.11's can find the pipe
    for it closed) is printed, and the process still exits with its code, atexit handlers and
    output."""
    tool = tmp_path / "tool.py"
    tool.write_text(textwrap.dedent(f"""
        import atexit, sys, threading
        sys.path.insert(0, {str(REPO)!r})
        from pretrain import interpreter

        def wake_up():
            raise OSError(9, "Bad file descriptor")

        threading._register_atexit(wake_up)
        atexit.register(lambda: print(" atexit", end=""))
        with interpreter.launcher(pause_collector=False):
            print("done", end="")
            sys.exit(int(sys.argv[1]))
    """))
    for code in (0, 3):
        proc = launch(tool, code)
        assert proc.returncode == code, proc.stderr
        assert proc.stdout == "done atexit"
        assert proc.stderr.startswith("Exception ignored in: <module 'threading'")
        assert proc.stderr.strip().endswith("OSError: [Errno 9] Bad file descriptor")


def test_under_a_profiler_the_exit_is_pythons_and_the_profile_is_written(script, tmp_path):
    proc = launch("-m", "cProfile", "-o", tmp_path / "run.prof", script, "return")
    assert proc.returncode == 0, proc.stderr
    assert "teardown" in proc.stdout and (tmp_path / "run.prof").stat().st_size > 0


def test_a_real_run_starts_with_the_collector_off_and_trains_with_it_on_and_frozen(
        tmp_path, tiny_data):
    """The launcher and the trainer together: what a rank's collector does, seen from inside
    a real pretraining launch (probes on two functions the trainer calls)."""
    from conftest import sqlite_store, tiny_run_args
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(f"""
        import gc, runpy, sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "launch")!r}]
        import pretrain.trainer as trainer
        import pretrain.watchdog as watchdog

        def report(when):
            print(f"{{when}}: enabled={{gc.isenabled()}} frozen={{gc.get_freeze_count()}}",
                  file=sys.stderr, flush=True)
        check_same_run, start = trainer.check_same_run, watchdog.StallWatchdog.start
        def setting_up(*args):
            report("setting up")
            return check_same_run(*args)
        def first_step(self):
            report("first step")
            return start(self)
        trainer.check_same_run, watchdog.StallWatchdog.start = setting_up, first_step
        sys.argv[0] = {str(REPO / "launch" / "pretrain.py")!r}
        runpy.run_path(sys.argv[0], run_name="__main__")
    """))
    out = tmp_path / "run"
    # (a store whose artifacts stay in tmp_path: MLflow would put them in ./mlruns)
    proc = launch(probe, *tiny_run_args(out, tiny_data, "train.total_steps=4",
                                        f"tracking.uri={sqlite_store(tmp_path)}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "setting up: enabled=False frozen=0" in proc.stderr
    found = re.search(r"first step: enabled=True frozen=(\d+)", proc.stderr)
    assert found and int(found.group(1)) > 100_000, proc.stderr[-3000:]
    assert "done: " in proc.stderr and (out / "checkpoints" / "step_00000004").is_dir()


def test_heap_frozen_gives_a_block_the_trainers_regime_and_then_the_heap_back():
    import gc

    from pretrain import interpreter
    gc.disable()  # as a training launcher has it while the run starts
    try:
        with interpreter.heap_frozen():
            assert gc.isenabled() and gc.get_freeze_count() > 0
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.enable()


def test_benchmark_train_times_its_steps_with_the_heap_frozen_as_the_trainer_does(tmp_path):
    """Figures that stand for the trainer's: a gen-2 collection over the whole heap (0.3 s
    here) must not fall into the benchmark's steps when the launched trainer's cannot."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(f"""
        import gc, runpy, sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "launch")!r}]
        import pretrain.engine as engine

        train_micro_batch = engine.train_micro_batch
        def step(*args):
            print(f"step: enabled={{gc.isenabled()}} frozen={{gc.get_freeze_count()}}",
                  file=sys.stderr, flush=True)
            return train_micro_batch(*args)
        engine.train_micro_batch = step
        sys.argv[0] = {str(REPO / "launch" / "benchmark.py")!r}
        runpy.run_path(sys.argv[0], run_name="__main__")
    """))
    proc = launch(probe, "train", "--model", "vit_tiny_patch16_224", "--image-size", "16",
                  "--num-classes", "4", "--batch", "2", "--precision", "fp32", "--steps", "1",
                  "--warmup", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    frozen = [int(n) for n in re.findall(r"step: enabled=True frozen=(\d+)", proc.stderr)]
    assert len(frozen) == 2 and min(frozen) > 100_000, proc.stderr[-3000:]

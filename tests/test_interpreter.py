"""A launcher ends without the interpreter's teardown (pretrain/interpreter.py), and loses
nothing by it: its exit code, its output, its threads' work and its exit handlers are those of
a normal exit; a crash still exits as Python does, traceback and all."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import atexit, gc, os, sys, threading, time, weakref
    sys.path.insert(0, {repo!r})
    from pretrain import interpreter

    class Teardown:
        def __del__(self):  # runs in the interpreter's teardown, if there is one
            os.write(1, b" teardown")

    class Node:
        pass

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
        if end == "crash":
            raise ValueError("a crash")
        if end != "return":
            sys.exit(int(end) if end.isdigit() else end)

    keep = Teardown()
    with interpreter.launcher():
        main(sys.argv[1])
""")


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("launcher") / "launch.py"
    path.write_text(SCRIPT.format(repo=str(REPO)))
    return path


@pytest.mark.parametrize("end,code", [("return", 0), ("4", 4), ("0", 0)])
def test_a_launcher_exits_with_its_code_and_all_its_output_but_no_teardown(script, end, code):
    proc = subprocess.run([sys.executable, str(script), end], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "main thread atexit"  # and no " teardown"
    assert proc.stderr == ""


def test_a_crash_exits_as_python_does(script):
    proc = subprocess.run([sys.executable, str(script), "crash"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert proc.stdout == "main thread atexit teardown"
    assert "Traceback" in proc.stderr and proc.stderr.strip().endswith("ValueError: a crash")


def test_an_exit_with_a_message_prints_it_as_python_does(script):
    proc = subprocess.run([sys.executable, str(script), "a message"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stdout.startswith("main thread atexit") and proc.stderr == "a message\n"

"""Shared test helpers: run a launcher the way a user does, from the repository root."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_launcher(script: str, *args: str, timeout: float = 300, env: dict | None = None,
                 cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python launch/<script> args...`` as a subprocess; returns the finished process."""
    return subprocess.run([sys.executable, str(REPO / "launch" / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def repo() -> Path:
    return REPO


def _test_ports():
    """The ports this test process hands out: below the kernel's ephemeral range, where no
    socket bound to port 0 lands (each gloo rank binds several listeners that way, and a port
    found free there could be taken in the tens of seconds before a launched run binds it), a
    share of its own for each xdist worker, each handed out once."""
    import itertools
    import re
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first, workers = 10000, 8
    share = max((low - first) // workers, 1)
    worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", "gw0"))
    start = first + (int(worker.group(1)) % workers if worker else 0) * share
    return itertools.cycle(range(start, start + share))


_PORTS = _test_ports()


def free_port() -> int:
    """A port no other process listens on (all interfaces: the store of a launched run binds
    them all) and no other test of this session is given."""
    import socket
    for _ in range(1000):
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def spawn_ranks(worker, world: int, *args, timeout: float = 300) -> dict:
    """``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes, the ranks of
    one machine's process group; what each put on the queue as ``(rank, result)``, by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return results


def deepspeed_cmd(nprocs: int, *args: str, script: Path = REPO / "launch" / "pretrain.py"
                  ) -> list[str]:
    """``deepspeed --num_gpus N launch/pretrain.py args`` (N CPU ranks on gloo here)."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nprocs),
            "--master_port", str(free_port()), str(script), *args]


def run_deepspeed(nprocs: int, *args: str, timeout: float = 400, fails: bool = False,
                  script: Path = REPO / "launch" / "pretrain.py", env: dict | None = None
                  ) -> subprocess.CompletedProcess:
    """Run to the end; it must succeed, or with ``fails`` end with a non-zero exit code."""
    proc = subprocess.run(deepspeed_cmd(nprocs, *args, script=script), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert (proc.returncode != 0) == fails, \
        f"exit code {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def wait_until(condition, proc, what: str, timeout: float = 300, every: float = 0.05) -> None:
    """Poll ``condition()`` while the run ``proc`` is alive; fail saying ``what`` was awaited."""
    import time
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def tiny_run_args(out: Path, data: Path, *extra: str) -> list[str]:
    """A small ViT with pre-logits on a prepared tiny dataset: seconds per run on the CPU."""
    return [f"output_dir={out}", f"data.root={data}", "data.generate_demo=false",
            "data.num_workers=1", "data.shuffle_buffer=50", "model.img_size=16",
            "model.patch_size=4", "model.depth=2", "model.embed_dim=64", "model.num_heads=2",
            "model.representation_size=64", "model.num_classes=8", "train.global_batch_size=16",
            "schedule.warmup_steps=2", "log.every_steps=1", "eval.every_steps=4",
            "checkpoint.every_steps=4",
            # a tiny run that hangs shows where in seconds (pretrain/watchdog.py), in the test's
            # failure message, instead of reaching the test's timeout silently
            "train.stall_timeout_s=120", *extra]


@pytest.fixture(scope="session")
def made_once(tmp_path_factory, worker_id):
    """``made_once(name, make)``: the folder ``make(folder)`` filled, made once per test session
    by whichever test process (pytest-xdist worker) asks first; the others wait for it and read
    the same folder. For what several test files only read (the tiny dataset, a reference run):
    a run costs the suite its launch once, not once per file. What a test changes, it copies."""
    import shutil

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = (base if worker_id == "master" else base.parent) / "made-once"
    shared.mkdir(exist_ok=True)

    def get(name: str, make) -> Path:
        folder, done = shared / name, shared / f"{name}.done"
        with FileLock(str(shared / f"{name}.lock")):
            if not done.exists():  # a worker that failed making it left no mark: made again
                shutil.rmtree(folder, ignore_errors=True)
                make(folder)
                done.touch()
        return folder
    return get


@pytest.fixture(scope="session")
def tiny_data(made_once) -> Path:
    """8 classes of procedural images in the raw ImageNet-21k layout, prepared into shards:
    256 train samples in 16 shards of 16, 64 held out. Read-only: copy it to change it."""
    from pretrain.data.shard_writer import prepare
    from pretrain.data.sources import load_synsets
    from pretrain.data.synthetic import write_synset_tars

    def make(base: Path) -> None:
        write_synset_tars(base / "raw", load_synsets("goog")[:8], 40, size=(24, 24))
        prepare("imagenet21k", str(base / "raw"), str(base / "shards"), name="tiny",
                shard_size=16, val_count=64, workers=1, progress=False)
    return made_once("tiny", make) / "shards"


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite store and a served artifact root under
    ``root``; ``stop()`` and ``start()`` again give an outage on the same port and store."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240) -> None:
        import time
        import urllib.request

        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts")]
        # the server's job runner (huey consumers) only costs start-up time here
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # its own group: stop() ends all
        deadline = time.time() + timeout
        last_error = None
        while True:
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError as e:  # not listening yet; the checks below say why if it never does
                last_error = e
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            assert time.time() < deadline, f"mlflow server did not come up ({last_error})"
            time.sleep(0.3)

    def stop(self) -> None:
        import signal
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="session")
def tiny_cifar(made_once) -> Path:
    """A CIFAR-10-format set (python pickles, 640 train / 200 test images of 32 px) of the same
    procedural family as tiny_data, prepared into shards; the raw pickles are in ``../raw``.
    Read-only: copy it to change it."""
    from pretrain.data.shard_writer import prepare
    from pretrain.data.synthetic import write_cifar

    def make(base: Path) -> None:
        write_cifar(base / "raw", "cifar10", n_train=640, n_test=200, seed=1)
        prepare("cifar10", str(base / "raw/cifar-10-batches-py"), str(base / "shards"),
                shard_size=40, workers=1, progress=False)
    return made_once("cifar", make) / "shards"


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real tracking server for the whole session (starting one costs ~10 s here)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


def sqlite_store(base: Path, experiment: str | None = None) -> str:
    """The URI of a new sqlite MLflow store in ``base`` whose experiment (default: the runs'
    default) keeps its artifacts in ``base`` too. Left to MLflow, a sqlite store's artifacts go
    to ./mlruns of the process that creates the experiment: the repository root for launched
    runs, which ``_tracking_store_outside_the_repo`` checks stays clean."""
    from mlflow.tracking import MlflowClient

    from pretrain.config import TrackingConfig
    base.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{base / 'mlflow.db'}"
    MlflowClient(uri).create_experiment(experiment or TrackingConfig().experiment,
                                        artifact_location=(base / "artifacts").as_uri())
    return uri


@pytest.fixture(scope="session", autouse=True)
def _tracking_store_outside_the_repo(tmp_path_factory):
    """Every launched run tracks to MLflow; without a URI that is ./mlflow.db in the repository
    root (the product's default). Tests point runs at a throwaway store instead; the tracking
    tests point theirs at a real server. Nothing of MLflow's may land in the repository:
    a test that leaves ./mlruns or ./mlflow.db there fails the session."""
    old = os.environ.get("MLFLOW_TRACKING_URI")
    leaks = [REPO / "mlruns", REPO / "mlflow.db"]
    there = {p for p in leaks if p.exists()}
    os.environ["MLFLOW_TRACKING_URI"] = sqlite_store(tmp_path_factory.mktemp("mlflow-default"))
    yield
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old
    left = [str(p) for p in leaks if p.exists() and p not in there]
    assert not left, f"a test wrote MLflow files into the repository: {left}; give its store " \
        "an artifact location of its own (conftest.sqlite_store)"


# --------------------------------------------------------------------------------------------
# The fault suite's ledger: what was injected and what came back, summed up at the end
# --------------------------------------------------------------------------------------------
# The tests run in several worker processes (pytest-xdist), so a test's record travels with its
# report (user_properties) and the process that prints the summary adds them up.
_RECORD = "fault_ledger"


class FaultLedger:
    def __init__(self):
        self.rows: list[tuple] = []
        self.seconds = 0.0

    def summary(self) -> str:
        i, r, s, m = (sum(col) for col in zip(*self.rows))
        return (f"fault suite: {i} faults injected, {r} runs recovered, {s} samples lost, "
                f"{m} metrics lost ({len(self.rows)} tests, {self.seconds:.0f} s)")


class FaultRecorder:
    """What a fault test hands in: ``record(injected, recovered, samples_lost, metrics_lost)``."""

    def __init__(self, item):
        self.item = item

    def record(self, injected: int, recovered: int, samples_lost: int = 0,
               metrics_lost: int = 0) -> None:
        self.item.user_properties.append(
            (_RECORD, (injected, recovered, samples_lost, metrics_lost)))


_LEDGER = FaultLedger()  # this process's: the one that prints the summary adds up all reports


@pytest.fixture
def fault_ledger(request) -> FaultRecorder:
    return FaultRecorder(request.node)


def pytest_runtest_logreport(report):
    """Runs where the summary is printed, for each phase of every test (a worker's too)."""
    if "faults" not in report.keywords:
        return
    _LEDGER.seconds += report.duration  # setup + call + teardown of the suite's tests
    if report.when == "teardown":  # its properties are final by then, and counted once
        _LEDGER.rows += [row for name, row in report.user_properties if name == _RECORD]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _LEDGER.rows:
        terminalreporter.write_sep("=", _LEDGER.summary())


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default, pyproject.toml): one test process per CPU this machine gives us
    (its affinity and cgroup quota: in a container psutil counts the host's cores), at most 8,
    since most tests start two ranks of their own. ``-n 0`` runs the tests in this process."""
    import math
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, min(cpus, 8))

"""Shards on a network: two ranks read them from real servers on 127.0.0.1 -- an HTTP server that
fails on purpose (503s, connections cut at random byte offsets), an S3-compatible server
(moto's server mode, through boto3 as a user's job would) and a Google Cloud Storage emulator
(through fsspec and gcsfs) -- and consume exactly the keys,
epochs and augmented pixels of a run over the same shards on local disk, resume included."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import socket
import threading
import time
import urllib.request
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from _loader_fixtures import LOADER_ARGS, run_two_ranks, write_split
from conftest import free_port, run_launcher, tiny_run_args
from pretrain.data.loader import TrainLoader
from pretrain.data.remote import RetryPolicy, Unreachable, open_shard
from pretrain.data.shards import ShardSet

SHARD_LENGTHS = [5, 7, 6, 9, 4, 8, 6, 7]  # 52 samples in 8 shards
STEPS, SAVE_AT = 9, 4  # 52 samples / (2 ranks x 4): into the second epoch


class FlakyHandler(SimpleHTTPRequestHandler):
    """Serves a directory with range requests; a seeded share of the requests answers 503 or
    sends the headers of the whole body, then part of it, then closes the connection."""

    def log_message(self, *args):  # keep the test output readable
        pass

    def refused_for_credentials(self) -> bool:
        """With ``server.credentials`` set, a request without that Authorization is answered
        401, as a server behind basic authentication answers."""
        if self.server.credentials and \
                self.headers.get("Authorization") != self.server.credentials:
            self.send_error(401)
            return True
        return False

    def do_HEAD(self):
        if not self.refused_for_credentials():
            super().do_HEAD()

    def do_GET(self):
        server = self.server
        if self.refused_for_credentials():
            return
        path = Path(self.translate_path(self.path))
        # an upload-only endpoint (PUT, no reads), or files this caller may not read
        if server.refuse_get and path.name.endswith(server.refused):
            self.send_error(server.refuse_get)
            return
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        start = int(match.group(1)) if match else 0
        body = data[start:]
        with server.lock:
            roll, cut = server.rng.random(), server.rng.randrange(1, max(2, len(body)))
            server.requests += 1
            server.resumed += start > 0
        if roll < server.p_503 and path.name.endswith(server.failing):
            with server.lock:
                server.failures += 1
            self.send_error(503, "busy")
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if roll < server.p_503 + server.p_cut and len(body) > 1 and \
                path.name.endswith(server.failing):
            with server.lock:
                server.failures += 1
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)

    def do_PUT(self):  # uploads, as WebDAV or a presigned URL take them; fails at p_503 too
        server = self.server
        if self.refused_for_credentials():
            return
        if server.refuse_put:  # a read-only endpoint
            self.send_error(server.refuse_put)
            return
        if server.refused_puts and self.path.endswith(server.refused_puts):  # one object
            self.send_error(403)
            return
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with server.lock:
            fail = server.rng.random() < server.p_503
            server.failures += fail
        if fail:
            self.send_error(503, "busy")
            return
        path = Path(self.translate_path(self.path))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def flaky_http(tmp_path):
    """(root URL, server) serving tmp_path/www over HTTP, failing about half the requests."""
    www = tmp_path / "www"
    www.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(FlakyHandler, directory=str(www)))
    server.rng, server.lock = random.Random(0), threading.Lock()
    server.p_503, server.p_cut = 0.15, 0.35
    server.requests = server.resumed = server.failures = server.refuse_get = 0
    server.refuse_put = 0
    server.refused_puts = ""  # the objects whose uploads are refused (none)
    server.failing = ""  # the files that fail: those whose names end so (all)
    server.refused = ""  # with refuse_get: the files refused (all)
    server.credentials = ""  # an Authorization header every request must carry (none)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server, www
    server.shutdown()
    server.server_close()


def local_reference(root: Path) -> list:
    """What each rank of a 2-rank run over local shards sees (the stream is a pure function of
    seed, epoch and reader slot, so one process can compute both ranks')."""
    ranks = []
    for rank in range(2):
        loader = TrainLoader(ShardSet.from_info(str(root), "train"), rank=rank, world_size=2,
                             **LOADER_ARGS)
        it = iter(loader)
        ranks.append([dict(keys=b.keys, epochs=b.epochs.tolist(), pixels=int(b.images.sum()))
                      for b in (next(it) for _ in range(STEPS))])
        del it
    return ranks


def assert_same_as_local(ranks: list, local: list) -> None:
    for remote, expected in zip(ranks, local):
        assert remote["seen"] == expected  # keys, epochs and augmented pixels, in order
        assert remote["resumed"] == expected[SAVE_AT:]  # the exact resume holds too


def test_two_ranks_over_a_flaky_http_server_consume_exactly_the_local_keys(tmp_path,
                                                                           flaky_http):
    url, server, www = flaky_http
    write_split(www, SHARD_LENGTHS)
    ranks = run_two_ranks(url, tmp_path, STEPS, SAVE_AT)
    assert_same_as_local(ranks, local_reference(www))
    # the failures really happened, and reads resumed where they broke off
    assert server.failures >= 10 and server.resumed >= 5, vars(server)
    print(f"\n{server.requests} HTTP requests, {server.failures} failed on purpose, "
          f"{server.resumed} resumed at a byte offset")


def test_a_shard_that_stays_unreachable_is_reported_after_the_retries(flaky_http):
    url, server, www = flaky_http
    write_split(www, [3])
    server.p_503, server.p_cut = 1.0, 0.0  # every request fails
    with pytest.raises(Unreachable, match=r"3 attempts in a row failed at byte 0 \(last: "
                                          r"ConnectionError: HTTP 503"):
        open_shard(f"{url}/toy-train-000000.tar", RetryPolicy(attempts=3, backoff_s=0.01))


def test_storage_unreachable_through_the_retries_ends_the_run_as_a_crash_not_as_bad_input(
        tmp_path, flaky_http, tiny_data):
    """Exit code 2 means "a person must fix the input" (slurm_pretrain.sh never requeues it); an
    outage of storage that answered at the start, longer than data.read_attempts covers, may
    end by itself: exit code 1, as a crash, one line (the shards are read in a loader worker).
    Storage that never answered (the info file unread) and a missing shard stay bad input."""
    import shutil
    from conftest import tiny_run_args
    url, server, www = flaky_http
    shutil.copytree(tiny_data, www, dirs_exist_ok=True)
    server.p_503, server.p_cut, server.failing = 1.0, 0.0, ".tar"  # _info.json still answers
    args = [*tiny_run_args(tmp_path / "run", url), "data.read_attempts=2",
            "data.retry_backoff_s=0.01", "data.num_workers=1", "tracking.enabled=false"]
    proc = run_launcher("pretrain.py", *args)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.fullmatch(
        rf"error: shard {url}/\S+\.tar is unreachable \(.*2 attempts in a row failed at byte 0 "
        r"\(last: ConnectionError: HTTP 503 busy\)\); check the storage \(relaunching resumes "
        r"from the newest complete checkpoint\), or set data.missing_shards=skip to go on "
        r"without it", proc.stderr.strip().splitlines()[-1]), proc.stderr[-3000:]
    # the one-off tools read shards through the same loader and end the same way
    bench = run_launcher("benchmark.py", "train", "--model", "vit_tiny_patch16_224",
                         "--image-size", "16", "--num-classes", "8", "--batch", "4",
                         "--precision", "fp32", "--steps", "1", "--warmup", "1", "--shards", url,
                         "--workers", "1", "--set", "data.read_attempts=2",
                         "--set", "data.retry_backoff_s=0.01")
    assert bench.returncode == 1 and bench.stderr.strip().splitlines()[-1].startswith(
        f"error: shard {url}/"), bench.stderr[-3000:]
    server.failing = ""  # the info file too: a wrong endpoint looks the same from here
    proc = run_launcher("pretrain.py", *args)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: cannot read {url}/_info.json: "), proc.stderr[-3000:]
    # a shard that is not there (404) is still the input's fault
    server.failing, server.p_503 = ".tar", 0.0
    (www / json.loads((www / "_info.json").read_text())["splits"]["train"]["filenames"][0]
     ).unlink()
    proc = run_launcher("pretrain.py", *args)
    assert proc.returncode == 2 and " is missing (" in proc.stderr.strip().splitlines()[-1], \
        proc.stderr[-3000:]


@pytest.fixture
def s3_server(monkeypatch):
    """A moto S3 server on the loopback address, and the variables a job would set for it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto keeps its buckets per process, not per server: start from none
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset",
                                                  method="POST"), timeout=30).close()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield env
    server.stop()


def test_two_ranks_over_s3_consume_exactly_the_local_keys(tmp_path, s3_server):
    import boto3

    local = tmp_path / "shards"
    write_split(local, SHARD_LENGTHS)
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="datasets")
    for f in sorted(local.iterdir()):
        s3.upload_file(str(f), "datasets", f"toy/{f.name}")
    ranks = run_two_ranks("s3://datasets/toy", tmp_path, STEPS, SAVE_AT, env=s3_server)
    assert_same_as_local(ranks, local_reference(local))


def two_epochs_without_shard_1(data, args):
    """A loader of ``data`` (data.missing_shards=skip) whose two epochs, over shards of 4
    samples each, lack shard 1's: counted as missing."""
    from pretrain.data.loader import build_train_loader

    loader = build_train_loader(data, **args)
    it = iter(loader)
    batches = [next(it) for _ in range(4)]  # two epochs of the 8 samples left
    del it
    assert all(not k.startswith("train_001_") for b in batches for k in b.keys)
    assert loader.skipped_by_cause["missing_shard"] >= 4
    return loader


def test_a_missing_remote_shard_is_skipped_and_counted_or_stops_the_run(tmp_path, s3_server):
    import boto3

    from pretrain.config import DataConfig
    from pretrain.data.loader import build_train_loader
    from pretrain.data.shards import LoaderError

    local = tmp_path / "shards"
    write_split(local, [4, 4, 4])
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="datasets")
    for f in sorted(local.iterdir()):
        if f.name != "toy-train-000001.tar":  # listed in _info.json, never uploaded
            s3.upload_file(str(f), "datasets", f"toy/{f.name}")
    args = dict(img_size=32, batch_size=4, num_classes=10)
    data = DataConfig(root="s3://datasets/toy", num_workers=1, shuffle_buffer=2,
                      missing_shards="skip")
    loader = two_epochs_without_shard_1(data, args)

    loader = build_train_loader(data.model_copy(update={"missing_shards": "error"}), **args)
    it = iter(loader)
    with pytest.raises(LoaderError, match=r"^shard s3://datasets/toy/toy-train-000001.tar is "
                                          r"missing .*set data.missing_shards=skip"):
        for _ in range(3):  # an epoch: the shard is reached
            next(it)
    del it


def test_prepare_data_writes_to_s3_through_a_stage_and_the_loader_reads_it_back(tmp_path,
                                                                                 s3_server):
    import boto3

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="datasets")
    args = pets(tmp_path)
    stageless = args[:-2]  # without --stage
    refused = run_launcher("prepare_data.py", *stageless, "--out", "s3://datasets/pets")
    assert refused.returncode == 2 and "add --stage DIR" in refused.stderr
    done = run_launcher("prepare_data.py", *args, "--out", "s3://datasets/pets")
    assert done.returncode == 0, done.stderr[-2000:]
    listed = s3.list_objects_v2(Bucket="datasets", Prefix="pets/")["Contents"]
    files = [f.name for f in (tmp_path / "stage").iterdir() if not f.name.startswith(".")]
    # and the id of the stage folder that uploaded there last
    assert {o["Key"] for o in listed} == {f"pets/{name}" for name in files + ["_stage_id"]}
    assert_pets("s3://datasets/pets")
    # boto3's own INFO lines are not the job's ("Found credentials in environment variables.")
    assert "Found credentials" not in done.stderr, done.stderr[-2000:]
    # a rerun finds the work done: nothing prepared again, nothing uploaded again, whether the
    # prefix is spelt with a trailing slash or not
    for out in ("s3://datasets/pets", "s3://datasets/pets/"):
        again = run_launcher("prepare_data.py", *args, "--out", out)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "already complete; nothing to do" in again.stderr
        assert f"uploaded 0 of {len(files)} files" in again.stderr
    # ... and so does one with the source moved since (a complete dataset is not compared with
    # its source again): it was refused, "written with --src ... (now ...)"
    (tmp_path / "raw").rename(tmp_path / "moved")
    moved = [a if a != str(tmp_path / "raw") else str(tmp_path / "moved") for a in args]
    again = run_launcher("prepare_data.py", *moved, "--out", "s3://datasets/pets")
    assert again.returncode == 0 and f"uploaded 0 of {len(files)} files" in again.stderr, \
        again.stderr[-2000:]
    (tmp_path / "moved").rename(tmp_path / "raw")
    relisted = s3.list_objects_v2(Bucket="datasets", Prefix="pets/")["Contents"]
    # (but the marker, put again by each start: the check that the prefix takes uploads)
    assert ({o["Key"]: o["LastModified"] for o in relisted if o["Key"] != "pets/_stage_id"}
            == {o["Key"]: o["LastModified"] for o in listed if o["Key"] != "pets/_stage_id"})

    # an edited source, prepared in another stage folder for the same prefix: a cat photo
    # filed as a dog keeps every shard's size, and still every file is replaced
    (tmp_path / "raw" / "train" / "cat" / "0001.jpg").rename(
        tmp_path / "raw" / "train" / "dog" / "0009.jpg")
    edited = [a if a != str(tmp_path / "stage") else str(tmp_path / "stage2") for a in args]
    done = run_launcher("prepare_data.py", *edited, "--out", "s3://datasets/pets")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"uploaded {len(files)} of {len(files)} files" in done.stderr
    from pretrain.data.eval_loader import EvalLoader
    loader = EvalLoader(ShardSet.from_info("s3://datasets/pets", "train"), img_size=16,
                        batch_size=4, num_classes=2)
    got = sorted((k, int(y)) for b in loader for k, y in zip(b.keys, b.labels) if k)
    assert ("dog/0009", 1) in got and not any(k == "cat/0001" for k, _ in got)
    # the first stage folder again (its own log says it sent everything, unchanged since):
    # the prefix holds the other folder's files now, so every file is sent again
    back = run_launcher("prepare_data.py", *args, "--out", "s3://datasets/pets")
    assert back.returncode == 0 and f"uploaded {len(files)} of {len(files)} files" in \
        back.stderr, back.stderr[-2000:]
    loader = EvalLoader(ShardSet.from_info("s3://datasets/pets", "train"), img_size=16,
                        batch_size=4, num_classes=2)
    got = sorted((k, int(y)) for b in loader for k, y in zip(b.keys, b.labels) if k)
    assert ("cat/0001", 0) in got and not any(k == "dog/0009" for k, _ in got)


def test_a_prefix_holding_another_dataset_or_other_files_is_refused_before_any_work(
        tmp_path, s3_server):
    """As a local output folder is: a prefix is never written over unless it holds this same
    preparation (a rerun, or a new stage folder for it), and the refusal comes before the
    shards are written, not after hours of work."""
    import boto3

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="datasets")
    args = pets(tmp_path)
    done = run_launcher("prepare_data.py", *args, "--out", "s3://datasets/pets")
    assert done.returncode == 0, done.stderr[-2000:]

    def objects(prefix):
        listed = s3.list_objects_v2(Bucket="datasets", Prefix=prefix).get("Contents", [])
        return {o["Key"]: o["ETag"] for o in listed}
    before = objects("pets/")
    other_stage = str(tmp_path / "stage2")
    resized = [a if a != str(tmp_path / "stage") else other_stage for a in args]
    resized[resized.index("--shard-size") + 1] = "3"
    refused = run_launcher("prepare_data.py", *resized, "--out", "s3://datasets/pets")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: s3://datasets/pets holds a dataset prepared with --shard-size 2 (now 3); rerun "
        "with the same options, or choose another --out (or delete what is there first)")
    assert objects("pets/") == before and not os.path.exists(other_stage)

    # an upload cut off before its info file: its settings are under the prefix all the same
    s3.delete_object(Bucket="datasets", Key="pets/_info.json")
    refused = run_launcher("prepare_data.py", *resized, "--out", "s3://datasets/pets")
    assert refused.returncode == 2 and "pets holds an unfinished upload prepared with " \
        "--shard-size 2 (now 3)" in refused.stderr, refused.stderr[-2000:]
    resumed = run_launcher("prepare_data.py", *args, "--out", "s3://datasets/pets")
    assert resumed.returncode == 0 and "uploaded 1 of" in resumed.stderr, resumed.stderr[-2000:]
    assert objects("pets/") == before

    # a prefix holding a user's own files, not a dataset
    s3.put_object(Bucket="datasets", Key="mine/results.csv", Body=b"a,b\n1,2\n")
    refused = run_launcher("prepare_data.py", *args, "--out", "s3://datasets/mine/")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "error: s3://datasets/mine/ is not empty and holds no prepare_data output; choose a "
        "new or empty --out prefix"), refused.stderr[-2000:]
    assert objects("mine/") == {"mine/results.csv": s3.head_object(
        Bucket="datasets", Key="mine/results.csv")["ETag"]}
    # and a bucket that is not there: said now, not when the upload fails after the work
    refused = run_launcher("prepare_data.py", *args, "--out", "s3://no-such-bucket/pets")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "error: s3://no-such-bucket/pets: the bucket does not exist; create it first "
        "(aws s3 mb s3://no-such-bucket)"), refused.stderr[-2000:]


def closed_port(port: int = 0) -> socket.socket:
    """A socket bound to ``port`` (0: any) on 127.0.0.1 that does not listen: connections to
    its port are refused, and no other process can take the port while it is open."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    return s


@pytest.fixture
def no_s3(monkeypatch):
    """AWS_ENDPOINT_URL at a port nothing answers at (connections refused): its number."""
    with closed_port() as s:
        port = s.getsockname()[1]
        for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
                     "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        yield port


def nothing_answered(port: int, bucket: str = "datasets", root: str = "datasets/pets") -> str:
    """The line (a regex) for storage that never answered at AWS_ENDPOINT_URL :port."""
    return (rf"s3://{root}/_info\.json: nothing answered at AWS_ENDPOINT_URL=http://127\.0\.0\.1:"
            rf"{port} \(\d+ tries in \d+ s; last: EndpointConnectionError: Could not connect "
            rf"to the endpoint URL: \"http://127\.0\.0\.1:{port}/{root}/_info\.json\"\); set "
            rf"AWS_ENDPOINT_URL to the address of the S3 server holding bucket '{bucket}' "
            r"\(unset: AWS itself\), or start that server")


def test_an_s3_endpoint_nothing_answers_at_is_named_with_where_it_came_from(no_s3,
                                                                           tmp_path):
    """A mistyped MinIO address: "Could not connect to the endpoint URL", and the line says it
    is AWS_ENDPOINT_URL's and what to set. prepare_data says it after two tries, before
    preparing anything (it took the whole back-off, minutes, and then said "rerun")."""
    port = no_s3
    proc = run_launcher("pretrain.py", "--dry-run", "data.root=s3://datasets/pets",
                        "data.generate_demo=false", "data.read_attempts=2",
                        "data.retry_backoff_s=0.01")
    assert proc.returncode == 0, proc.stderr[-2000:]  # a plan may be made away from the data
    assert re.search(rf"data: not read here \({nothing_answered(port)}\)\n", proc.stdout), \
        proc.stdout[-2000:]
    # ... and a run's first retry says it, not only its last
    assert re.search(r"retrying at byte 0 in [\d.]+ s \(failure 1 of 2\); is the endpoint "
                     rf"right\? AWS_ENDPOINT_URL=http://127.0.0.1:{port}\n",
                     proc.stderr), proc.stderr[-2000:]
    up = run_launcher("prepare_data.py", *pets(tmp_path), "--out", "s3://datasets/pets")
    assert up.returncode == 2 and not list((tmp_path / "stage").glob("*.tar")), up.stderr
    [line] = [line for line in up.stderr.splitlines() if line.startswith("error: ")]
    assert re.fullmatch(rf"error: --out s3://datasets/pets: {nothing_answered(port)} \(checked "
                        r"before preparing anything\)", line), up.stderr
    assert "failure 2 of" not in up.stderr  # two tries, not the whole back-off


def test_a_run_whose_s3_endpoint_never_answers_stops_in_seconds_not_after_the_back_off(
        no_s3, tmp_path):
    """A run with a mistyped AWS_ENDPOINT_URL retried its _info.json through the whole back-off
    of data.read_attempts (10 tries, 3 minutes and more) before it failed. Storage that never
    answered is a wrong address, not an outage: FIRST_CONTACT_S (seconds), then one line with
    the endpoint, the bucket and the fix, exit code 2 (bad input)."""
    port = no_s3
    start = time.monotonic()
    proc = run_launcher("pretrain.py", *tiny_run_args(tmp_path / "run", "s3://datasets/pets"),
                        "tracking.enabled=false", timeout=120)  # (the defaults' back-off)
    took = time.monotonic() - start
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.fullmatch(f"error: {nothing_answered(port)}", proc.stderr.strip().splitlines()[-1]
                        ), proc.stderr[-3000:]
    # its tries took FIRST_CONTACT_S; the rest is the launch (imports, the model)
    from pretrain.data.info import FIRST_CONTACT_S
    tries = re.search(r"\((\d+) tries in (\d+) s;", proc.stderr)
    assert int(tries[1]) >= 3 and int(tries[2]) <= FIRST_CONTACT_S + 1, proc.stderr[-3000:]
    assert took < 60, took


def test_the_first_contact_gives_up_on_storage_that_never_answered_not_on_an_outage(
        no_s3, monkeypatch, tmp_path):
    """The info file's read (the first contact of a run, a plan, evaluate.py, prepare_data.py)
    gives storage that never answered FIRST_CONTACT_S, whatever its back-off; a server that
    comes up within them (still starting) is read; one that answered before in this process,
    and every shard read (the loader's, mid-run), get the whole back-off, as an outage does."""
    from pretrain.data import info as info_module
    from pretrain.data.info import InfoNotRead, StorageNotReached, read_info
    from pretrain.data.remote import NotAnswered
    from pretrain.evaluate_model import EvaluateError, dataset_info

    port = no_s3
    monkeypatch.setattr(info_module, "FIRST_CONTACT_S", 1.5)  # (the run's own: the test above)
    start = time.monotonic()
    with pytest.raises(StorageNotReached) as refused:
        read_info("s3://datasets/pets", RetryPolicy(backoff_s=0.3))  # 10 tries: 2 minutes
    assert 1.5 <= time.monotonic() - start < 5
    assert re.fullmatch(nothing_answered(port), str(refused.value))
    with pytest.raises(EvaluateError, match=r"^--data 's3://data/x': s3://data/x/_info\.json: "
                                            r"nothing answered at AWS_ENDPOINT_URL="):
        dataset_info("s3://data/x", "validation")

    # a web server that starts listening 0.5 s after the first try: tolerated, read
    www = tmp_path / "www"
    (www / "ds").mkdir(parents=True)
    (www / "ds" / "_info.json").write_text(json.dumps(
        {"name": "ds", "splits": {"train": {"num_samples": 1, "filenames": ["a.tar"]}}}))
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler,
                                                           directory=str(www)),
                                 bind_and_activate=False)
    server.server_bind()  # its port taken, connections refused until it listens
    port = server.server_address[1]
    starting = threading.Timer(0.5, lambda: (server.server_activate(), server.serve_forever()))
    starting.start()
    try:
        assert read_info(f"http://127.0.0.1:{port}/ds", RetryPolicy(backoff_s=0.2)).name == "ds"
    finally:
        server.shutdown()  # (before the timer too: its serve_forever then ends at once)
        starting.join()
        server.server_close()
    # ... and gone now, an outage of storage that answered: retried through data.read_attempts
    with closed_port(port):
        with pytest.raises(InfoNotRead, match="4 attempts in a row failed") as gone:
            read_info(f"http://127.0.0.1:{port}/ds", RetryPolicy(attempts=4, backoff_s=0.01))
    assert not isinstance(gone.value, StorageNotReached)
    # a shard read has no first contact: a refused connection is retried in full there
    with closed_port() as never, pytest.raises(Unreachable, match="3 attempts in a row") as lost:
        open_shard(f"http://127.0.0.1:{never.getsockname()[1]}/ds/a.tar",
                   RetryPolicy(attempts=3, backoff_s=0.01))
    assert not isinstance(lost.value, NotAnswered)
    # a run that read its data in an earlier job (a requeued one: build_train_loader's
    # read_before): storage that does not answer now is an outage, tried every attempt
    with closed_port() as never:
        start = time.monotonic()
        with pytest.raises(StorageNotReached, match=r"\(4 tries in \d+ s"):
            read_info(f"http://127.0.0.1:{never.getsockname()[1]}/ds",
                      RetryPolicy(attempts=4, backoff_s=0.5, first_contact_s=math.inf))
        assert time.monotonic() - start > 1.5  # past the first contact's seconds


def test_a_bucket_that_does_not_exist_is_named_as_such_by_the_run_and_its_plan(s3_server):
    """It read "no _info.json or info.json in 's3://...'" (as for an empty prefix); the storage
    answered that the bucket is not there, which is said, with what to check."""
    for extra in ([], ["--dry-run"]):
        proc = run_launcher("pretrain.py", *extra, "data.root=s3://no-such-bucket/pets",
                            "data.generate_demo=false")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            "error: s3://no-such-bucket/pets/_info.json: S3 NoSuchBucket: the bucket "
            "'no-such-bucket' does not exist there; check the bucket in "
            "'s3://no-such-bucket/pets' (and AWS_ENDPOINT_URL: another endpoint has other "
            "buckets)"), extra


def test_the_loader_benchmark_refuses_s3_shards_its_reference_cannot_open(tmp_path, s3_server):
    """Our loader reads s3://, the reference pipeline it is timed against cannot: one line
    before any timing, not webdataset's traceback from a loader worker."""
    import boto3

    write_split(tmp_path / "toy", SHARD_LENGTHS[:2])
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="datasets")
    for f in sorted((tmp_path / "toy").iterdir()):
        s3.upload_file(str(f), "datasets", f"toy/{f.name}")
    proc = run_launcher("benchmark.py", "loader", "--shards", "s3://datasets/toy", "--workers",
                        "0", "--batches", "1", "--batch-size", "4", "--img-size", "32")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --shards s3://datasets/toy: the reference pipeline (webdataset's own opener) "
        "cannot read s3://; copy a few shards and their _info.json to a local folder and "
        "benchmark that"], proc.stderr[-2000:]


def pets(tmp_path) -> list:
    from test_folder_layouts import write_images

    write_images(tmp_path / "raw", [f"{split}/{cls}/{i:04d}.jpg" for split in ("train", "val")
                                    for cls in ("cat", "dog") for i in range(3)])
    return ["imagefolder", "--src", str(tmp_path / "raw"), "--shard-size", "2", "--workers", "1",
            "--stage", str(tmp_path / "stage")]


def assert_pets(root: str) -> None:
    from pretrain.data.eval_loader import EvalLoader

    for split in ("train", "validation"):
        loader = EvalLoader(ShardSet.from_info(root, split), img_size=16, batch_size=4,
                            num_classes=2)
        got = sorted((k, int(y)) for b in loader for k, y in zip(b.keys, b.labels) if k)
        assert got == sorted((f"{c}/{i:04d}", j) for j, c in enumerate(("cat", "dog"))
                             for i in range(3)), split


def test_prepare_data_publishes_over_http_put_and_to_a_pipe(tmp_path, flaky_http):
    url, server, www = flaky_http
    server.p_503, server.p_cut = 0.35, 0.0  # some uploads fail and are retried
    done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", f"{url}/pets")
    assert done.returncode == 0, done.stderr[-2000:]
    assert server.failures >= 1  # a retried upload, not a lucky run
    server.p_503 = 0.0
    assert_pets(f"{url}/pets")
    # an endpoint that takes uploads but no reads: what the prefix holds cannot be checked,
    # which is said, and the upload goes ahead
    server.refuse_get = 405
    done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", f"{url}/put-only")
    server.refuse_get = 0
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"could not check what {url}/put-only holds (cannot read {url}/put-only/_info.json: " \
           f"{url}/put-only/_info.json: HTTP 405" in done.stderr
    assert_pets(f"{url}/put-only")
    # a presigned URL signs one object: every file would go to it (its signature printed)
    signed = f"{url}/pets/in?X-Amz-Signature=abc123&X-Amz-Expires=600"
    refused = run_launcher("prepare_data.py", *pets(tmp_path), "--out", signed)
    assert refused.returncode == 2 and "abc123" not in refused.stderr
    assert f"--out {url}/pets/in?... has a query string (a presigned URL signs one object), " \
           f"but --out is a prefix" in refused.stderr.strip().splitlines()[-1], refused.stderr
    piped = tmp_path / "piped"
    piped.mkdir()
    done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", f"pipe:cat > {piped}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_pets(str(piped))


def test_a_password_in_an_http_url_is_sent_as_basic_auth_and_printed_nowhere(tmp_path,
                                                                             flaky_http,
                                                                             tiny_data):
    """``https://user:token@host/...`` as curl takes it: urllib alone looked the whole
    ``user:token@host`` up as a host name, and every retry warning printed the token."""
    import base64
    import shutil

    from conftest import tiny_run_args
    from mlflow.tracking import MlflowClient
    url, server, www = flaky_http
    server.credentials = "Basic " + base64.b64encode(b"vit:s3cr@t").decode()
    server.p_503, server.p_cut = 0.3, 0.0  # retries, each with its warning line
    secret = url.replace("://", "://vit:s3cr%40t@")  # the password's "@" quoted, as in curl
    hidden = url.replace("://", "://vit:***@")
    up = run_launcher("prepare_data.py", *pets(tmp_path), "--out", f"{secret}/pets")
    assert up.returncode == 0 and server.failures >= 1, up.stderr[-2000:]
    assert "s3cr" not in up.stdout + up.stderr and f"{hidden}/pets/" in up.stderr, up.stderr
    server.p_503 = 0.0
    assert_pets(f"{secret}/pets")
    shutil.copytree(tiny_data, www / "tiny")
    server.p_503, server.failures = 0.3, 0
    out = tmp_path / "run"
    run = run_launcher("pretrain.py", *tiny_run_args(out, f"{secret}/tiny"),
                       "data.retry_backoff_s=0.01", "train.total_steps=4")
    assert run.returncode == 0 and server.failures >= 1, run.stderr[-3000:]
    assert "s3cr" not in run.stdout + run.stderr and f"{hidden}/tiny/" in run.stderr, \
        run.stderr[-3000:]
    run_id = json.loads((out / "tracking/run.json").read_text())["run_id"]
    mlflow_run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run_id)
    assert mlflow_run.data.params["data.root"] == f"{hidden}/tiny"
    # without the password: refused at once, in one line, as the server refuses it
    wrong = run_launcher("pretrain.py", *tiny_run_args(tmp_path / "run2", f"{url}/tiny"))
    assert wrong.returncode == 2 and "HTTP 401" in wrong.stderr.strip().splitlines()[-1], \
        wrong.stderr[-2000:]


def test_a_password_in_an_http_url_is_not_passed_on_where_a_redirect_leads(tmp_path):
    """A server behind basic authentication redirecting to another host (a CDN, a presigned
    object URL): the credentials stay with the first, as curl keeps them."""
    seen = []

    class Target(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output readable
            pass

        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"bytes")

    class Redirect(Target):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{target.server_address[1]}/x?sig=1")
            self.send_header("Content-Length", "0")
            self.end_headers()

    target, first = (ThreadingHTTPServer(("127.0.0.1", 0), h) for h in (Target, Redirect))
    for server in (target, first):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://vit:s3cret@127.0.0.1:{first.server_address[1]}/shard.tar"
        assert open_shard(url, RetryPolicy(attempts=1)).read() == b"bytes"
    finally:
        for server in (target, first):
            server.shutdown()
            server.server_close()
    assert seen[0] is not None and seen[0].startswith("Basic ") and seen[1:] == [None], seen


def test_an_upload_replacing_a_dataset_cut_off_half_way_leaves_no_dataset_to_read(
        tmp_path, flaky_http):
    """An edited source prepared in a new stage folder for the prefix of the old one, its
    upload cut off after some shards: the old info file listed old and new shards as one
    dataset, which a run trained on without a word (samples twice, others never). The prefix
    reads as an unfinished upload now, refused in one line, and the rerun finishes it."""
    url, server, www = flaky_http
    server.p_503 = server.p_cut = 0.0
    args = pets(tmp_path)
    assert run_launcher("prepare_data.py", *args, "--out", f"{url}/pets").returncode == 0
    (tmp_path / "raw" / "train" / "cat" / "0001.jpg").rename(
        tmp_path / "raw" / "train" / "dog" / "0009.jpg")
    edited = [a if a != str(tmp_path / "stage") else str(tmp_path / "stage2") for a in args]
    server.refused_puts = "-train-000001.tar"  # the second shard's upload is refused
    cut = run_launcher("prepare_data.py", *edited, "--out", f"{url}/pets")
    assert cut.returncode == 1 and "imagefolder-train-000001.tar" in \
        cut.stderr.strip().splitlines()[-1], cut.stderr[-2000:]
    assert (www / "pets/imagefolder-train-000000.tar").read_bytes() == \
        (tmp_path / "stage2/imagefolder-train-000000.tar").read_bytes()  # the new one is there
    run = run_launcher("pretrain.py", *tiny_run_args(tmp_path / "run", f"{url}/pets"))
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: '{url}/pets' is being replaced by a launch/prepare_data.py upload that has not "
        f"finished (its shards are sent first, {url}/pets/_info.json last); rerun that "
        f"prepare_data.py command to finish it")
    server.refused_puts = ""
    done = run_launcher("prepare_data.py", *edited, "--out", f"{url}/pets")
    assert done.returncode == 0, done.stderr[-2000:]
    from pretrain.data.eval_loader import EvalLoader
    loader = EvalLoader(ShardSet.from_info(f"{url}/pets", "train"), img_size=16, batch_size=4,
                        num_classes=2)
    got = sorted((k, int(y)) for b in loader for k, y in zip(b.keys, b.labels) if k)
    assert ("dog/0009", 1) in got and not any(k == "cat/0001" for k, _ in got)


def test_a_prefix_that_takes_no_uploads_is_refused_before_any_shard_is_written(
        tmp_path, s3_server, flaky_http):
    """A read-only S3 role, or an HTTP server without PUT, is found out by the first upload,
    which is made before the shards are prepared, and refused at once (no retries)."""
    import boto3

    s3, iam = boto3.client("s3"), boto3.client("iam")
    s3.create_bucket(Bucket="datasets")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Resource": "*",
                                                "Action": ["s3:GetObject", "s3:ListBucket"]}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    reader = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
              "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def moto_auth(count: bytes) -> None:  # from here, requests need the IAM user's rights
        urllib.request.urlopen(urllib.request.Request(
            f"{s3_server['AWS_ENDPOINT_URL']}/moto-api/reset-auth", data=count, method="POST",
            headers={"Content-Type": "text/plain"}), timeout=30).close()

    moto_auth(b"0")
    try:
        done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", "s3://datasets/pets",
                            env=reader)
    finally:
        moto_auth(b"inf")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --out s3://datasets/pets refuses uploads (s3://datasets/pets/_stage_id: S3 "
        "AccessDenied: Access Denied); fix the credentials, the server or the URL (checked "
        "before preparing anything)")
    assert not list((tmp_path / "stage").glob("*.tar"))

    url, server, _ = flaky_http
    server.p_503 = server.p_cut = 0.0
    server.refuse_put = 405
    done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", f"{url}/pets")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --out {url}/pets refuses uploads ({url}/pets/_stage_id: HTTP 405 Method Not "
        f"Allowed); fix the credentials, the server or the URL (checked before preparing "
        f"anything)")
    assert not list((tmp_path / "stage").glob("*.tar"))
    server.refuse_put = 0
    # a start refused after it claimed the prefix (no images in --src): the prefix holds its
    # marker with those options, and the corrected command still goes on
    (tmp_path / "empty").mkdir()
    args = pets(tmp_path)
    wrong = [str(tmp_path / "empty") if a == str(tmp_path / "raw") else a for a in args]
    done = run_launcher("prepare_data.py", *wrong, "--out", f"{url}/pets")
    assert done.returncode == 2, done.stderr[-2000:]
    done = run_launcher("prepare_data.py", *args, "--out", f"{url}/pets")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_pets(f"{url}/pets")
    # a rerun refused at its start, the marker unreadable meanwhile: the upload log stays
    # good, and the next rerun sends nothing again
    server.refuse_get, server.refuse_put = 503, 403
    done = run_launcher("prepare_data.py", *args, "--out", f"{url}/pets")
    assert done.returncode == 2 and "refuses uploads" in done.stderr, done.stderr[-2000:]
    server.refuse_get = server.refuse_put = 0
    done = run_launcher("prepare_data.py", *args, "--out", f"{url}/pets")
    assert done.returncode == 0 and "uploaded 0 of " in done.stderr, done.stderr[-2000:]
    # a pipe command that cannot run (mistyped) is no outage: said at once, not retried for
    # minutes in silence
    done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", "pipe:nosuch-uploader",
                        timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: --out pipe:nosuch-uploader refuses uploads (the pipe command cannot run (exit "
        "status 127: "), done.stderr[-2000:]
    assert "retrying" not in done.stderr
    # one that runs and fails (a bucket that is not there, say) is tried twice, then refused:
    # it used to be retried through the whole back-off, minutes, then "rerun to resume"
    failing = "pipe:sh -c 'cat >/dev/null; echo NoSuchBucket >&2; exit 1' upload"
    done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", failing, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --out {failing} took no upload ({failing}/_stage_id: upload failed 2 times "
        f"(last: ConnectionError: exit status 1: NoSuchBucket)); check the endpoint, the URL or "
        f"the command, or rerun if the server was only busy (checked before preparing "
        f"anything)"), done.stderr[-2000:]


def test_a_stage_folder_holding_a_users_files_is_refused_before_the_prefix_is_claimed(
        tmp_path, flaky_http):
    """It wrote its bookkeeping into the folder and claimed the prefix first, then refused
    the folder naming --out; the corrected command, with other options, was then refused too
    (the prefix held an unfinished upload of those options)."""
    url, server, _ = flaky_http
    server.p_503 = server.p_cut = 0.0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("keep me")
    args = [str(mine) if a == str(tmp_path / "stage") else a for a in pets(tmp_path)]
    done = run_launcher("prepare_data.py", *args, "--out", f"{url}/pets")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {mine} is not empty (thesis.txt) and holds no prepare_data output; choose a "
        f"new or empty --stage")
    assert [p.name for p in mine.iterdir()] == ["thesis.txt"]
    done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", f"{url}/pets",
                        "--shard-size", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_pets(f"{url}/pets")


def test_an_upload_that_fails_is_retried_with_a_line_for_each_failure(tmp_path, caplog):
    """It waited minutes between tries without a word (an endpoint away, a flaky link)."""
    from pretrain.data.publish import upload
    from pretrain.data.remote import RetryPolicy, Unreachable
    local = tmp_path / "f"
    local.write_bytes(b"shard")
    mark, dest = tmp_path / "failed-once", tmp_path / "dest"
    flaky = f"pipe:if [ -e {mark} ]; then cat > {dest}; else touch {mark}; exit 1; fi #"
    with caplog.at_level("WARNING", logger="pretrain.data.publish"):
        upload(str(local), flaky, RetryPolicy(attempts=3, backoff_s=0.01))
    assert dest.read_bytes() == b"shard"
    assert re.search(r"upload failed \(ConnectionError: exit status 1\); retrying in "
                     r"[\d.]+ s \(failure 1 of 3\)", caplog.text), caplog.text
    with pytest.raises(Unreachable, match=r"upload failed 2 times"):
        upload(str(local), "pipe:exit 1 #", RetryPolicy(attempts=2, backoff_s=0.01))


@pytest.fixture
def gcs_server(monkeypatch):
    """A Google Cloud Storage emulator (gcp-storage-emulator's JSON API) on the loopback
    address with a bucket ``datasets``, and the variables that point gcsfs at it. gcsfs first
    asks GCS's gRPC control API whether a bucket is hierarchical, which no emulator serves (a
    60 s timeout per bucket); GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false leaves that question out."""
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="datasets")
    server.start()
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield env
    server.stop()


def test_gcs_shards_written_by_prepare_data_are_read_by_two_ranks_like_local_ones(tmp_path,
                                                                                   gcs_server):
    """gs:// goes through fsspec and gcsfs, for writing and reading alike; two ranks with two
    loader workers each (forked after the info file was read) consume exactly the local keys."""
    import gcsfs

    args = pets(tmp_path)
    done = run_launcher("prepare_data.py", *args, "--out", "gs://datasets/pets")
    assert done.returncode == 0, done.stderr[-2000:]
    fs = gcsfs.GCSFileSystem(token="anon")
    listed = {p.rsplit("/", 1)[1]: fs.size(p) for p in fs.ls("datasets/pets")}
    # which stage folder uploaded there last, and the preparation's settings
    marker = json.loads(fs.cat("datasets/pets/_stage_id"))
    assert marker["stage_id"] == (tmp_path / "stage" / ".stage_id").read_text()
    assert marker["prepare"]["shard_size"] == 2 and listed.pop("_stage_id") > 32
    assert listed == {f.name: f.stat().st_size for f in (tmp_path / "stage").iterdir()
                      if not f.name.startswith(".")}
    assert_pets("gs://datasets/pets")
    again = run_launcher("prepare_data.py", *args, "--out", "gs://datasets/pets")
    assert again.returncode == 0 and f"uploaded 0 of {len(listed)} files" in again.stderr, \
        again.stderr[-2000:]

    local = tmp_path / "shards"
    write_split(local, SHARD_LENGTHS)
    for f in sorted(local.iterdir()):
        fs.put_file(str(f), f"datasets/toy/{f.name}")
    ranks = run_two_ranks("gs://datasets/toy", tmp_path, STEPS, SAVE_AT, env=gcs_server)
    assert_same_as_local(ranks, local_reference(local))


class GcsWithoutAccess(BaseHTTPRequestHandler):
    """Google Cloud Storage's JSON API as credentials without access to the bucket meet it:
    every request is answered 403 with GCS's error body (counted in ``server.requests``); but
    the metadata of the objects in ``server.listed`` ({name: size}), which a role that may
    list a bucket but not read its objects gets."""

    def log_message(self, *args):  # keep the test output readable
        pass

    def _refuse(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))  # an upload's body
        self.server.requests += 1
        name = self.path.split("?")[0].rsplit("/o/", 1)[-1]
        if self.command == "GET" and "alt=media" not in self.path and name in self.server.listed:
            body = json.dumps({"kind": "storage#object", "bucket": "datasets", "name": name,
                               "size": str(self.server.listed[name]), "generation": "1",
                               "updated": "2026-11-28T00:00:00.000Z",
                               "contentType": "application/x-tar"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        message = ("tester@example.iam.gserviceaccount.com does not have storage.objects.get "
                   "access to the Google Cloud Storage object. Permission 'storage.objects.get' "
                   "denied on resource (or it may not exist).")
        body = json.dumps({"error": {"code": 403, "message": message, "errors": [
            {"message": message, "domain": "global", "reason": "forbidden"}]}}).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it heard enough
            self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_HEAD = _refuse


@pytest.fixture
def gcs_without_access(monkeypatch):
    """(server, environment) of :class:`GcsWithoutAccess` on 127.0.0.1, gcsfs pointed at it."""
    import fsspec

    server = ThreadingHTTPServer(("127.0.0.1", 0), GcsWithoutAccess)
    server.requests, server.listed = 0, {}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.server_address[1]}",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fs_class = fsspec.get_filesystem_class("gs")
    fs_class.clear_instance_cache()  # one made for another test's server is not this one
    yield server, env
    fs_class.clear_instance_cache()
    server.shutdown()
    server.server_close()


def test_a_gcs_bucket_the_credentials_may_not_read_is_said_at_once_not_retried(
        tmp_path, gcs_without_access):
    """gcsfs raises a GCS 403 as a plain OSError, which was retried as an outage: minutes of
    back-off per shard, then "unreachable". A refusal is now one line at once, when reading
    (a shard, the info file a run starts from) and when prepare_data.py uploads."""
    from pretrain.data.info import InfoNotRead, read_info

    server, env = gcs_without_access
    denied = (r"GCS 403 Forbidden: \S+ tester@example.iam.gserviceaccount.com does not have "
              r"storage.objects.get access")
    # not retried: 10 attempts would ask at least 10 times (gcsfs asks up to 3 times in one:
    # the object, then a folder of that name, unless it has these answers cached)
    policy = RetryPolicy(attempts=10, backoff_s=0.5)
    before = server.requests
    with pytest.raises(PermissionError, match=rf"^gs://datasets/toy.tar: {denied}"):
        open_shard("gs://datasets/toy.tar", policy)
    assert server.requests - before < policy.attempts
    server.listed["toy.tar"] = 4096  # listed, not readable: refused at the first read
    shard = open_shard("gs://datasets/toy.tar", policy)
    before = server.requests
    with pytest.raises(PermissionError, match=rf"^gs://datasets/toy.tar: {denied}"):
        shard.read()
    assert server.requests - before < policy.attempts
    with pytest.raises(InfoNotRead, match=rf"^cannot read gs://datasets/toy/_info.json: "
                                          rf"gs://datasets/toy/_info.json: {denied}"):
        read_info("gs://datasets/toy", RetryPolicy(attempts=4, backoff_s=2.0))

    done = run_launcher("prepare_data.py", *pets(tmp_path), "--out", "gs://datasets/pets",
                        env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert re.fullmatch(r"error: --out gs://datasets/pets refuses uploads \(gs://datasets/pets/"
                        r"_stage_id: GCS 403 Forbidden: .*\); fix the credentials, the server "
                        r"or the URL \(checked before preparing anything\)",
                        done.stderr.strip().splitlines()[-1]), done.stderr[-2000:]
    assert not list((tmp_path / "stage").glob("*.tar"))


def test_a_shard_the_credentials_may_not_read_stops_the_run_or_is_skipped_and_counted(
        tmp_path, flaky_http):
    """One shard refused (HTTP 403: an object the job's account may not read) was counted as
    a truncated shard and skipped even under data.missing_shards=error. It is the input's
    fault, as a missing shard is: the run stops naming it, or skips and counts it as missing."""
    from pretrain.config import DataConfig
    from pretrain.data.loader import build_train_loader
    from pretrain.data.shards import LoaderError, ShardUnreachable

    url, server, www = flaky_http
    server.p_503 = server.p_cut = 0.0
    write_split(www / "toy", [4, 4, 4])
    server.refuse_get, server.refused = 403, "toy-train-000001.tar"
    args = dict(img_size=32, batch_size=4, num_classes=10)
    data = DataConfig(root=f"{url}/toy", num_workers=1, shuffle_buffer=2, missing_shards="skip",
                      read_attempts=4, retry_backoff_s=2.0)
    loader = two_epochs_without_shard_1(data, args)
    assert loader.skipped_by_cause["truncated_shard"] == 0

    loader = build_train_loader(data.model_copy(update={"missing_shards": "error"}), **args)
    it = iter(loader)
    with pytest.raises(LoaderError, match=rf"^shard {url}/toy/toy-train-000001.tar cannot be "
                                          rf"read \(.*HTTP 403 Forbidden\); fix the "
                                          rf"credentials or the storage's permissions, or set "
                                          rf"data.missing_shards=skip"):
        for _ in range(3):  # an epoch: the shard is reached
            next(it)
    del it
    # a CDN's 522 (origin timed out) is no refusal: retried, then unreachable (exit code 1,
    # a crash that a requeue may get past), not "fix the credentials" (2)
    server.refuse_get = 522
    quick = data.model_copy(update={"missing_shards": "error", "read_attempts": 2,
                                    "retry_backoff_s": 0.01})
    it = iter(build_train_loader(quick, **args))
    with pytest.raises(ShardUnreachable, match=r"HTTP 522 .*2 attempts in a row failed|"
                                               r"2 attempts in a row failed.*HTTP 522"):
        for _ in range(3):
            next(it)
    del it


class StallingProxy:
    """A TCP proxy on 127.0.0.1 in front of a server. On the first connection whose answers
    pass ``after`` bytes it sends those bytes and then nothing: the connection stays open and
    silent, as a stalled object store's does, until the client closes it or ``hold_s`` passes
    (then the proxy cuts it: a failure of another kind). The others it passes through."""

    def __init__(self, port: int, after: int = 4000, hold_s: float = 20.0):
        self.target, self.after, self.hold_s = ("127.0.0.1", port), after, hold_s
        self.stalls_left, self.stalled, self.given_up, self.cut = 1, 0, 0, 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            client_gone = threading.Event()
            threading.Thread(target=self._requests, args=(client, server, client_gone),
                             daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client, client_gone),
                             daemon=True).start()

    @staticmethod
    def _requests(client, server, client_gone):
        # the client closing (a clean end) or resetting (an error) its side: gone either way
        with contextlib.suppress(OSError):
            while chunk := client.recv(65536):
                server.sendall(chunk)
        client_gone.set()
        _cut(server)

    def _answers(self, server, client, client_gone):
        sent = 0
        # a side resetting the connection ends it, as it would a real one
        with contextlib.suppress(OSError):
            while chunk := server.recv(65536):
                if sent + len(chunk) > self.after:
                    with self.lock:
                        stall, self.stalls_left = self.stalls_left > 0, 0
                    if stall:
                        client.sendall(chunk[:self.after - sent])
                        self.stalled += 1
                        if client_gone.wait(self.hold_s):
                            self.given_up += 1
                        else:
                            self.cut += 1
                        break
                client.sendall(chunk)
                sent += len(chunk)
        _cut(client)
        _cut(server)

    def close(self):
        self.listener.close()


def _cut(sock):
    """Close a connection for good: a plain close() waits for another thread's recv() on it."""
    with contextlib.suppress(OSError):  # the other pump cut it already
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.mark.parametrize("scheme", ["http", "s3", "gs", "pipe"])
def test_a_stalled_read_is_given_up_after_read_timeout_s_and_read_again(scheme, tmp_path,
                                                                         request, caplog):
    """An object store, web server or command that goes silent in the middle of a shard: after
    data.read_timeout_s without a byte the read is given up and made again, and the bytes are
    those of the shard. Without the limit the loader waited for the store's own timeout (boto3:
    60 s, gcsfs: 5 min) or, for a command, for ever."""
    local = tmp_path / "shards"
    write_split(local, [9])
    shard = (local / "toy-train-000000.tar").read_bytes()
    proxy = None
    if scheme == "http":
        url, server, www = request.getfixturevalue("flaky_http")
        server.p_503 = server.p_cut = 0.0
        (www / "toy.tar").write_bytes(shard)
        proxy = StallingProxy(server.server_address[1])
        location = f"http://127.0.0.1:{proxy.port}/toy.tar"
    elif scheme == "s3":
        import boto3
        env = request.getfixturevalue("s3_server")
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="datasets")
        s3.put_object(Bucket="datasets", Key="toy.tar", Body=shard)
        proxy = StallingProxy(int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
        request.getfixturevalue("monkeypatch").setenv("AWS_ENDPOINT_URL",
                                                      f"http://127.0.0.1:{proxy.port}")
        location = "s3://datasets/toy.tar"
    elif scheme == "gs":
        env = request.getfixturevalue("gcs_server")
        import gcsfs  # after the fixture's variables: gcsfs reads them at import
        gcsfs.GCSFileSystem(token="anon").pipe_file("datasets/toy.tar", shard)
        proxy = StallingProxy(int(env["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1]))
        request.getfixturevalue("monkeypatch").setenv("STORAGE_EMULATOR_HOST",
                                                      f"http://127.0.0.1:{proxy.port}")
        location = "gs://datasets/toy.tar"
    else:  # the first run writes 4000 bytes and goes silent for 20 s; the next one is whole
        mark, path = tmp_path / "ran-once", local / "toy-train-000000.tar"
        location = (f"pipe:if [ -e {mark} ]; then cat {path}; else touch {mark}; "
                    f"head -c 4000 {path}; sleep 20; fi")
    with caplog.at_level("WARNING", logger="pretrain.data.remote"):
        got = open_shard(location, RetryPolicy(attempts=3, backoff_s=0.01, timeout_s=1.0)).read()
    assert got == shard
    if proxy is not None:
        proxy.close()
        # the client gave up on the silent connection itself, long before the proxy cut it (the
        # proxy's thread counts which, once it has seen the client go: waited for, bounded)
        deadline = time.monotonic() + 30
        while proxy.given_up + proxy.cut < proxy.stalled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (proxy.stalled, proxy.given_up, proxy.cut) == (1, 1, 0)
    else:
        assert re.search(r"TimeoutError: '.*' wrote nothing for 1 s; retrying at byte \d+",
                         caplog.text), caplog.text

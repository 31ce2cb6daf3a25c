"""Writing a prepared dataset to where training reads it (``prepare_data.py --out URL``).

:func:`publish` uploads a stage folder's files under a prefix (``s3://``, ``gs://`` and other
fsspec URLs, an HTTP prefix that takes PUT, or ``pipe:<command>``), the info file last, each
upload retried with :mod:`pretrain.data.remote`'s back-off. A rerun resumes: what this stage
folder sent already, unchanged since, is not sent again -- unless another stage folder has
uploaded to the prefix in between (``_stage_id``), whose files may differ with the same size.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from typing import Optional

from pretrain.data.remote import (RETRY_HTTP, RetryPolicy, Unreachable, _s3_client, _s3_parts,
                                  fsspec_location, read_bytes)

log = logging.getLogger(__name__)


def _put(local: str, location: str, policy: RetryPolicy) -> None:
    """One attempt at writing ``local`` to ``location``."""
    if location.startswith("s3://"):
        bucket, key = _s3_parts(location)
        _s3_client(policy.timeout_s).upload_file(local, bucket, key)
    elif location.startswith(("http://", "https://")):  # a PUT, as WebDAV or a presigned URL take
        with open(local, "rb") as f:
            req = urllib.request.Request(location, data=f, method="PUT", headers={
                "Content-Length": str(os.path.getsize(local)),
                "Content-Type": "application/octet-stream"})
            urllib.request.urlopen(req, timeout=policy.timeout_s).close()
    elif location.startswith("pipe:"):  # the command gets the file on its standard input
        with open(local, "rb") as f:
            done = subprocess.run(location[len("pipe:"):], shell=True, stdin=f,
                                  capture_output=True)
        if done.returncode:
            err = done.stderr.decode(errors="replace").strip().splitlines()
            raise ConnectionError(f"exit status {done.returncode}" + (f": {err[-1]}" if err else ""))
    else:
        fs, path = fsspec_location(location, policy.timeout_s)
        fs.put_file(local, path)


def upload(local: str, location: str, policy: RetryPolicy = RetryPolicy()) -> None:
    """Copy a finished local file to ``location`` (s3://, gs:// or another fsspec URL, an HTTP
    PUT, or ``pipe:<command>`` fed the file), retrying failures after a back-off; on object
    stores the object appears whole or not at all."""
    for failures in range(1, policy.attempts + 1):
        try:
            _put(local, location, policy)
            return
        except (ImportError, PermissionError):
            raise
        except Exception as e:  # noqa: BLE001 -- transport errors of boto3, urllib, fsspec
            if isinstance(e, urllib.error.HTTPError) and e.code not in RETRY_HTTP:
                raise PermissionError(f"{location}: HTTP {e.code} {e.reason}") from None
            if failures == policy.attempts:
                raise Unreachable(f"{location}: upload failed {failures} times "
                                  f"(last: {type(e).__name__}: {e})") from None
            time.sleep(policy.wait(failures))


def remote_size(location: str, timeout_s: float) -> Optional[int]:
    """The size of an object already at ``location``; None when it is not there, or when that
    cannot be known (``pipe:``)."""
    try:
        if location.startswith("pipe:"):
            return None
        if location.startswith(("http://", "https://")):
            req = urllib.request.Request(location, method="HEAD")
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    length = resp.headers.get("Content-Length")
                    return int(length) if length is not None else None
            except urllib.error.HTTPError:
                return None
        if location.startswith("s3://"):
            from botocore.exceptions import ClientError
            bucket, key = _s3_parts(location)
            try:
                return _s3_client(timeout_s).head_object(Bucket=bucket, Key=key)["ContentLength"]
            except ClientError:
                return None
        fs, path = fsspec_location(location, timeout_s)
        return fs.size(path)
    except FileNotFoundError:
        return None


# In the stage folder: each file this folder sent, where to, and the size and mtime it had.
UPLOAD_LOG = ".uploaded.jsonl"
# The stage folder's own id (local, hidden), and the copy of it under the prefix that says
# which stage folder uploaded there last: only then is this folder's log about what is there.
STAGE_ID, PREFIX_STAGE_ID = ".stage_id", "_stage_id"


def _last_stage_here(folder: str, location: str, policy: RetryPolicy) -> tuple:
    """(this stage folder's id file, whether it is the one that uploaded to ``location``
    last). Another stage folder's upload in between (an edited source) may have replaced
    files with others of the same size, which this folder's log knows nothing of."""
    mine = os.path.join(folder, STAGE_ID)
    if not os.path.isfile(mine):
        with open(mine, "w") as f:
            f.write(uuid.uuid4().hex)
    if location.startswith("pipe:"):  # nothing can be read back: everything is sent anyway
        return mine, False
    try:
        quick = RetryPolicy(attempts=min(2, policy.attempts), backoff_s=policy.backoff_s,
                            timeout_s=policy.timeout_s)  # a failed read only costs a re-upload
        there = read_bytes(location.rstrip("/") + "/" + PREFIX_STAGE_ID, quick).decode()
    except (OSError, UnicodeDecodeError):  # not there (a first upload), or not readable
        there = None
    with open(mine) as f:
        return mine, there == f.read()


def _sent_before(folder: str, location: str) -> dict:
    """name -> [size, mtime_ns] of the files this folder already uploaded to ``location``."""
    sent = {}
    try:
        with open(os.path.join(folder, UPLOAD_LOG)) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a crash
                    continue
                if record.get("to") == location:
                    sent[record["name"]] = [record["size"], record["mtime_ns"]]
    except FileNotFoundError:
        pass
    return sent


def publish(folder: str, location: str, last: str, policy: RetryPolicy = RetryPolicy()) -> int:
    """Upload the files of ``folder`` (not its hidden work folders) under the prefix
    ``location``, the file named ``last`` (the info file) after all others, so a reader never
    finds it before the shards it lists. A file this folder already sent there, unchanged
    since, and still there with its size, is not sent again, so a rerun resumes -- as long as
    no other stage folder uploaded there since (``_stage_id`` under the prefix says which did
    last); anything else is replaced: an object of the same size may hold other samples (a
    preparation of an edited source). Returns the number of files uploaded."""
    names = sorted(n for n in os.listdir(folder) if not n.startswith(".")
                   and os.path.isfile(os.path.join(folder, n)))
    names.sort(key=lambda n: n == last)
    stage_id, last_here = _last_stage_here(folder, location, policy)
    sent_before = _sent_before(folder, location) if last_here else {}
    if not last_here:  # said first: a stage folder that uploads here later replaces it
        upload(stage_id, location.rstrip("/") + "/" + PREFIX_STAGE_ID, policy)
    sent = 0
    with open(os.path.join(folder, UPLOAD_LOG), "a") as record:
        for i, name in enumerate(names, 1):
            local, target = os.path.join(folder, name), location.rstrip("/") + "/" + name
            st = os.stat(local)
            mine = sent_before.get(name) == [st.st_size, st.st_mtime_ns]
            if not (mine and remote_size(target, policy.timeout_s) == st.st_size):
                upload(local, target, policy)
                sent += 1
                record.write(json.dumps({"to": location, "name": name, "size": st.st_size,
                                         "mtime_ns": st.st_mtime_ns}) + "\n")
                record.flush()
            if i == len(names) or i % max(1, len(names) // 20) == 0:
                log.info("published %d/%d files to %s", i, len(names), location)
    log.info("uploaded %d of %d files to %s (the others were there already, sent from this "
             "stage folder)", sent, len(names), location)
    return sent

"""Writing a prepared dataset to where training reads it (``prepare_data.py --out URL``).

:func:`publish` uploads a stage folder's files under a prefix (``s3://``, ``gs://`` and other
fsspec URLs, an HTTP prefix that takes PUT, or ``pipe:<command>``), the info file last, each
upload retried with :mod:`pretrain.data.remote`'s back-off. A rerun resumes: what this stage
folder sent already, unchanged since, is not sent again -- unless another stage folder has
uploaded to the prefix in between (``_stage_id``), whose files may differ with the same size.

:func:`claim_prefix` runs before anything is prepared: like a local output folder, a prefix that
holds another preparation (other settings or another source) or files this tool did not write
is refused, never overwritten. ``_stage_id`` carries the preparation's settings for that, so an
upload cut off before its ``_info.json`` is recognised too.

A dataset already under the prefix whose files an upload replaces (an edited source, prepared
in a new stage folder) first gets an info file that readers refuse, so that an upload cut off
half-way leaves no prefix that reads as one dataset while it holds the shards of two.
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

from pretrain.data.info import (UPLOAD_IN_PROGRESS, BucketMissing, DatasetInfoError,
                                InfoNotRead, NoInfo, StorageNotReached, UploadInProgress,
                                read_info)
from pretrain.data.remote import (RETRY_HTTP, S3_REFUSALS, RetryPolicy, Unreachable,
                                  _endpoint_hint, _s3_client, _s3_parts, fsspec_location,
                                  fsspec_refusal, http_request, read_bytes)
from pretrain.data.shard_writer import (STAGE_ID, STAGE_MARKER, UPLOAD_LOG, same_settings,
                                        settings_diff)
from pretrain.data.sources import PrepareError

log = logging.getLogger(__name__)


def _put(local: str, location: str, policy: RetryPolicy) -> None:
    """One attempt at writing ``local`` to ``location``."""
    if location.startswith("s3://"):
        bucket, key = _s3_parts(location)
        _s3_client(policy.timeout_s).upload_file(local, bucket, key)
    elif location.startswith(("http://", "https://")):  # a PUT, as WebDAV or a presigned URL take
        with open(local, "rb") as f:
            req = http_request(location, data=f, method="PUT", headers={
                "Content-Length": str(os.path.getsize(local)),
                "Content-Type": "application/octet-stream"})
            urllib.request.urlopen(req, timeout=policy.timeout_s).close()
    elif location.startswith("pipe:"):  # the command gets the file on its standard input
        with open(local, "rb") as f:
            done = subprocess.run(location[len("pipe:"):], shell=True, stdin=f,
                                  capture_output=True)
        if done.returncode:
            err = done.stderr.decode(errors="replace").strip().splitlines()
            said = f"exit status {done.returncode}" + (f": {err[-1]}" if err else "")
            if done.returncode in (126, 127):  # the shell's: no such command, not executable
                raise PermissionError(f"the pipe command cannot run ({said})")
            raise ConnectionError(said)
    else:
        fs, path = fsspec_location(location, policy.timeout_s)
        fs.put_file(local, path)


def _s3_refusal(e: BaseException) -> Optional[str]:
    """'S3 <code>: <message>' where ``e`` is an S3 refusal: boto3's upload_file raises a bare
    S3UploadFailedError while handling the ClientError that holds it."""
    for err in (e, e.__context__):
        error = getattr(err, "response", {}).get("Error", {})
        if error.get("Code") in S3_REFUSALS:
            return f"S3 {error['Code']}: {error.get('Message', '')}"
    return None


def upload(local: str, location: str, policy: RetryPolicy = RetryPolicy()) -> None:
    """Copy a finished local file to ``location`` (s3://, gs:// or another fsspec URL, an HTTP
    PUT, or ``pipe:<command>`` fed the file), retrying failures after a back-off; on object
    stores the object appears whole or not at all. A refusal (HTTP 403, 405, an S3
    AccessDenied, a GCS 403) raises PermissionError at once."""
    for failures in range(1, policy.attempts + 1):
        try:
            _put(local, location, policy)
            return
        except (ImportError, PermissionError):
            raise
        except Exception as e:  # noqa: BLE001 -- transport errors of boto3, urllib, fsspec
            if isinstance(e, urllib.error.HTTPError) and e.code not in RETRY_HTTP:
                raise PermissionError(f"{location}: HTTP {e.code} {e.reason}") from None
            refusal = _s3_refusal(e) or fsspec_refusal(e)
            if refusal:
                raise PermissionError(f"{location}: {refusal}") from None
            if failures == policy.attempts:
                raise Unreachable(f"{location}: upload failed {failures} times "
                                  f"(last: {type(e).__name__}: {e}"
                                  f"{_endpoint_hint(location, e)})") from None
            wait = policy.wait(failures)  # (minutes in all: said, not a silent pause)
            log.warning("%s: upload failed (%s: %s); retrying in %.1f s (failure %d of %d)%s",
                        location, type(e).__name__, e, wait, failures, policy.attempts,
                        _endpoint_hint(location, e) if failures == 1 else "")
            time.sleep(wait)


def remote_size(location: str, timeout_s: float) -> Optional[int]:
    """The size of an object already at ``location``; None when it is not there, or when that
    cannot be known (``pipe:``)."""
    try:
        if location.startswith("pipe:"):
            return None
        if location.startswith(("http://", "https://")):
            req = http_request(location, method="HEAD")
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


# In the stage folder: UPLOAD_LOG, each file this folder sent, where to, and the size and mtime
# it had; STAGE_ID, the folder's own id. Under the prefix, the marker that says which stage
# folder uploaded there last (only then is this folder's log about what is there), with the
# preparation's settings.
PREFIX_STAGE_ID = "_stage_id"


def _quick(policy: RetryPolicy) -> RetryPolicy:
    # a read-back that fails costs a re-upload at most: not worth the whole back-off
    return RetryPolicy(attempts=min(2, policy.attempts), backoff_s=policy.backoff_s,
                       timeout_s=policy.timeout_s)


def _marker(location: str, policy: RetryPolicy) -> Optional[dict]:
    """The ``_stage_id`` under the prefix as {"stage_id", "prepare"}; None when it is not there
    or cannot be read. (An older version of this tool wrote the id alone.)"""
    try:
        text = read_bytes(location.rstrip("/") + "/" + PREFIX_STAGE_ID, policy).decode()
    except (OSError, UnicodeDecodeError):  # not there (a first upload), or not readable
        return None
    try:
        marker = json.loads(text)
    except ValueError:
        marker = None
    return marker if isinstance(marker, dict) else {"stage_id": text, "prepare": None}


def existing_stage_id(folder: str) -> Optional[str]:
    """The id of stage folder ``folder``; None before its first upload."""
    try:
        with open(os.path.join(folder, STAGE_ID)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _stage_id(folder: str) -> str:
    """This stage folder's id (made on first use)."""
    stage_id = existing_stage_id(folder)
    if stage_id is None:
        os.makedirs(folder, exist_ok=True)
        stage_id = uuid.uuid4().hex
        with open(os.path.join(folder, STAGE_ID), "w") as f:
            f.write(stage_id)
    return stage_id


def _there(location: str, policy: RetryPolicy) -> Optional[dict]:
    """The marker under the prefix (None: none, or a pipe, which cannot be read back)."""
    return None if location.startswith("pipe:") else _marker(location, _quick(policy))


def _send_marker(folder: str, location: str, there: Optional[dict], settings: Optional[dict],
                 policy: RetryPolicy) -> None:
    """Say under the prefix that this stage folder uploads there, with the preparation's
    settings (for :func:`_check_prefix`). Where the marker ``there`` was another folder's (or
    none, or unreadable), what this folder's log says it sent there before is void once this
    one is up: another folder may have replaced those files, and nothing under the prefix says
    so any more. (An upload that fails changes nothing: the rerun resumes.)"""
    stage_id = _stage_id(folder)
    marker = os.path.join(folder, STAGE_MARKER)
    with open(marker, "w") as f:
        json.dump({"stage_id": stage_id, "prepare": settings}, f)
    upload(marker, location.rstrip("/") + "/" + PREFIX_STAGE_ID, policy)
    if there is None or there.get("stage_id") != stage_id:
        with open(os.path.join(folder, UPLOAD_LOG), "a") as record:
            record.write(json.dumps({"to": location, "void": True}) + "\n")


def claim_prefix(folder: str, location: str, settings: dict,
                 policy: RetryPolicy = RetryPolicy()) -> None:
    """Before anything is prepared for ``location`` from stage folder ``folder``: refuse a
    prefix that holds something else (:func:`_check_prefix`), then write the folder's marker
    there (a rerun too, whose credentials may have changed): a prefix that takes no uploads (a
    read-only role, a server without PUT, a wrong endpoint, a pipe command that fails) is found
    out now, not after hours of preparation, and in seconds: nothing is lost by a rerun yet,
    so the upload is tried twice, not through the whole back-off."""
    unchecked = _check_prefix(location, settings, policy, existing_stage_id(folder))
    there = _there(location, policy)
    try:
        _send_marker(folder, location, there, settings, _quick(policy))
    except PermissionError as e:
        raise PrepareError(f"--out {location} refuses uploads ({e}); fix the credentials, the "
                           f"server or the URL (checked before preparing anything)") from None
    except Unreachable as e:
        raise PrepareError(f"--out {location} took no upload ({e}); check the endpoint, the "
                           f"URL or the command, or rerun if the server was only busy "
                           f"(checked before preparing anything)") from None
    if unchecked:  # said once the prefix took an upload: not before the refusal of one
        log.warning("could not check what %s holds (%s); uploading without that check",
                    location, unchecked)


def _holds_files(location: str, timeout_s: float) -> bool:
    """Whether anything is stored under the prefix; False where it cannot be listed (an HTTP
    prefix; a listing refused: the upload itself then says what is wrong)."""
    if location.startswith(("http://", "https://", "pipe:")):
        return False
    prefix = location.rstrip("/") + "/"
    try:
        if location.startswith("s3://"):
            bucket, key = _s3_parts(prefix)
            listed = _s3_client(timeout_s).list_objects_v2(Bucket=bucket, Prefix=key.lstrip("/"),
                                                           MaxKeys=1)
            return listed.get("KeyCount", 0) > 0
        fs, path = fsspec_location(prefix, timeout_s)
        return bool(fs.ls(path.rstrip("/")))
    except FileNotFoundError:
        return False
    except Exception as e:  # noqa: BLE001 -- boto3's and fsspec's errors (no permission, ...)
        if getattr(e, "response", {}).get("Error", {}).get("Code") == "NoSuchBucket":
            raise PrepareError(f"{location}: the bucket does not exist; create it first "
                               f"(aws s3 mb s3://{_s3_parts(location)[0]})") from None
        log.warning("could not list %s to check that it is empty (%s)", location, e)
        return False


def _check_prefix(location: str, settings: dict, policy: RetryPolicy,
                  stage_id: Optional[str]) -> Optional[str]:
    """Refuse ``location`` before anything is prepared for it when it holds a dataset prepared
    with other settings, an unfinished upload of one, or files not written by prepare_data; a
    rerun of the same preparation (and a new stage folder for it: an edited source) goes on,
    and so does any rerun of stage folder ``stage_id`` over its own unfinished upload (its
    folder decides, as a local output folder does: a start refused after it claimed the prefix
    may be rerun with other options). ``pipe:`` cannot be read back and is not checked.
    Returns why the prefix could not be checked (None: checked)."""
    if location.startswith("pipe:"):
        return None
    try:
        info = read_info(location, retry=_quick(policy))
    except (NoInfo, UploadInProgress, BucketMissing):  # (an upload cut off: its marker says
        info = None                                    # whose; no bucket: the listing says)
    except StorageNotReached as e:  # a wrong address: no upload would reach it either
        raise PrepareError(f"--out {location}: {e} (checked before preparing anything)") \
            from None
    except InfoNotRead as e:  # a PUT-only server, a write-only S3 role, a blip: the upload says
        return str(e)
    except DatasetInfoError as e:  # malformed: not a prefix to write over blindly
        raise PrepareError(f"{e}; choose another --out") from None
    if info is not None:
        recorded, what = info.extra.get("prepare"), "a dataset"
        if recorded is None:
            raise PrepareError(f"{location} holds a dataset not written by prepare_data; "
                               f"choose another --out")
    else:
        marker = _marker(location, _quick(policy))
        if marker is None:
            if _holds_files(location, policy.timeout_s):
                raise PrepareError(f"{location} is not empty and holds no prepare_data output; "
                                   f"choose a new or empty --out prefix")
            return None
        recorded, what = marker.get("prepare"), "an unfinished upload"
        if recorded is None or marker.get("stage_id") == stage_id:  # (older markers: no
            return None  # settings to compare)
    if not same_settings(recorded, settings):
        raise PrepareError(f"{location} holds {what} prepared with "
                           f"{settings_diff(recorded, settings)}; rerun with the same options, "
                           f"or choose another --out (or delete what is there first)")
    return None


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
                # s3://b/x and s3://b/x/ are one prefix (the objects' names are the same)
                if str(record.get("to")).rstrip("/") != location.rstrip("/"):
                    continue
                if record.get("void"):  # another folder's files may be there since
                    sent.clear()
                else:
                    sent[record["name"]] = [record["size"], record["mtime_ns"]]
    except FileNotFoundError:
        pass
    return sent


def _hold_readers_off(folder: str, location: str, last: str, policy: RetryPolicy) -> bool:
    """Before files are replaced under a prefix that holds an info file (``last``; a pipe's
    cannot be known: there may be one), replace it with one every reader refuses
    (:class:`pretrain.data.info.UploadInProgress`); True when it did. The upload sends the real
    one last."""
    target = location.rstrip("/") + "/" + last
    if not location.startswith("pipe:") and remote_size(target, policy.timeout_s) is None:
        return False  # nothing there to mistake for the new dataset
    held = os.path.join(folder, ".upload_in_progress.json")
    with open(held, "w") as f:
        json.dump({UPLOAD_IN_PROGRESS: existing_stage_id(folder)}, f)
    upload(held, target, policy)
    return True


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
    # Another stage folder's upload in between (an edited source) may have replaced files with
    # others of the same size, which this folder's log knows nothing of: the log is voided as
    # this folder's marker replaces the other's (a pipe is never read back: all is sent).
    there = _there(location, policy)
    # said first: a stage folder that uploads here later replaces it; a marker an older
    # version wrote (the id alone), or this folder's with other settings (a start refused
    # after prepare_data claimed the prefix), is sent again with the settings, for _check_prefix
    prepared = read_info(folder).extra.get("prepare")
    if there != {"stage_id": _stage_id(folder), "prepare": prepared}:
        _send_marker(folder, location, there, prepared, policy)
    sent_before = _sent_before(folder, location)
    todo = set()
    for name in names:
        st = os.stat(os.path.join(folder, name))
        mine = sent_before.get(name) == [st.st_size, st.st_mtime_ns]
        if not (mine and remote_size(location.rstrip("/") + "/" + name,
                                     policy.timeout_s) == st.st_size):
            todo.add(name)
    if todo - {last} and _hold_readers_off(folder, location, last, policy):
        todo.add(last)
    sent = 0
    with open(os.path.join(folder, UPLOAD_LOG), "a") as record:
        for i, name in enumerate(names, 1):
            local, target = os.path.join(folder, name), location.rstrip("/") + "/" + name
            st = os.stat(local)
            if name in todo:
                upload(local, target, policy)
                sent += 1
                record.write(json.dumps({"to": location, "name": name, "size": st.st_size,
                                         "mtime_ns": st.st_mtime_ns}) + "\n")
                record.flush()
            if i == len(names) or i % max(1, len(names) // 20) == 0:
                log.info("published %d/%d files to %s", i, len(names), location)
    log.info("uploaded %d of %d files to %s%s", sent, len(names), location,
             " (the others were there already, sent from this stage folder)"
             if sent < len(names) else "")
    return sent

"""Shards where they live: a path, ``s3://``, ``gs://``, ``http(s)://`` or ``pipe:<command>``.

Object storage and HTTP fail now and then -- a connection reset in the middle of a 1 GB tar, a
503 from a busy endpoint, a read that stalls. A shard is therefore read through
:class:`RetryingReader`, a file object that, when a read fails, waits (exponential back-off with
jitter) and opens the location again *at the byte it had reached*: a range request for HTTP and
S3, a seek for files and ``gs://``, and for ``pipe:`` the command is run again and the bytes
already read are discarded. The tar reader above never sees the failure; it gets exactly the
bytes of one clean read, so every sample is read once and the loader's exact position and
exactly-once epochs hold. Only after ``attempts`` failures in a row (no byte gained in between)
does the location count as :class:`Unreachable`; a location that is not there (HTTP 404, S3
``NoSuchKey``, no such file) is :class:`Missing` at once -- retrying cannot bring it back --
one refused (HTTP 401/403, S3 ``AccessDenied``, GCS 401/403) is a PermissionError at once, and
another 4xx (400, 405) is :class:`Rejected` at once; a 5xx is retried.

The first contact is the exception: a read made with ``RetryPolicy.first_contact_s`` (the info
file a run, a tool or a plan starts from) that has reached nothing at all -- the connection
refused, no such host: :class:`NotReached` -- gives up after that many seconds as
:class:`NotAnswered`, not after the whole back-off (minutes): storage that never answered is a
wrong address (a mistyped ``AWS_ENDPOINT_URL``), not an outage to wait out. The few seconds let
a server that is still starting come up. Once anything answered there in this process, and in
every read without ``first_contact_s`` (the shards, read by the loader's workers mid-run), a
refused connection is retried like any failure: an outage of storage that was there.

A short read is a failure too: an HTTP server that closes the connection early ends the body
without an error in ``http.client``, so the reader compares what it got with the length the
server announced.

A stalled read is a failure as well: a connection or a command silent for ``timeout_s``
(``data.read_timeout_s``) is given up and opened again. The limit reaches HTTP through the
standard library's socket timeout, S3 through botocore's connect and read timeouts, ``gs://``
through gcsfs's per-read socket timeout, and a ``pipe:`` command through a wait for its output;
other fsspec schemes keep their driver's own.

S3 goes through ``boto3`` (endpoint, credentials and region from the usual ``AWS_*`` variables
and files, e.g. ``AWS_ENDPOINT_URL`` for MinIO, Ceph or a local test server); ``gs://`` and any
other scheme through ``fsspec`` (``pip install gcsfs`` for Google Cloud Storage).
"""
from __future__ import annotations

import base64
import errno
import io
import logging
import os
import random
import select
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Optional, Tuple

log = logging.getLogger(__name__)

# HTTP codes worth another try: timeouts, throttling and server-side trouble.
RETRY_HTTP = {408, 425, 429, 500, 502, 503, 504}
# ... and those that refuse the caller: the credentials, not the network; no retry changes them
REFUSED_HTTP = {401, 403, 407}
# S3 answers that no retry changes: the credentials or the bucket are wrong
S3_REFUSALS = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "NoSuchBucket",
               "SignatureDoesNotMatch", "InvalidBucketName", "AccountProblem"}


_JITTER = random.SystemRandom()


def _endpoint_hint(location: str, e: BaseException) -> str:
    """For an S3 endpoint nothing answers at: where the endpoint comes from (a MinIO or Ceph
    address mistyped, or set on one node only)."""
    if not location.startswith("s3://") or not (
            isinstance(e, NotReached)  # (a connect timeout too)
            or "EndpointConnectionError" in f"{type(e).__name__}: {e}"):  # (boto's: uploads)
        return ""
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    return (f"; is the endpoint right? AWS_ENDPOINT_URL={endpoint}" if endpoint else
            "; is the endpoint right? AWS_ENDPOINT_URL is unset: AWS itself, in the region of "
            "AWS_DEFAULT_REGION or ~/.aws/config")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try (``data.read_attempts``, ``data.retry_backoff_s``)."""

    attempts: int = 10  # failures in a row, without a byte gained, before giving up
    backoff_s: float = 1.0  # the first wait; doubled each time, at most max_backoff_s
    max_backoff_s: float = 60.0
    timeout_s: float = 120.0  # a connection or read silent this long has failed
    # where set: how long a read that has reached nothing yet (NotReached) keeps trying before
    # it is NotAnswered -- the first contact with the storage, at the start (see the top);
    # math.inf: every attempt (pretrain.data.info.read_info sets its default where None)
    first_contact_s: Optional[float] = None

    def wait(self, failures: int) -> float:
        # jitter: ranks that failed together do not retry together (from the OS: every rank's
        # loader workers start with the same seeds)
        return min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1)) * \
            _JITTER.uniform(0.5, 1.0)


def retry_policy(data) -> RetryPolicy:
    return RetryPolicy(attempts=data.read_attempts, backoff_s=data.retry_backoff_s,
                       timeout_s=data.read_timeout_s)


class Missing(FileNotFoundError):
    """The location does not exist."""


class NoBucket(Missing):
    """The S3 bucket of the location does not exist (a mistyped name, another endpoint's)."""


class Unreachable(OSError):
    """The location failed ``RetryPolicy.attempts`` times in a row."""


class NotReached(ConnectionError):
    """One attempt that reached no server: the connection refused, no such host, no route, a
    connect timeout. Nothing answered, unlike a 5xx or a connection cut mid-read."""


class NotAnswered(Unreachable):
    """A first contact (``RetryPolicy.first_contact_s``) that reached nothing through its
    seconds: nothing listens at the endpoint or host (a wrong address, a server not started)."""


class NotS3(Missing):
    """An S3 request answered 404 without S3's error document (no ``NoSuchKey``): what answers
    at the endpoint is no S3 server (``AWS_ENDPOINT_URL`` naming a web server, another port)."""


class Rejected(OSError):
    """The server rejects the request itself (an HTTP 4xx but 404, 410 and the refusals of
    the caller: 400, 405, ...): no retry changes it."""


def is_remote(location: str) -> bool:
    return location.startswith("pipe:") or ("://" in location
                                            and not location.startswith("file://"))


def _local(location: str) -> str:
    return location[len("file://"):] if location.startswith("file://") else location


# --------------------------------------------------------------------------------------------
# One attempt: open a location at a byte offset -> (stream, total length or None)
# --------------------------------------------------------------------------------------------
def _open_file(location: str, offset: int, policy: RetryPolicy):
    f = open(_local(location), "rb")  # FileNotFoundError is Missing's base
    f.seek(offset)
    return f, os.fstat(f.fileno()).st_size


def http_request(location: str, method: Optional[str] = None, data=None,
                 headers: Optional[dict] = None) -> urllib.request.Request:
    """A request for an ``http(s)://`` location. A ``user:password@`` in it is sent as basic
    authentication, as curl and wget send it; urllib alone would look the whole
    ``user:password@host`` up as a host name and fail as if the server were unreachable."""
    parts = urllib.parse.urlsplit(location)
    if "@" not in parts.netloc:
        return urllib.request.Request(location, data=data, method=method, headers=headers or {})
    user, _, password = parts.netloc.rpartition("@")[0].partition(":")
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
    location = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    req = urllib.request.Request(location, data=data, method=method, headers=headers or {})
    # not passed on to where a redirect leads (another host, a presigned URL), as curl does not
    req.add_unredirected_header("Authorization",
                                "Basic " + base64.b64encode(pair.encode()).decode())
    return req


# urllib's reasons for a request that reached no server (URLError wraps the connect's error)
_NOT_REACHED = (ConnectionRefusedError, socket.gaierror, TimeoutError)
_NO_ROUTE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}


def _open_http(location: str, offset: int, policy: RetryPolicy):
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        resp = urllib.request.urlopen(http_request(location, headers=headers),
                                      timeout=policy.timeout_s)
    except urllib.error.HTTPError as e:
        if e.code in (404, 410):
            raise Missing(f"{location}: HTTP {e.code}") from None
        if e.code == 416 and offset:  # resumed at the very end: nothing was left to read
            return io.BytesIO(b""), offset
        if e.code in REFUSED_HTTP:
            raise PermissionError(f"{location}: HTTP {e.code} {e.reason}") from None
        if e.code in RETRY_HTTP or e.code >= 500:  # (a CDN's 52x too)
            raise ConnectionError(f"HTTP {e.code} {e.reason}") from None
        raise Rejected(f"{location}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, _NOT_REACHED) or getattr(reason, "errno", None) in _NO_ROUTE:
            raise NotReached(f"{type(reason).__name__}: {reason}") from None
        raise
    length = resp.headers.get("Content-Length")
    if offset and resp.status != 206:  # the server ignores ranges: skip what was read before
        _discard(resp, offset)
        return resp, int(length) if length is not None else None
    return resp, offset + int(length) if length is not None else None


_S3 = {}


def _s3_client(timeout_s: float):
    # one per process (a client is not fork-safe: workers make their own) and per endpoint
    key = (os.getpid(), os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_PROFILE"),
           timeout_s)
    if key not in _S3:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ImportError("s3:// locations need boto3: pip install boto3") from None
        # botocore's own retries would hide failures from the back-off here; one layer retries
        _S3[key] = boto3.client("s3", config=Config(
            retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=timeout_s,
            read_timeout=timeout_s))
    return _S3[key]


def _s3_parts(location: str) -> Tuple[str, str]:
    bucket, _, key = location[len("s3://"):].partition("/")
    return bucket, key


def _s3_endpoint() -> str:
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    return f"AWS_ENDPOINT_URL={endpoint}" if endpoint else "AWS itself (AWS_ENDPOINT_URL is unset)"


def _open_s3(location: str, offset: int, policy: RetryPolicy):
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError
    bucket, key = _s3_parts(location)
    try:
        obj = _s3_client(policy.timeout_s).get_object(Bucket=bucket, Key=key,
                                      **({"Range": f"bytes={offset}-"} if offset else {}))
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code == "NoSuchBucket":
            raise NoBucket(f"{location}: S3 NoSuchBucket: the bucket '{bucket}' does not exist "
                           f"there") from None
        if code in ("", "404") and status == 404:  # botocore found no S3 error in the answer
            raise NotS3(f"{location}: HTTP 404 without an S3 error: what answers at "
                        f"{_s3_endpoint()} is no S3 server") from None
        if code in ("NoSuchKey", "404") or status == 404:
            raise Missing(f"{location}: {code or status}") from None
        if (code == "InvalidRange" or status == 416) and offset:  # resumed at the very end
            return io.BytesIO(b""), offset
        if code in S3_REFUSALS or status in REFUSED_HTTP:
            raise PermissionError(f"{location}: S3 {code or status}") from None
        if 400 <= status < 500 and status not in RETRY_HTTP and code not in (
                "SlowDown", "Throttling", "RequestTimeout"):
            raise Rejected(f"{location}: S3 {code or status}") from None
        raise ConnectionError(f"S3 {code or status}") from None  # SlowDown, a 5xx: retried
    except EndpointConnectionError as e:  # refused, no such host, a connect timeout
        raise NotReached(f"{type(e).__name__}: {e}") from None
    except BotoCoreError as e:  # read timeout, connection closed
        raise ConnectionError(f"{type(e).__name__}: {e}") from None
    return _S3Body(obj["Body"]), offset + obj["ContentLength"]


class _S3Body:
    """botocore's body, with its errors (a cut connection, a timeout) turned into OSError."""

    def __init__(self, body):
        self.body = body

    def read(self, n: int) -> bytes:
        from botocore.exceptions import BotoCoreError
        try:
            return self.body.read(n)
        except BotoCoreError as e:
            raise ConnectionError(f"{type(e).__name__}: {e}") from None

    def close(self) -> None:
        self.body.close()


def fsspec_location(location: str, timeout_s: float):
    """(fsspec filesystem, path) of a location; gcsfs given the connect and read timeout."""
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"{location.split('://')[0]}:// locations need fsspec and its driver "
                          f"(gs://: pip install gcsfs)") from None
    options = {}
    if location.startswith(("gs://", "gcs://")):
        # per socket read, not for the whole request (a plain number would be aiohttp's total)
        from aiohttp import ClientTimeout
        options["requests_timeout"] = ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
    return fsspec.core.url_to_fs(location, **options)


def fsspec_refusal(e: BaseException) -> Optional[str]:
    """What an fsspec driver's ``e`` says where it is a refusal no retry changes (wrong or no
    credentials, no access to the bucket), else None. s3fs raises PermissionError; gcsfs a plain
    OSError "Forbidden: <path>\n<message>" for a 403, and its HttpError for a 401."""
    if isinstance(e, PermissionError):
        return f"{type(e).__name__}: {e}"
    text = str(e).strip()
    if type(e) is OSError and text.startswith("Forbidden:"):
        return "GCS 403 " + " ".join(text.split("\n"))
    if type(e).__name__ == "HttpError" and getattr(e, "code", None) == 401:
        return f"GCS 401 Unauthorized: {text}"
    return None


class _Refusals:
    """An fsspec file whose refusals (:func:`fsspec_refusal`) are PermissionError, not retried."""

    def __init__(self, f, location: str):
        self.f, self.location = f, location

    def read(self, n: int) -> bytes:
        try:
            return self.f.read(n)
        except Exception as e:  # noqa: BLE001 -- the driver's own types
            refusal = fsspec_refusal(e)
            if refusal:
                raise PermissionError(f"{self.location}: {refusal}") from None
            raise

    def close(self) -> None:
        self.f.close()


def _open_fsspec(location: str, offset: int, policy: RetryPolicy):
    fs, path = fsspec_location(location, policy.timeout_s)
    try:
        f = fs.open(path, "rb")
    except FileNotFoundError as e:
        raise Missing(f"{location}: {e}") from None
    except Exception as e:  # noqa: BLE001 -- the driver's own types
        refusal = fsspec_refusal(e)
        if refusal:
            raise PermissionError(f"{location}: {refusal}") from None
        raise
    f.seek(offset)
    return _Refusals(f, location), getattr(f, "size", None)


class _Pipe:
    """A ``pipe:`` command's output; a non-zero exit status, or ``timeout_s`` without a byte,
    is a failed read."""

    def __init__(self, command: str, timeout_s: float):
        self.command, self.timeout_s = command, timeout_s
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0)

    def read(self, n: int) -> bytes:
        # what the command has written so far, up to n bytes (the reader above buffers)
        fd = self.proc.stdout.fileno()
        if n and not select.select([fd], [], [], self.timeout_s)[0]:
            raise TimeoutError(f"'{self.command}' wrote nothing for {self.timeout_s:g} s")
        data = os.read(fd, n)
        if not data and n and self.proc.wait() != 0:
            err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
            raise ConnectionError(f"'{self.command}' exited with status {self.proc.returncode}"
                                  + (f": {err[-1]}" if err else ""))
        return data

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def _open_pipe(location: str, offset: int, policy: RetryPolicy):
    stream = _Pipe(location[len("pipe:"):], policy.timeout_s)
    _discard(stream, offset)
    return stream, None


def _discard(stream, n: int) -> None:
    while n > 0:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the stream ended {n} bytes before the position to resume at")
        n -= len(chunk)


def open_at(location: str, offset: int, policy: RetryPolicy):
    """One attempt at ``location`` from byte ``offset``: (stream with read/close, total or None)."""
    if location.startswith("pipe:"):
        return _open_pipe(location, offset, policy)
    if location.startswith(("http://", "https://")):
        return _open_http(location, offset, policy)
    if location.startswith("s3://"):
        return _open_s3(location, offset, policy)
    if is_remote(location):
        return _open_fsspec(location, offset, policy)
    return _open_file(location, offset, policy)


# --------------------------------------------------------------------------------------------
# Retries
# --------------------------------------------------------------------------------------------
class RetryingReader(io.RawIOBase):
    """A location read front to back, resuming at the byte reached after a failure."""

    def __init__(self, location: str, policy: RetryPolicy = RetryPolicy()):
        self.location, self.policy = location, policy
        self.pos = 0
        self._stream, self._total = None, None
        self._started = time.monotonic()
        self._attempt(lambda: None)  # fail here, at open, for a location that is not there

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._attempt(lambda: self._read_into(buffer))

    def _read_into(self, buffer) -> int:
        data = self._stream.read(len(buffer))
        if not data and len(buffer) and self._total is not None and self.pos < self._total:
            raise ConnectionError(f"the connection ended at byte {self.pos} of {self._total}")
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def _attempt(self, step):
        failures = 0
        while True:
            try:
                if self._stream is None:
                    self._stream, self._total = open_at(self.location, self.pos, self.policy)
                    _ANSWERED.add(_server(self.location))
                return step()
            except (FileNotFoundError, PermissionError, Rejected, ImportError):  # Missing too
                _ANSWERED.add(_server(self.location))
                raise
            except Exception as e:  # noqa: BLE001 -- resets, timeouts, IncompleteRead, ...
                failures += 1
                self._drop()
                wait = self.policy.wait(failures)
                if not isinstance(e, NotReached):
                    _ANSWERED.add(_server(self.location))  # a 5xx, a cut: the server is there
                elif self.policy.first_contact_s is not None and \
                        _server(self.location) not in _ANSWERED:
                    spent = time.monotonic() - self._started
                    left = self.policy.first_contact_s - spent
                    if failures >= self.policy.attempts or left <= 0:
                        raise NotAnswered(f"{self.location}: nothing answered at "
                                          f"{_where(self.location)} ({failures} tries in "
                                          f"{spent:.0f} s; last: {e})") from None
                    wait = min(wait, left)  # the last try at the end of first_contact_s
                if failures >= self.policy.attempts:
                    raise Unreachable(f"{self.location}: {failures} attempts in a row failed "
                                      f"at byte {self.pos} (last: {type(e).__name__}: {e})"
                                      f"{_endpoint_hint(self.location, e)}") from None
                log.warning("%s: %s: %s; retrying at byte %d in %.1f s (failure %d of %d)%s",
                            self.location, type(e).__name__, e, self.pos, wait, failures,
                            self.policy.attempts,
                            _endpoint_hint(self.location, e) if failures == 1 else "")
                time.sleep(wait)

    def _drop(self) -> None:
        if self._stream is not None:
            try:
                self._stream.close()
            except Exception:  # noqa: BLE001 -- a broken connection may fail to close, too
                pass
        self._stream = None

    def close(self) -> None:
        self._drop()
        super().close()


# The servers (S3 endpoint, http(s) host) that answered in this process: a first contact with
# one of them that then reaches nothing is an outage of storage that was there, retried in full.
_ANSWERED: set = set()


def _server(location: str) -> str:
    if location.startswith("s3://"):
        return "s3:" + os.environ.get("AWS_ENDPOINT_URL", "")
    parts = urllib.parse.urlsplit(location)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def _where(location: str) -> str:
    """The server of ``location``, as a person would look it up."""
    return _s3_endpoint() if location.startswith("s3://") else _server(location)


def open_shard(location: str, policy: RetryPolicy = RetryPolicy()) -> io.BufferedReader:
    """``location`` as a buffered binary file that survives transient failures (see above)."""
    return io.BufferedReader(RetryingReader(location, policy), buffer_size=1 << 20)


def read_bytes(location: str, policy: RetryPolicy = RetryPolicy()) -> bytes:
    with open_shard(location, policy) as f:
        return f.read()

"""Where finished results live: named objects in a directory or an S3-compatible bucket.

Every head of a pipeline reads and writes the same store, so any head can answer for a result
another one made (results.py says which objects make up a result). Two backends:

    DirectoryObjects   a directory: --output-path; with several heads, a volume every head mounts
                       (ReadWriteMany). Writes go to a temporary name and are renamed into place.
    S3Objects          s3://BUCKET/PREFIX (--results-store) on any S3-compatible server
                       (--results-s3-endpoint), credentials from AWS_ACCESS_KEY_ID and
                       AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN, AWS_REGION when set), or from the
                       files AWS_ACCESS_KEY_ID_FILE etc. name (triptych.env_secrets). An S3 PUT
                       is atomic: a reader sees the old object or the new one.

Names are relative paths such as `videos/<job id>.json`; a name never starts with a dot.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from time import monotonic
from typing import Protocol
from urllib.parse import urlsplit

from triptych.env_secrets import (
    S3_ACCESS_KEY_ENV,
    S3_CREDENTIAL_ENV,
    S3_SECRET_KEY_ENV,
    S3_SESSION_TOKEN_ENV,
    EnvSecret,
    EnvSecretError,
    file_variable,
    read_env_secret,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # what a proxied download reads at a time
CLAIM_STALE_S = 60.0  # S3Objects.create: a rival claim this much older than ours was left by a dead head
# S3Objects.create's own bounds, so that a slow contender is never taken for a dead one: from its claim
# to the object's PUT at most a third of that, and the PUT itself within CLAIM_PUT_S, never retried.
CLAIM_PUT_S = 15.0


class ObjectMissing(KeyError):
    """No object of that name (never written, or removed meanwhile)."""


class StoreError(Exception):
    """The store cannot be used as configured; the message names the flag or variable to fix."""


@dataclass(frozen=True)
class StoredObject:
    name: str
    size: int
    mtime: float  # seconds since the epoch: when it was last written
    tag: str = ""  # changes whenever its content does (S3's ETag; a file's inode, mtime and size); "": unknown


class ObjectStore(Protocol):
    description: str  # for logs and errors: the directory or s3://bucket/prefix
    staging: Path  # a local folder where a file is written before put_file takes it

    def check(self) -> None:
        """Raise StoreError (naming what to fix) unless objects can be written, read and removed."""

    def put_bytes(self, name: str, data: bytes, content_type: str) -> None: ...

    def create(self, name: str, data: bytes, content_type: str) -> bool:
        """Write the object only if no object of that name exists, atomically: of several heads
        creating one name at once, at most one gets True. False: it exists, or (S3) another head
        was creating it at the same moment; the caller reads it, or tries again later."""

    def put_file(self, name: str, path: Path, content_type: str) -> None:
        """Store the file at `path` (under `staging`) as `name`; the file is consumed once stored, and
        left where it is when the store fails (the caller may still need its bytes)."""

    def get_bytes(self, name: str) -> bytes:
        """The object's bytes; ObjectMissing when there is none."""

    def stat(self, name: str) -> StoredObject | None: ...

    def list(self, prefix: str) -> Iterator[StoredObject]:
        """Every object whose name starts with `prefix` (a folder such as `videos/`, or `videos/<id>.`)."""

    def delete(self, name: str) -> None:
        """Remove the object; one already gone is not an error."""

    def local_path(self, name: str) -> Path | None:
        """The object as a local file (served with range requests), or None for a remote store."""

    def stream(self, name: str) -> Iterator[bytes]:
        """The object's bytes in chunks of CHUNK_BYTES (blocking: iterate it in a thread)."""

    def remove_leftovers(self, before: float) -> int:
        """Remove the local files that writes cut short left behind (a head killed mid-encode, a full
        disk), last written before `before` (seconds since the epoch); the bytes removed."""

    def presigned_url(self, name: str, expires_s: int, content_type: str, filename: str | None) -> str | None:
        """A URL that fetches the object without the head for `expires_s`, or None where the store has none."""


class DirectoryObjects:
    """Objects as files under `root`; several heads may share it (a ReadWriteMany volume)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.description = str(root)
        self.staging = root / ".staging"  # on the same filesystem: put_file is a rename

    def _path(self, name: str) -> Path:
        if name.startswith((".", "/")) or "/." in name or ".." in name.split("/") or "\x00" in name:
            raise ObjectMissing(name)  # temporary and staging files are nobody's result
        return self.root / name

    def check(self) -> None:
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
            probe = self.staging / f"probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StoreError(f"--output-path {self.root}: cannot write there ({exc}); give a writable folder") from None

    @staticmethod
    @contextmanager
    def _written_beside(path: Path, data: bytes) -> Iterator[Path]:
        """`data` in a temporary file beside `path` (same folder, so a rename or link is atomic), removed after."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            tmp.write_bytes(data)
            yield tmp
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, name: str, data: bytes, content_type: str) -> None:
        path = self._path(name)
        with self._written_beside(path, data) as tmp:
            os.replace(tmp, path)  # atomic: another head reads the old file or the new one, never half

    def create(self, name: str, data: bytes, content_type: str) -> bool:
        path = self._path(name)
        with self._written_beside(path, data) as tmp:
            try:
                os.link(tmp, path)  # atomic and exclusive, on NFS too: fails when the name exists
            except FileExistsError:
                return False
            except OSError:  # no hard links here (SMB shares): exclusive still, the content lands just after
                return self._create_exclusive(path, data)
        return True

    @staticmethod
    def _create_exclusive(path: Path, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def put_file(self, name: str, path: Path, content_type: str) -> None:
        target = self._path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            shutil.move(path, tmp)  # a rename when staging is on the same filesystem
            os.replace(tmp, target)
        except BaseException:
            if tmp.exists() and not path.exists():
                shutil.move(tmp, path)  # the bytes back where the caller has them
            raise
        finally:
            tmp.unlink(missing_ok=True)
        path.unlink(missing_ok=True)

    def get_bytes(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectMissing(name) from None

    def stat(self, name: str) -> StoredObject | None:
        try:
            st = self._path(name).stat()
        except (FileNotFoundError, NotADirectoryError, ValueError, ObjectMissing):  # ValueError: a NUL in it
            return None  # (any other OSError, a stale NFS handle, raises: it is no answer to "is it there?")
        return StoredObject(name, st.st_size, st.st_mtime) if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str) -> Iterator[StoredObject]:
        folder_name, _, start = prefix.rpartition("/")
        folder = self.root / folder_name
        if not folder.is_dir():
            return
        for path in folder.iterdir():
            if path.name.startswith(".") or not path.name.startswith(start):  # "." : a write in progress
                continue
            try:
                st = path.stat()
            except OSError:  # removed meanwhile
                continue
            name = f"{folder_name}/{path.name}" if folder_name else path.name
            yield StoredObject(name, st.st_size, st.st_mtime, f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}")

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except ObjectMissing:
            pass

    def local_path(self, name: str) -> Path | None:
        return self._path(name)

    def remove_leftovers(self, before: float) -> int:
        """The staging folder's files, and beside the objects (in the root and its folders) the hidden
        temporary files of their writes. A folder this head may not read (a volume's lost+found) is passed."""
        removed = _remove_files_before(self.staging, before, lambda name: True)
        removed += _remove_files_before(self.root, before, _temporary)
        for folder in _folders(self.root):
            removed += _remove_files_before(folder, before, _temporary)
        return removed

    def stream(self, name: str) -> Iterator[bytes]:
        try:
            f = self._path(name).open("rb")
        except FileNotFoundError:
            raise ObjectMissing(name) from None
        with f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk

    def presigned_url(self, name: str, expires_s: int, content_type: str, filename: str | None) -> str | None:
        return None


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, spec: str) -> S3Location:
        """s3://BUCKET or s3://BUCKET/PREFIX; ValueError saying what is wrong."""
        parts = urlsplit(spec)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"{spec!r} is not s3://BUCKET/PREFIX")
        prefix = parts.path.strip("/")
        return cls(parts.netloc, f"{prefix}/" if prefix else "")


S3_CREDENTIALS = (S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV)  # required; S3_SESSION_TOKEN_ENV is optional


def s3_credentials(where: str, env: Mapping[str, str]) -> dict[str, EnvSecret]:
    """The bucket's credentials by variable name (the session token only when given), each from its
    variable or from the file its `_FILE` variable names. StoreError naming `where` and the variables."""
    try:
        found = {name: read_env_secret(env, name) for name in S3_CREDENTIAL_ENV}
    except EnvSecretError as exc:
        raise StoreError(f"{where}: {exc}") from None
    missing = [name for name in S3_CREDENTIALS if found[name] is None]
    if missing:
        raise StoreError(
            f"{where}: {' and '.join(missing)} not set; give the bucket's credentials in the environment, or "
            f"each in a file that {' and '.join(file_variable(name) for name in missing)} names (never as a flag)"
        )
    return {name: secret for name, secret in found.items() if secret is not None}


class S3Objects:
    """Objects in an S3-compatible bucket, through the MinIO client (any S3 API: AWS, MinIO, SeaweedFS, Ceph)."""

    def __init__(self, location: S3Location, endpoint: str, environ: Mapping[str, str] | None = None) -> None:
        import urllib3
        from minio import Minio

        env = os.environ if environ is None else environ
        creds = s3_credentials(f"--results-store s3://{location.bucket}/{location.prefix}", env)
        session = creds.get(S3_SESSION_TOKEN_ENV)
        self._credential_sources = {name: secret.source for name, secret in creds.items()}
        url = urlsplit(endpoint)
        self.location = location
        self.endpoint = endpoint
        self.description = f"s3://{location.bucket}/{location.prefix} at {endpoint}"
        self.staging = Path(tempfile.gettempdir()) / "triptych-results"
        # Short connect timeout and few retries: a store that does not answer fails the request (and the
        # start-up check) within seconds, not after urllib3's defaults of minutes.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=5, read=60),
            retries=urllib3.Retry(total=2, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)),
            maxsize=16,
        )

        def client(http: urllib3.PoolManager) -> Minio:
            return Minio(
                url.netloc,
                access_key=creds[S3_ACCESS_KEY_ENV].value,
                secret_key=creds[S3_SECRET_KEY_ENV].value,
                session_token=session.value if session else None,
                secure=url.scheme == "https",
                region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
                http_client=http,
            )

        self.client = client(http)
        once = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5, read=CLAIM_PUT_S - 5), retries=False, maxsize=4)
        self._once = client(once)  # create's winning PUT: done or failed within CLAIM_PUT_S

    def _key(self, name: str) -> str:
        return self.location.prefix + name

    def check(self) -> None:
        from minio.error import S3Error

        where = f"--results-store s3://{self.location.bucket}/{self.location.prefix}"
        retries = logging.getLogger("urllib3.connectionpool")  # its retry warnings would bury the one line
        level = retries.level
        retries.setLevel(logging.ERROR)
        try:
            if not self.client.bucket_exists(self.location.bucket):
                raise StoreError(f"{where}: bucket {self.location.bucket!r} does not exist at {self.endpoint}; "
                                 "create it, or name another")  # fmt: skip
            probe = f".probe-{uuid.uuid4().hex}"
            self.put_bytes(probe, b"", "application/octet-stream")
            self.delete(probe)
        except S3Error as exc:
            hint = {
                "InvalidAccessKeyId": f"check {self._credential_sources[S3_ACCESS_KEY_ENV]}",
                "SignatureDoesNotMatch": f"check {self._credential_sources[S3_SECRET_KEY_ENV]}",
                "AccessDenied": "give these credentials read, write and delete on the prefix",
                "NoSuchBucket": "create the bucket, or name another",
            }.get(exc.code or "", "check the bucket, the prefix and the credentials")
            raise StoreError(f"{where}: {exc.code}: {exc.message}; {hint}") from None
        except StoreError:
            raise
        except ValueError as exc:  # the client refuses a name before sending anything
            raise StoreError(f"{where}: {exc}") from None
        except Exception as exc:  # urllib3: refused, unresolvable, timed out
            reason = getattr(exc, "reason", None) or exc  # MaxRetryError wraps what went wrong
            raise StoreError(
                f"--results-s3-endpoint {self.endpoint}: cannot reach it ({_last_words(reason)}); "
                "give the S3 server's URL, e.g. http://seaweedfs:8333"
            ) from None
        finally:
            retries.setLevel(level)

    def put_bytes(self, name: str, data: bytes, content_type: str) -> None:
        self.client.put_object(self.location.bucket, self._key(name), io.BytesIO(data), len(data), content_type)

    def create(self, name: str, data: bytes, content_type: str) -> bool:
        """S3-compatible servers do not all take a conditional PUT, so: each contender writes a claim of
        its own beside the name, then lists the claims, and only one that sees its claim alone writes
        the object. Two that see each other both withdraw (their callers try again later). At most one
        wins because S3 lists are strongly consistent: of two contenders, the later to write its claim
        lists the earlier's, or, once the winner removed its claim, the object it wrote first. A claim
        CLAIM_STALE_S older than ours (by the server's clock) is a contender that died mid-way; a live
        one is never that slow: it withdraws when its own checks took a third of that, and its PUT of
        the object ends, done or failed, within CLAIM_PUT_S (a PUT retried after a timeout could land
        after a rival took the claim for a dead one's)."""
        if self.stat(name) is not None:
            return False
        started = monotonic()
        mine = f"{name}.claim-{uuid.uuid4().hex}"
        self.put_bytes(mine, b"", "application/octet-stream")
        claims = {obj.name: obj.mtime for obj in self.list(f"{name}.claim-")}
        written = claims.get(mine, 0.0)
        rivals = [n for n, mtime in claims.items() if n != mine and written - mtime < CLAIM_STALE_S]
        if mine not in claims or rivals or self.stat(name) is not None or monotonic() - started > CLAIM_STALE_S / 3:
            self.delete(mine)  # the time last: a slow answer to any of those checks is as late as a slow list
            return False
        self._once.put_object(self.location.bucket, self._key(name), io.BytesIO(data), len(data), content_type)
        try:  # a contender that lists no claim from now on sees the object when it checks
            self.delete(mine)
        except Exception as exc:  # the object is written: won; the claim is ignored once stale
            log.warning("cannot remove the claim %s (%s); it stays beside the object", mine, exc)
        return True

    def put_file(self, name: str, path: Path, content_type: str) -> None:
        self.client.fput_object(self.location.bucket, self._key(name), str(path), content_type)
        path.unlink(missing_ok=True)

    def _get(self, name: str):  # type: ignore[no-untyped-def]
        from minio.error import S3Error

        try:
            return self.client.get_object(self.location.bucket, self._key(name))
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                raise ObjectMissing(name) from None
            raise

    def get_bytes(self, name: str) -> bytes:
        response = self._get(name)
        try:
            return bytes(response.read())
        finally:
            response.close()
            response.release_conn()

    def stat(self, name: str) -> StoredObject | None:
        from minio.error import S3Error

        try:
            st = self.client.stat_object(self.location.bucket, self._key(name))
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound", "ResourceNotFound"):
                return None
            raise
        return StoredObject(name, st.size or 0, st.last_modified.timestamp() if st.last_modified else 0.0)

    def list(self, prefix: str) -> Iterator[StoredObject]:
        start = len(self.location.prefix)
        for obj in self.client.list_objects(self.location.bucket, prefix=self._key(prefix), recursive=True):
            name = (obj.object_name or "")[start:]
            if not name or name.rsplit("/", 1)[-1].startswith("."):
                continue
            mtime = obj.last_modified.timestamp() if obj.last_modified else 0.0
            yield StoredObject(name, obj.size or 0, mtime, obj.etag or "")

    def delete(self, name: str) -> None:
        self.client.remove_object(self.location.bucket, self._key(name))  # S3: removing a missing key succeeds

    def local_path(self, name: str) -> Path | None:
        return None

    def remove_leftovers(self, before: float) -> int:
        """The local staging folder's files (an upload cut short leaves nothing in the bucket)."""
        return _remove_files_before(self.staging, before, lambda name: True)

    def stream(self, name: str) -> Iterator[bytes]:
        response = self._get(name)
        try:
            yield from response.stream(CHUNK_BYTES)
        finally:
            response.close()
            response.release_conn()

    def presigned_url(self, name: str, expires_s: int, content_type: str, filename: str | None) -> str | None:
        headers: dict[str, str | list[str] | tuple[str]] = {"response-content-type": content_type}
        if filename:
            headers["response-content-disposition"] = f"attachment; filename={filename}"
        return self.client.presigned_get_object(
            self.location.bucket, self._key(name), expires=timedelta(seconds=expires_s), response_headers=headers
        )


def _temporary(name: str) -> bool:
    """A write's temporary file beside its result (DirectoryObjects._written_beside, put_file)."""
    return name.startswith(".") and name.endswith(".tmp")


def _folders(root: Path) -> list[Path]:
    """The folders in `root` but its hidden ones (staging)."""
    try:
        return [
            Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
        ]
    except OSError as exc:
        log.warning("cannot look for leftover files in %s: %s", root, exc)
        return []


def _remove_files_before(folder: Path, before: float, chosen: Callable[[str], bool]) -> int:
    """Remove the files of `folder` (not its subfolders) that `chosen` names, last written before `before`."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, PermissionError):  # none, or not this head's (a volume's lost+found)
        return 0
    except OSError as exc:  # never in the way of retention itself: said, and left
        log.warning("cannot look for leftover files in %s: %s", folder, exc)
        return 0
    for entry in entries:
        try:
            if chosen(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                if st.st_mtime < before:
                    os.unlink(entry.path)
                    removed += st.st_size
        except FileNotFoundError:  # removed meanwhile (another head's sweep, or its write ended)
            continue
        except OSError as exc:  # another user's (a staging folder shared on the host), a stale NFS handle
            log.warning("cannot remove leftover file %s: %s", entry.path, exc)
    return removed


def _last_words(exc: BaseException) -> str:
    """The end of an urllib3 error's message: "[Errno 111] Connection refused", not the pool's repr."""
    text = str(exc)
    return text.rsplit(": ", 1)[-1].rstrip("')\"") if ": " in text else text


def open_object_store(output_path: str, results_store: str | None, s3_endpoint: str | None) -> ObjectStore:
    """The store the flags name (ServeArgs checked their form); StoreError when it cannot be used."""
    if results_store is None:
        store: ObjectStore = DirectoryObjects(Path(output_path))
    else:
        store = S3Objects(S3Location.parse(results_store), s3_endpoint or "https://s3.amazonaws.com")
    store.check()
    return store

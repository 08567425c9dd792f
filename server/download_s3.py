"""Model folders from S3 and S3-compatible stores (MinIO, Ceph RGW, R2, ...) for the cache loader
(`python -m server.download --model s3://bucket/prefix`).

Credentials and endpoint come from the AWS SDK's own environment variables, as KServe and KubeAI
use them: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optional `AWS_ENDPOINT_URL` (an S3-compatible
store; path-style addressing then) and `AWS_REGION`; with no key at all, boto3's default chain
(a workload identity, an instance profile). Only the loader Job gets them: the server never does.

Every object under the prefix becomes the file at its key's remainder below the target folder.
Downloads are resumable and verified:
- bytes go to `<file>.part`, flushed as they arrive; a rerun (a retried Job pod, a restarted loader)
  asks for the rest only (`Range: bytes=<have>-`) and only if the object is still the one it started
  on (`If-Match: <ETag>`; otherwise the part is dropped and the object fetched again);
- a finished part must have the listed size and, where the ETag is an MD5 (a single-part upload:
  the MD5 of the content; a multipart one: the MD5 of the parts' MD5s, `-<parts>` appended), that
  checksum; only then is it renamed into place and recorded with its ETag in `.kubeinfer-s3.json`;
- a rerun skips files recorded with the ETag the listing shows, and fetches again one whose object
  changed. ETags that are not MD5s (SSE-KMS objects, some stores) are checked by size only, said in
  the log.

Failures raise `S3DownloadError` with a one-word reason (`CredentialsRejected`, `AccessDenied`,
`BucketNotFound`, `NoObjects`, `ChecksumMismatch`, ...) that the loader prints and the operator shows
as the cache's condition reason. No message carries a credential: S3's error messages name none, and
nothing here prints the environment.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger("server.download")

# A bucket name as S3 allows it (3-63 characters, lower case, digits, '.', '-'), then a prefix of
# non-empty segments none of which is only dots ('.', '..'); the operator's CRD holds the same pattern.
S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^/]*[^/.][^/]*)*/?$")
MANIFEST = ".kubeinfer-s3.json"
PART_SUFFIX = ".part"
CHUNK_BYTES = 1 << 20
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}(-[0-9]+)?$")

# S3 error codes -> the reason the loader prints (the operator's condition reason).
_REASONS = {
    "InvalidAccessKeyId": "CredentialsRejected",
    "SignatureDoesNotMatch": "CredentialsRejected",
    "InvalidToken": "CredentialsRejected",
    "ExpiredToken": "CredentialsRejected",
    "AccessDenied": "AccessDenied",
    "403": "AccessDenied",
    "AllAccessDisabled": "AccessDenied",
    "NoSuchBucket": "BucketNotFound",
    "NoSuchKey": "ObjectNotFound",
    "404": "ObjectNotFound",
}


class S3DownloadError(RuntimeError):
    """A download that cannot complete; `reason` is one CamelCase word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or a key prefix without leading or trailing "/"

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


@dataclass(frozen=True)
class RemoteObject:
    key: str
    relative: str  # the key below the prefix: the file's path in the target folder
    size: int  # bytes
    etag: str  # without quotes


def parse_s3_uri(uri: str) -> S3Location:
    """`s3://bucket[/prefix]` -> S3Location; ValueError for anything else or a prefix with `..`."""
    if not S3_URI.match(uri):
        raise ValueError(
            f"{uri!r}: expected s3://bucket/prefix (a bucket name: lower case, digits, '.', '-')"
        )
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"{uri!r}: the prefix must not hold empty, '.' or '..' segments")
    return S3Location(bucket, prefix)


def make_client() -> Any:
    """A boto3 S3 client from the AWS environment variables (the module docstring lists them)."""
    import boto3
    from botocore.config import Config

    if bool(os.environ.get("AWS_ACCESS_KEY_ID")) != bool(os.environ.get("AWS_SECRET_ACCESS_KEY")):
        missing = "AWS_SECRET_ACCESS_KEY" if os.environ.get("AWS_ACCESS_KEY_ID") else "AWS_ACCESS_KEY_ID"
        raise S3DownloadError("CredentialsIncomplete", f"{missing} is not set (both keys are needed)")
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or None
    config = Config(
        # S3-compatible stores serve buckets under the path; AWS itself prefers virtual hosts.
        s3={"addressing_style": "path" if endpoint else "auto"},
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
    )
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    # A fresh session: boto3's default one keeps the credentials it resolved first.
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint, region_name=region, config=config)


def _reason(exc: Exception) -> S3DownloadError:
    """A boto error as an S3DownloadError (its code and S3's message; never the request)."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(exc, S3DownloadError):
        return exc
    if isinstance(exc, ClientError):
        err = exc.response.get("Error") or {}
        code = str(err.get("Code") or "")
        message = str(err.get("Message") or code)
        return S3DownloadError(_REASONS.get(code, code or "S3Error"), f"{code}: {message}")
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return S3DownloadError("NoCredentials", str(exc))
    if isinstance(exc, EndpointConnectionError):
        return S3DownloadError("EndpointUnreachable", str(exc))
    return S3DownloadError("S3Error", f"{type(exc).__name__}: {exc}")


def _safe_relative(key: str, prefix: str) -> str | None:
    """The key's path below the prefix, or None for a folder marker; refuses escaping paths."""
    rest = key[len(prefix) :].lstrip("/") if prefix else key
    if not rest or rest.endswith("/"):
        return None
    parts = PurePosixPath(rest).parts
    if rest.startswith("/") or any(p in ("..", ".") for p in parts) or rest.endswith(PART_SUFFIX):
        raise S3DownloadError("UnsafeKey", f"object key {key!r} would be written outside the model folder")
    if parts[-1] == MANIFEST:
        raise S3DownloadError("UnsafeKey", f"object key {key!r} collides with the loader's {MANIFEST}")
    return rest


def list_objects(client: Any, loc: S3Location) -> list[RemoteObject]:
    """Every object under the prefix (a folder: `prefix/`), paginated, in key order."""
    prefix = f"{loc.prefix}/" if loc.prefix else ""
    found: list[RemoteObject] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
            for item in page.get("Contents") or []:
                rel = _safe_relative(item["Key"], loc.prefix)
                if rel is not None:
                    etag = str(item.get("ETag") or "").strip('"')
                    found.append(RemoteObject(item["Key"], rel, int(item["Size"]), etag))
    except Exception as exc:  # boto raises several families; each becomes a reason
        raise _reason(exc) from exc
    if not found:
        raise S3DownloadError("NoObjects", f"no objects under {loc.uri}/")
    return sorted(found, key=lambda o: o.key)


def _md5_of(path: Path, part_size: int | None) -> str:
    """The file's S3 ETag form: hex MD5, or for parts of `part_size` bytes MD5(MD5s)-count."""
    if part_size is None:
        digest = hashlib.md5(usedforsecurity=False)
        with path.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest()
    parts: list[bytes] = []
    with path.open("rb") as f:
        while True:
            block = f.read(part_size)
            if not block:
                break
            parts.append(hashlib.md5(block, usedforsecurity=False).digest())
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"


def verify(client: Any, loc: S3Location, obj: RemoteObject, path: Path) -> str:
    """Check a downloaded file against the listing: size always, the ETag where it is an MD5.
    Returns how it was checked ("md5", "multipart-md5" or "size"); raises ChecksumMismatch."""
    size = path.stat().st_size
    if size != obj.size:
        raise S3DownloadError("ChecksumMismatch", f"{obj.key}: {size} bytes on disk, {obj.size} listed")
    if not _MD5_ETAG.match(obj.etag):
        return "size"
    part_size = None
    if "-" in obj.etag:
        try:
            head = client.head_object(Bucket=loc.bucket, Key=obj.key, PartNumber=1, IfMatch=obj.etag)
        except Exception as exc:
            raise _reason(exc) from exc
        part_size = int(head["ContentLength"])
    got = _md5_of(path, part_size)
    if got != obj.etag:
        raise S3DownloadError("ChecksumMismatch", f"{obj.key}: MD5 {got}, ETag {obj.etag}")
    return "multipart-md5" if part_size else "md5"


def _read_manifest(folder: Path) -> dict[str, str]:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _write_manifest(folder: Path, manifest: dict[str, str]) -> None:
    tmp = folder / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, sort_keys=True, indent=1))
    os.replace(tmp, folder / MANIFEST)


@dataclass(frozen=True)
class FetchResult:
    fetched_bytes: int  # bytes received from the store by this call
    resumed_from: int  # bytes of a previous attempt's part kept (0: none)
    skipped: bool  # already complete with this ETag


def fetch_object(
    client: Any,
    loc: S3Location,
    obj: RemoteObject,
    folder: Path,
    manifest: dict[str, str],
    progress: Callable[[int], None] | None = None,
) -> FetchResult:
    """Download one object into `folder/obj.relative`, resuming its part file; `manifest` (relative
    path -> ETag of completed files) is updated and written when the file is in place."""
    final = folder / obj.relative
    part = final.with_name(final.name + PART_SUFFIX)
    if manifest.get(obj.relative) == obj.etag and final.is_file() and final.stat().st_size == obj.size:
        return FetchResult(0, 0, True)
    final.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    if have > obj.size:
        part.unlink()
        have = 0
    resumed_from = have
    fetched = 0
    if have < obj.size:
        from botocore.exceptions import ClientError

        request: dict[str, Any] = {"Bucket": loc.bucket, "Key": obj.key}
        if obj.etag:
            request["IfMatch"] = f'"{obj.etag}"'
        try:
            try:
                body = client.get_object(**request, Range=f"bytes={have}-")["Body"] if have else None
            except ClientError as exc:
                if (exc.response.get("Error") or {}).get("Code") not in ("PreconditionFailed", "412"):
                    raise
                # The object changed since the part was started: its bytes are not this object's.
                log.info("%s: changed since the last attempt, fetching it again", obj.key)
                body = None
            if body is None:
                have = resumed_from = 0
                body = client.get_object(**request)["Body"]
            with part.open("ab" if have else "wb") as out:
                for chunk in body.iter_chunks(CHUNK_BYTES):
                    out.write(chunk)
                    out.flush()  # a killed loader keeps what it received
                    fetched += len(chunk)
                    if progress is not None:
                        progress(len(chunk))
        except Exception as exc:
            raise _reason(exc) from exc
    try:
        how = verify(client, loc, obj, part)
    except S3DownloadError as exc:
        if exc.reason == "ChecksumMismatch":
            part.unlink(missing_ok=True)  # the next attempt starts this file afresh
        raise
    os.replace(part, final)
    manifest[obj.relative] = obj.etag
    _write_manifest(folder, manifest)
    log.info(
        "%s: %d bytes%s, verified (%s)",
        obj.relative,
        obj.size,
        f", resumed at byte {resumed_from}" if resumed_from else "",
        how,
    )
    return FetchResult(fetched, resumed_from, False)


def s3_folder(cache_dir: Path, loc: S3Location) -> Path:
    """Where a prefix is downloaded in the cache: `<cache>/s3/<bucket>/<prefix>`."""
    folder = cache_dir / "s3" / loc.bucket
    return folder / loc.prefix if loc.prefix else folder / "_root"


def download_prefix(uri: str, cache_dir: Path, client: Any | None = None) -> tuple[Path, int]:
    """Download every object under `uri` into the cache; returns (folder, bytes fetched by this call).
    Files the listing no longer holds are removed from the folder (the prefix is the model)."""
    loc = parse_s3_uri(uri)
    client = client if client is not None else make_client()
    objects = list_objects(client, loc)
    folder = s3_folder(cache_dir, loc)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(folder)
    total = 0
    for obj in objects:
        total += fetch_object(client, loc, obj, folder, manifest).fetched_bytes
    wanted = {o.relative for o in objects}
    stale = [rel for rel in manifest if rel not in wanted]
    for rel in stale:
        (folder / rel).unlink(missing_ok=True)
        del manifest[rel]
    if stale:
        _write_manifest(folder, manifest)
    return folder, total

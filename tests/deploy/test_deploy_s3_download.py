"""Models from S3 (server/download_s3.py, `python -m server.download --model s3://...`), against moto's
ThreadedMotoServer on 127.0.0.1 as a stand-in for S3 (a real HTTP S3 API: SigV4 checked against IAM
keys, Range and If-Match honoured): a bucket holding a tiny model folder is downloaded, verified and
served; bad credentials, a missing key and an empty prefix fail with a reason and no secret in the
output; a download killed mid-file is resumed with only the rest fetched, and checked."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.moto_server.threaded_moto_server")

from serving import free_port, wait_ready  # noqa: E402

from server.download_s3 import (  # noqa: E402
    MANIFEST,
    S3DownloadError,
    download_prefix,
    fetch_object,
    list_objects,
    make_client,
    parse_s3_uri,
    s3_folder,
)

REPO = Path(__file__).resolve().parents[2]
BUCKET = "models"
PREFIX = "tiny/v1"


@dataclass
class S3:
    endpoint: str
    access_key: str
    secret_key: str
    files: dict[str, bytes]  # relative path -> content, as uploaded under PREFIX


class Proxy:
    """A TCP relay in front of the store that counts the bytes sent back to the client and can stop
    relaying after `stall_after` of them (a network that hangs mid-file)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.down_bytes = 0
        self.stall_after: int | None = None
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(65536):
                if down:
                    if self.stall_after is not None and self.down_bytes >= self.stall_after:
                        self._closed.wait()  # hold the connection open, relay nothing more
                        return
                    self.down_bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed.set()
        self.sock.close()


def _reset_auth(endpoint: str, count: str) -> None:
    # a plain body: as a form, moto would read no count
    req = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=count.encode(),
        method="POST",
        headers={"Host": "localhost", "Content-Type": "text/plain"},
    )
    urllib.request.urlopen(req, timeout=10).read()


@pytest.fixture(scope="module")
def s3(tiny_model_factory: Any) -> Iterator[S3]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    admin = {"endpoint_url": endpoint, "region_name": "us-east-1"}
    keys = {"aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
    iam = boto3.client("iam", **admin, **keys)
    iam.create_user(UserName="loader")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="loader", PolicyName="read", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="loader")["AccessKey"]
    s3c = boto3.client("s3", **admin, **keys)
    s3c.create_bucket(Bucket=BUCKET)
    folder = tiny_model_factory(seed=0)
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    for name, data in files.items():
        s3c.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}", Body=data)
    s3c.put_object(Bucket=BUCKET, Key=f"{PREFIX}/", Body=b"")  # a console's folder marker
    s3c.put_object(Bucket=BUCKET, Key="tiny/v10/config.json", Body=b"{}")  # a sibling prefix
    _reset_auth(endpoint, "0")  # from here every request is signed with an IAM user's key
    try:
        yield S3(endpoint, key["AccessKeyId"], key["SecretAccessKey"], files)
    finally:
        _reset_auth(endpoint, "inf")
        server.stop()


@pytest.fixture
def aws_env(s3: S3, monkeypatch: pytest.MonkeyPatch) -> S3:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    return s3


def _env(s3: S3, **override: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=s3.access_key,
        AWS_SECRET_ACCESS_KEY=s3.secret_key,
        AWS_ENDPOINT_URL=s3.endpoint,
        AWS_REGION="us-east-1",
        AWS_CONFIG_FILE="/nonexistent",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    env.update(override)
    return env


def _loader(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "server.download", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_parse_s3_uri() -> None:
    assert parse_s3_uri("s3://models/tiny/v1/").prefix == "tiny/v1"
    assert parse_s3_uri("s3://my.bucket").prefix == ""
    for bad in ("s3://A/x", "s3://b", "s3://bucket/a/../b", "gs://bucket/x", "s3://bucket//x", "s3://bkt/."):
        with pytest.raises(ValueError):
            parse_s3_uri(bad)


def test_download_lists_only_the_prefix_folder_and_verifies_each_file(aws_env: S3, tmp_path: Path) -> None:
    folder, fetched = download_prefix(f"s3://{BUCKET}/{PREFIX}", tmp_path)
    assert folder == s3_folder(tmp_path, parse_s3_uri(f"s3://{BUCKET}/{PREFIX}"))
    got = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST}
    assert got == aws_env.files  # nothing from tiny/v10, no folder marker, no .part left
    assert fetched == sum(len(b) for b in aws_env.files.values())
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest == {
        n: hashlib.md5(b, usedforsecurity=False).hexdigest() for n, b in aws_env.files.items()
    }
    # A second run fetches nothing: every file is recorded with the ETag the listing shows.
    assert download_prefix(f"s3://{BUCKET}/{PREFIX}", tmp_path)[1] == 0


def test_corrupt_part_is_refused_and_dropped(aws_env: S3, tmp_path: Path) -> None:
    client = make_client()
    loc = parse_s3_uri(f"s3://{BUCKET}/{PREFIX}")
    (obj,) = [o for o in list_objects(client, loc) if o.relative == "config.json"]
    folder = s3_folder(tmp_path, loc)
    folder.mkdir(parents=True)
    part = folder / "config.json.part"
    part.write_bytes(b"X" * 10)  # a previous attempt's bytes that are not this object's
    with pytest.raises(S3DownloadError) as err:
        fetch_object(client, loc, obj, folder, {})
    assert err.value.reason == "ChecksumMismatch"
    assert not part.exists() and not (folder / "config.json").exists()
    assert not fetch_object(client, loc, obj, folder, {}).resumed_from  # the retry starts afresh
    assert (folder / "config.json").read_bytes() == aws_env.files["config.json"]


@pytest.mark.parametrize(
    ("change", "reason", "code"),
    [
        ({"AWS_SECRET_ACCESS_KEY": "wrong-secret-value-123"}, "CredentialsRejected", "SignatureDoesNotMatch"),
        ({"AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000"}, "CredentialsRejected", "InvalidAccessKeyId"),
        ({"AWS_SECRET_ACCESS_KEY": ""}, "CredentialsIncomplete", "AWS_SECRET_ACCESS_KEY is not set"),
    ],
)
def test_bad_credentials_give_a_reason_and_no_secret(
    aws_env: S3,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: dict[str, str],
    reason: str,
    code: str,
) -> None:
    for k, v in change.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(S3DownloadError) as err:
        download_prefix(f"s3://{BUCKET}/{PREFIX}", tmp_path)
    assert err.value.reason == reason and code in str(err.value)
    for secret in (aws_env.secret_key, "wrong-secret-value-123"):
        assert secret not in str(err.value)


def test_missing_bucket_and_empty_prefix(aws_env: S3, tmp_path: Path) -> None:
    with pytest.raises(S3DownloadError) as err:
        download_prefix("s3://no-such-bucket/x", tmp_path)
    assert err.value.reason == "BucketNotFound"
    with pytest.raises(S3DownloadError) as err:
        download_prefix(f"s3://{BUCKET}/tiny/v2", tmp_path)
    assert err.value.reason == "NoObjects" and "s3://models/tiny/v2/" in str(err.value)


def test_loader_termination_message_names_the_reason_without_the_secret(s3: S3, tmp_path: Path) -> None:
    """What the Job's termination message (FallbackToLogsOnError) shows: the last line."""
    bad = "bad-secret-must-not-leak-42"
    proc = _loader(
        ["--model", f"s3://{BUCKET}/{PREFIX}", "--cache-dir", str(tmp_path), "--output", str(tmp_path / "m")],
        _env(s3, AWS_SECRET_ACCESS_KEY=bad),
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("download failed: CredentialsRejected: SignatureDoesNotMatch"), last
    assert bad not in out + err and s3.secret_key not in out + err and s3.access_key not in out + err
    assert not (tmp_path / "m").exists()


def test_killed_download_resumes_with_only_the_rest_fetched(
    s3: S3, aws_env: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = "model.safetensors"
    size = len(s3.files[weights])
    assert size > 8 << 20  # big enough to cut in the middle
    proxy = Proxy(("127.0.0.1", int(s3.endpoint.rsplit(":", 1)[1])))
    try:
        before = sum(len(b) for n, b in s3.files.items() if n < weights)  # files listed before it
        proxy.stall_after = before + 4 * (1 << 20)
        uri = f"s3://{BUCKET}/{PREFIX}"
        proc = _loader(
            ["--model", uri, "--cache-dir", str(tmp_path)], _env(s3, AWS_ENDPOINT_URL=proxy.endpoint)
        )
        part = s3_folder(tmp_path, parse_s3_uri(uri)) / f"{weights}.part"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (part.exists() and part.stat().st_size >= 2 << 20):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)  # let the relayed bytes reach the file
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        have = part.stat().st_size
        assert 0 < have < size

        # The rerun (a new loader pod) through a relay that no longer stalls.
        proxy.stall_after = None
        proxy.down_bytes = 0
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        client = make_client()
        loc = parse_s3_uri(uri)
        folder = s3_folder(tmp_path, loc)
        manifest = json.loads((folder / MANIFEST).read_text())
        assert set(manifest) == {n for n in s3.files if n < weights}  # those finished before the kill
        results = {
            o.relative: fetch_object(client, loc, o, folder, manifest) for o in list_objects(client, loc)
        }
    finally:
        proxy.close()
    got = results[weights]
    assert got.resumed_from == have and got.fetched_bytes == size - have  # only the rest
    assert all(results[n].skipped for n in manifest if n < weights)
    rest = sum(len(b) for n, b in s3.files.items() if n > weights)
    assert proxy.down_bytes < (size - have) + rest + 64 * 1024  # the wire carried no second copy
    assert (folder / weights).read_bytes() == s3.files[weights] and not part.exists()


@pytest.mark.slow  # two subprocesses that import torch: the loader, then the server
def test_downloaded_folder_is_served(s3: S3, tmp_path: Path) -> None:
    import httpx

    out = tmp_path / "claim" / "models" / "s3-tiny"
    proc = _loader(
        ["--model", f"s3://{BUCKET}/{PREFIX}", "--cache-dir", str(tmp_path / "claim"), "--output", str(out)],
        _env(s3),
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout + stderr
    assert "verified (md5)" in stdout and "ready at" in stdout
    assert out.is_symlink() and not os.readlink(out).startswith("/")
    # The replicas mount the claim elsewhere and never see the store's credentials.
    mounted = tmp_path / "mounted"
    (tmp_path / "claim").rename(mounted)
    port = free_port()
    env = {k: v for k, v in _env(s3).items() if not k.startswith("AWS_")}
    env.update(HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(mounted / "models" / "s3-tiny"),
        "--host",
        "127.0.0.1",
    ]
    cmd += ["--port", str(port), "--dtype", "float32", "--num-kv-blocks", "32", "--num-threads", "1"]
    server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, server, timeout_s=300)  # importing torch takes long on a loaded machine
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "s3-tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        server.kill()
        server.wait(timeout=30)

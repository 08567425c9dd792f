"""The cache loader's entry point (`python -m server.download`, what the operator's loader Job runs)
against a hub on 127.0.0.1: huggingface_hub's own client downloads over real HTTP (HF_ENDPOINT), a
pinned revision is the one linked, the token is sent, and the folder it leaves is what the server
loads with the hub gone (HF_HUB_OFFLINE=1): the same weights, the same adapter."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # two subprocesses that import torch, and tiny models built with transformers

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_cache_loader_test"


class FakeHub:
    """The routes snapshot_download uses: a revision's commit, its file tree, and each file's bytes (with
    the commit and ETag headers the client stores in its cache layout)."""

    def __init__(self) -> None:
        # repo -> revision -> (commit sha, {filename: bytes})
        self.repos: dict[str, dict[str, tuple[str, dict[str, bytes]]]] = {}
        self.auth: list[str] = []
        self.paths: list[str] = []

    def add(self, repo: str, revision: str, folder: Path) -> str:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        sha = hashlib.sha1(json.dumps(sorted(files)).encode() + b"".join(files.values())).hexdigest()
        self.repos.setdefault(repo, {})[revision] = (sha, files)
        self.repos[repo][sha] = (sha, files)
        return sha

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool) -> None:
                hub.paths.append(self.path)
                hub.auth.append(self.headers.get("Authorization") or "")
                path = self.path.split("?", 1)[0]
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and "tree" in parts:
                    i = parts.index("tree")
                    found = hub.repos.get("/".join(parts[2:i]), {}).get(parts[i + 1])
                    if found is None:
                        self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, head)
                        return
                    entries = [
                        {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                        for f, b in found[1].items()
                    ]
                    self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
                    return
                if parts[:2] == ["api", "models"] and "revision" in parts:
                    i = parts.index("revision")
                    repo, rev = "/".join(parts[2:i]), "/".join(parts[i + 1 :])
                    found = hub.repos.get(repo, {}).get(rev)
                    if found is None:
                        self._send(
                            404,
                            b'{"error": "Revision Not Found"}',
                            {"X-Error-Code": "RevisionNotFound"},
                            head,
                        )
                        return
                    sha, files = found
                    body = json.dumps(
                        {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
                    ).encode()
                    self._send(200, body, {"Content-Type": "application/json"}, head)
                    return
                if "resolve" in parts:
                    i = parts.index("resolve")
                    repo, rev, name = "/".join(parts[:i]), parts[i + 1], "/".join(parts[i + 2 :])
                    found = hub.repos.get(repo, {}).get(rev)
                    if found is None or name not in found[1]:
                        self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                        return
                    sha, files = found
                    data = files[name]
                    etag = hashlib.sha256(data).hexdigest()
                    headers = {
                        "X-Repo-Commit": sha,
                        "ETag": f'"{etag}"',
                        "Content-Type": "application/octet-stream",
                    }
                    self._send(200, data, headers, head)
                    return
                self._send(404, b"", {}, head)

            def do_GET(self) -> None:
                self._route(head=False)

            def do_HEAD(self) -> None:
                self._route(head=True)

        return Handler


@pytest.fixture
def hub() -> Iterator[tuple[FakeHub, str]]:
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _download(endpoint: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run(
        [sys.executable, "-m", "server.download", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_loader_downloads_a_pinned_revision_the_server_then_loads_offline(
    hub: tuple[FakeHub, str], tiny_model_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from lora_adapters import make_adapter
    from safetensors.torch import load_file

    from server.lora.adapter import resolve_adapter_path
    from server.models.loader import load_state_dict, resolve_model

    fake, endpoint = hub
    v1 = tiny_model_factory(seed=0)
    v2 = tiny_model_factory(seed=1)
    fake.add("org/tiny", "main", v1)
    sha_v2 = fake.add("org/tiny", "v2", v2)
    adapter = make_adapter(v2, tmp_path / "lora", rank=4, targets=("q_proj", "v_proj"), seed=3)
    fake.add("org/tiny-lora", "main", adapter)

    cache = tmp_path / "cache"  # the claim, as the loader Job mounts it
    out = cache / "models" / "org--tiny@v2"
    lora_out = cache / "adapters" / "org--tiny-lora"
    done = _download(
        endpoint,
        [
            "--model", "org/tiny", "--revision", "v2", "--cache-dir", str(cache), "--output", str(out),
            "--adapter", f"org/tiny-lora={lora_out}",
        ],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "model org/tiny@v2: downloading" in done.stdout and "ready at" in done.stdout
    assert f"Bearer {TOKEN}" in fake.auth  # the model's credentials reach the hub
    assert any("/revision/v2" in p for p in fake.paths)

    # The pinned revision, linked relative to the cache (valid wherever the claim is mounted).
    assert out.is_symlink() and not os.readlink(out).startswith("/")
    assert out.resolve().name == sha_v2 and (out.resolve().parent.name == "snapshots")

    # The replicas mount the claim elsewhere, read-only, with the hub gone.
    mounted = tmp_path / "mounted"
    (cache).rename(mounted)
    served = mounted / "models" / "org--tiny@v2"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model(str(served), cache_dir=tmp_path / "scratch")
    assert source.origin == "hf-folder"
    got = load_state_dict(source.folder)
    want = load_file(str(v2 / "model.safetensors"))
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert not torch.equal(
        got["model.embed_tokens.weight"],
        load_file(str(v1 / "model.safetensors"))["model.embed_tokens.weight"],
    )  # not main's weights
    lora = resolve_adapter_path(str(mounted / "adapters" / "org--tiny-lora"))
    assert (lora / "adapter_model.safetensors").read_bytes() == (
        adapter / "adapter_model.safetensors"
    ).read_bytes()


def test_loader_reports_an_unknown_revision_and_exits_nonzero(
    hub: tuple[FakeHub, str], tiny_model_factory: Any, tmp_path: Path
) -> None:
    fake, endpoint = hub
    fake.add("org/tiny", "main", tiny_model_factory(seed=0))
    cache = tmp_path / "cache"
    done = _download(
        endpoint,
        [
            "--model",
            "org/tiny",
            "--revision",
            "nope",
            "--cache-dir",
            str(cache),
            "--output",
            str(cache / "m"),
        ],
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]  # the Job's termination message (FallbackToLogsOnError)
    assert last.startswith("download failed:") and "org/tiny" in last
    assert not (cache / "m").exists()

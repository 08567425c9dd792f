"""Scale to zero end to end: the activator (real HTTP on a real port) in front of a stand-in model
server, against the kmock API server. A small "kubelet" thread plays the Deployment controller: it
marks replicas ready (status.readyReplicas) once the test lets the stand-in pods finish loading."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from kubeinfer_operator.activator.__main__ import build, parser
from kubeinfer_operator.k8s import KubeClient
from op_cluster import MockCluster, wait_for

NS = "default"


def deployment(name: str = "m", replicas: int = 0) -> dict[str, Any]:
    labels = {"app.kubernetes.io/instance": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "server", "image": "x"}]},
            },
        },
    }


class LoopThread:
    """An asyncio loop on its own thread (the stand-in server and the activator each get one)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True)  # as the activator's __main__ runs it
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, int(runner.addresses[0][1])


class StandIn:
    """The model's replicas behind their Service: answers like our server (429 beyond
    ready replicas x per_replica in flight), records the most requests it had in flight at once, and
    holds each answer until `release` while `hold` is set."""

    def __init__(self, per_replica: int) -> None:
        self.per_replica = per_replica
        self.ready_replicas = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.served = 0
        self.refused = 0
        self.hold = False
        self.lt = LoopThread()
        self._release = self.lt.run(self._event())
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self.runner, self.port = self.lt.run(serve(app))

    async def _event(self) -> asyncio.Event:
        return asyncio.Event()

    def release(self) -> None:
        self.lt.loop.call_soon_threadsafe(self._release.set)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.ready_replicas == 0:
            return web.json_response({"error": "no endpoints"}, status=503)
        if self.in_flight >= self.ready_replicas * self.per_replica:
            self.refused += 1
            return web.json_response({"error": "too many requests"}, status=429)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold:
                await self._release.wait()
            self.served += 1
            text = f"echo:{body['prompt']}"
            if not body.get("stream"):
                return web.json_response(_completion(text))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for piece in text.split(":"):
                await resp.write(f"data: {json.dumps(_completion(piece))}\n\n".encode())
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1

    def stop(self) -> None:
        self.lt.run(self.runner.cleanup())
        self.lt.stop()


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
    }


class Kubelet:
    """Plays the Deployment controller and the pods' readiness: readyReplicas follows spec.replicas
    down at once and up only while `loaded` is set (the pods finished downloading and loading)."""

    def __init__(self, cluster: MockCluster, standin: StandIn, name: str = "m") -> None:
        self.cluster, self.standin, self.name = cluster, standin, name
        self.loaded = threading.Event()
        self.desired_seen: list[int] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            dep = self.cluster.get("Deployment", self.name)
            if dep is not None:
                desired = int(dep["spec"].get("replicas") or 0)
                if not self.desired_seen or self.desired_seen[-1] != desired:
                    self.desired_seen.append(desired)
                status = dep.get("status") or {}
                ready = int(status.get("readyReplicas") or 0)
                target = desired if (desired < ready or self.loaded.is_set()) else ready
                # Pods are serving before the API server reports them ready (the endpoint follows).
                self.standin.ready_replicas = target
                want = {
                    "observedGeneration": dep["metadata"].get("generation", 1),
                    "replicas": desired,
                    "updatedReplicas": desired,
                    "readyReplicas": target,
                }
                if any(status.get(k, 0) != v for k, v in want.items()):
                    self.cluster.patch("Deployment", self.name, {"status": want}, subresource="status")
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)


class Running:
    def __init__(self, argv: list[str]) -> None:
        self.activator = build(parser().parse_args(argv), KubeClient.from_environment(request_timeout=5.0))
        self.lt = LoopThread()
        self.runner, self.port = self.lt.run(serve(self.activator.app()))
        self.url = f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, labels: str = 'model_name="m"') -> float:
        text = httpx.get(self.url + "/activator/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.lt.run(self.runner.cleanup())
        self.lt.stop()


Setup = Callable[..., tuple[MockCluster, StandIn, Kubelet, Running]]


@pytest.fixture
def setup(cluster_factory: Callable[..., MockCluster]) -> Iterator[Setup]:
    stops: list[Callable[[], None]] = []

    def make(
        per_replica: int = 4,
        max_held: int = 100,
        max_wait: float = 60.0,
        delay: float = 0.5,
        replicas: int = 0,
        extra: tuple[str, ...] = (),
    ) -> tuple[MockCluster, StandIn, Kubelet, Running]:
        cluster = cluster_factory(monitoring=False, keda=False)
        cluster.create("Deployment", deployment(replicas=replicas))
        standin = StandIn(per_replica)
        stops.append(standin.stop)
        kubelet = Kubelet(cluster, standin)
        stops.append(kubelet.stop)
        running = Running(
            [
                f"--namespace={NS}",
                "--name=m",
                f"--upstream=http://127.0.0.1:{standin.port}",
                f"--max-held-requests={max_held}",
                f"--max-wait-seconds={max_wait}",
                f"--max-concurrent-requests={per_replica}",
                f"--scale-down-delay-seconds={delay}",
                "--poll-seconds=0.1",
                *extra,
            ]
        )
        stops.append(running.stop)
        return cluster, standin, kubelet, running

    yield make
    for stop in reversed(stops):
        stop()


def _replicas(cluster: MockCluster) -> int:
    dep = cluster.get("Deployment", "m")
    return int(dep["spec"].get("replicas") or 0) if dep else -1


def test_a_request_at_zero_wakes_the_model_is_answered_and_the_idle_model_goes_back_to_zero(
    setup: Setup,
) -> None:
    cluster, _standin, kubelet, act = setup(delay=0.5)
    pool = ThreadPoolExecutor(4)
    client = openai.OpenAI(base_url=act.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def stream() -> str:
        return "".join(
            c.choices[0].text for c in client.completions.create(model="m", prompt="b", stream=True)
        )

    plain: Future[Any] = pool.submit(client.completions.create, model="m", prompt="a")
    streamed = pool.submit(stream)
    # Held, and the model is being woken through its scale subresource while it loads.
    wait_for(lambda: _replicas(cluster) == 1, what="the wake-up scale to 1")
    wait_for(lambda: act.metric("kubeinfer_activator_held_requests") == 2, what="two held requests")
    assert not plain.done() and not streamed.done()
    # Two held + waking (KEDA's activation metric). Waking is published from the control loop's next read
    # of the Deployment after its own scale write (the step that scaled still holds the read from before),
    # so it is awaited; the kubelet stand-in keeps the replica unready until `loaded`, so it stays 3.
    wait_for(lambda: act.metric("kubeinfer_activator_pending") == 3, what="two held + waking pending")
    kubelet.loaded.set()
    assert plain.result(timeout=30).choices[0].text == "echo:a"
    assert streamed.result(timeout=30) == "echob"
    assert act.metric("kubeinfer_activator_wake_seconds_count") == 1
    # Idle for scaleDownDelaySeconds: back to zero; the next request wakes it again.
    wait_for(lambda: kubelet.desired_seen == [0, 1, 0], what="idle scale-down (and nothing else)")
    assert client.completions.create(model="m", prompt="c").choices[0].text == "echo:c"
    assert act.metric("kubeinfer_activator_scale_events_total", 'direction="up"') == 2
    pool.shutdown()


def test_a_burst_at_zero_is_bounded_and_reaches_the_first_replica_only_as_fast_as_it_admits(
    setup: Setup,
) -> None:
    _cluster, standin, kubelet, act = setup(per_replica=2, max_held=5)
    standin.hold = True
    pool = ThreadPoolExecutor(8)
    http = httpx.Client(timeout=60)

    def call(i: int) -> httpx.Response:
        return http.post(act.url + "/v1/completions", json={"model": "m", "prompt": str(i)})

    held = [pool.submit(call, i) for i in range(5)]
    wait_for(lambda: act.metric("kubeinfer_activator_held_requests") == 5, what="five held")
    over = [call(i) for i in range(5, 8)]
    for r in over:
        assert r.status_code == 503
        assert r.headers["Retry-After"] == "5"
        assert "model m is starting" in r.json()["message"]
    assert act.metric("kubeinfer_activator_refused_requests_total", 'reason="held_limit"') == 3
    kubelet.loaded.set()
    # One replica ready: two in flight on it (its limit), three still held in the activator.
    wait_for(
        lambda: standin.in_flight == 2 and act.metric("kubeinfer_activator_held_requests") == 3,
        what="2 sent, 3 held",
    )
    standin.hold = False
    standin.release()
    assert sorted(f.result(timeout=30).json()["choices"][0]["text"] for f in held) == [
        f"echo:{i}" for i in range(5)
    ]
    assert standin.max_in_flight == 2 and standin.refused == 0 and standin.served == 5
    pool.shutdown()
    http.close()


def test_never_scaled_down_while_a_request_is_in_flight_or_a_replica_is_still_loading(setup: Setup) -> None:
    cluster, standin, kubelet, act = setup(delay=0.2, max_wait=2.0)
    # A request held past its wait: 503 saying the model is starting; the model keeps loading.
    r = httpx.post(act.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and "no ready replica within 2 s" in r.json()["message"]
    assert _replicas(cluster) == 1
    time.sleep(1.0)  # several control-loop steps past the delay, nothing held, replica still loading
    assert _replicas(cluster) == 1 and kubelet.desired_seen == [0, 1]
    kubelet.loaded.set()
    standin.hold = True
    pool = ThreadPoolExecutor(1)
    long = pool.submit(
        httpx.post, act.url + "/v1/completions", json={"model": "m", "prompt": "y"}, timeout=30
    )
    wait_for(lambda: standin.in_flight == 1, what="one request in flight")
    time.sleep(1.0)  # past the delay with the request in flight
    assert _replicas(cluster) == 1
    standin.release()
    assert long.result(timeout=30).status_code == 200
    wait_for(lambda: _replicas(cluster) == 0, what="idle scale-down after the request")
    pool.shutdown()


def test_requests_held_when_the_model_is_deleted_get_503(setup: Setup) -> None:
    cluster, standin, _kubelet, act = setup()
    pool = ThreadPoolExecutor(3)
    futures = [
        pool.submit(
            httpx.post, act.url + "/v1/completions", json={"model": "m", "prompt": str(i)}, timeout=30
        )
        for i in range(3)
    ]
    wait_for(lambda: act.metric("kubeinfer_activator_held_requests") == 3, what="three held")
    cluster.delete("Deployment", "m")
    for f in futures:
        r = f.result(timeout=30)
        assert r.status_code == 503 and "does not exist" in r.json()["message"]
        assert r.headers["Retry-After"] == "5"
    assert act.metric("kubeinfer_activator_held_requests") == 0
    assert standin.served == 0
    pool.shutdown()


def test_a_client_that_hangs_up_while_held_gives_up_its_place(setup: Setup) -> None:
    _cluster, standin, kubelet, act = setup(max_held=1)
    # The client hangs up once its request is held (a 0.5 s client timeout could fire before the
    # activator held it on a loaded machine: then there was no place to give up).
    body = json.dumps({"model": "m", "prompt": "gone"}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", act.port), timeout=30) as sock:
        sock.sendall(head + body)
        wait_for(lambda: act.metric("kubeinfer_activator_held_requests") == 1, what="the request held")
    wait_for(lambda: act.metric("kubeinfer_activator_held_requests") == 0, what="the place freed")
    kubelet.loaded.set()
    r = httpx.post(act.url + "/v1/completions", json={"model": "m", "prompt": "next"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "echo:next"
    assert standin.served == 1  # the one that left was never sent on


def test_multi_node_models_are_woken_through_the_leaderworkerset_scale_subresource(
    cluster_factory: Callable[..., MockCluster],
) -> None:
    from kubeinfer_operator.activator.scaler import Scaler, WorkloadState
    from kubeinfer_operator.lws import render_leaderworkerset
    from kubeinfer_operator.spec import InferenceModel
    from op_cluster import LWS
    from op_testlib import inference_model

    cluster = cluster_factory(monitoring=False, keda=False)
    cluster.add_resources(LWS)
    spec = {
        "model": {"uri": "hf://org/model"},
        "scaling": {"minReplicas": 0, "replicas": 1},
        "resources": {"gpu": {"count": 1}},
        "parallelism": {"nodes": 2},
        "engine": {"tensorParallelSize": 2},
    }
    im = InferenceModel.from_manifest(inference_model(spec, name="big"))
    lws = render_leaderworkerset(im)
    assert "replicas" not in lws["spec"]
    cluster.create("LeaderWorkerSet", {**lws, "spec": {**lws["spec"], "replicas": 0}})
    name = lws["metadata"]["name"]
    scaler = Scaler(KubeClient.from_environment(request_timeout=5.0), "LeaderWorkerSet", NS, name)
    assert scaler.read() == WorkloadState(desired=0, ready=0)
    assert scaler.scale(1)
    cluster.patch("LeaderWorkerSet", name, {"status": {"readyReplicas": 1}}, subresource="status")
    assert scaler.read() == WorkloadState(desired=1, ready=1)
    assert (
        cluster.get("LeaderWorkerSet", name)["spec"]["leaderWorkerTemplate"]["size"] == 2
    )  # groups, not pods
    cluster.delete("LeaderWorkerSet", name)
    assert scaler.read() is None and scaler.scale(1) is False


def test_requests_held_when_the_activator_stops_get_503(setup: Setup) -> None:
    _cluster, standin, _kubelet, act = setup()
    pool = ThreadPoolExecutor(2)
    futures = [
        pool.submit(
            httpx.post, act.url + "/v1/completions", json={"model": "m", "prompt": str(i)}, timeout=30
        )
        for i in range(2)
    ]
    wait_for(lambda: act.metric("kubeinfer_activator_held_requests") == 2, what="two held")
    act.lt.run(act.runner.shutdown())  # what SIGTERM starts (the pod deleted with its model)
    for f in futures:
        r = f.result(timeout=30)
        assert r.status_code == 503 and "shutting down" in r.json()["message"]
    assert standin.served == 0
    pool.shutdown()


def test_under_keda_the_activator_holds_and_signals_but_keda_wakes_and_scales_down(setup: Setup) -> None:
    cluster, _standin, kubelet, act = setup(delay=0.2, extra=("--no-wake", "--no-idle-scale-down"))
    pool = ThreadPoolExecutor(1)
    answer = pool.submit(
        httpx.post, act.url + "/v1/completions", json={"model": "m", "prompt": "k"}, timeout=30
    )
    wait_for(lambda: act.metric("kubeinfer_activator_pending") == 1, what="the activation metric up")
    time.sleep(0.5)  # several control-loop steps with a request held
    assert _replicas(cluster) == 0  # KEDA's to write, not the activator's
    # KEDA saw kubeinfer_activator_pending > 0 (activationThreshold 0) and scales 0 -> 1.
    cluster.patch("Deployment", "m", {"spec": {"replicas": 1}}, subresource="scale")
    kubelet.loaded.set()
    assert answer.result(timeout=30).json()["choices"][0]["text"] == "echo:k"
    time.sleep(0.5)  # past the delay, idle: KEDA's cooldown decides, not the activator
    assert _replicas(cluster) == 1 and kubelet.desired_seen == [0, 1]
    assert act.metric("kubeinfer_activator_pending") == 0
    pool.shutdown()


def _send_big_body(port: int, total: int, sized: bool) -> bytes:
    """Sends a request with a `total`-byte body (declared, or chunked without a length) in 64 KiB
    pieces until the activator answers or closes; returns what it answered."""
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {total}\r\n\r\n" if sized else "Transfer-Encoding: chunked\r\n\r\n"
    piece = b" " * 65536
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        sent = 0
        sock.setblocking(False)
        answer = b""
        while sent < total:
            try:
                answer += sock.recv(65536)
                break  # the activator answered before the whole body was sent
            except BlockingIOError:
                pass
            try:
                sock.sendall(piece if sized else b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                time.sleep(0.01)
                continue
            sent += len(piece)
        sock.setblocking(True)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    return answer


@pytest.mark.parametrize("sized", [True, False])
def test_a_body_over_the_servers_limit_is_refused_at_once_and_never_held(setup: Setup, sized: bool) -> None:
    """The activator held up to 64 MiB per request (aiohttp's client_max_size) while the model woke;
    now a body over --max-payload-bytes (the server's, 2,000,000 by default) gets 413 before it is
    held, and the model is not woken for it."""
    cluster, standin, kubelet, act = setup(max_wait=3.0)
    answer = _send_big_body(act.port, 3_000_000, sized)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
    assert b"request body is larger than 2000000 bytes" in answer
    assert act.metric("kubeinfer_activator_held_requests") == 0
    assert _replicas(cluster) == 0 and standin.served == 0
    # a body within the limit is still held and forwarded once the model is up
    kubelet.loaded.set()
    r = httpx.post(act.url + "/v1/completions", json={"model": "m", "prompt": "small"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "echo:small"


def test_activator_max_payload_bytes_flag() -> None:
    from kubeinfer_operator.activator.__main__ import parser
    from kubeinfer_operator.activator.proxy import ProxyConfig

    base = ["--namespace=n", "--name=m", "--upstream=http://x:1"]
    assert parser().parse_args(base).max_payload_bytes == 2_000_000
    assert parser().parse_args([*base, "--max-payload-bytes=5000"]).max_payload_bytes == 5000
    with pytest.raises(ValueError, match="max_payload_bytes"):
        ProxyConfig(upstream="http://x:1", max_payload_bytes=10)

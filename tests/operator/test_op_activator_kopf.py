"""The whole scale-to-zero cycle with the operator in the loop (kopf's KopfRunner against kmock): the
operator renders the activator and reports ScaledToZero; the activator (real HTTP, started from the
args the operator rendered, its upstream pointed at a stand-in server) wakes the model on a request
(status Waking, not Degraded), the request is answered once a replica is ready (Ready), and the idle
model goes back to zero (ScaledToZero) without the operator undoing the activator's replica count."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from op_cluster import MockCluster, wait_for
from op_testlib import inference_model
from test_op_activator import Kubelet, Running, StandIn
from test_op_kopf import NAME, owned_by

ACTIVATOR = f"{NAME}-activator"
KINDS = ("ServiceAccount", "Role", "RoleBinding", "Service", "Deployment", "ServiceMonitor")


def phase(cluster: MockCluster) -> str | None:
    return ((cluster.get("InferenceModel", NAME) or {}).get("status") or {}).get("phase")


def replicas(cluster: MockCluster) -> int | None:
    dep = cluster.get("Deployment", NAME)
    return None if dep is None else int(dep["spec"].get("replicas") or 0)


def test_scale_to_zero_cycle_with_the_operator(cluster: MockCluster, operator: Any) -> None:
    spec = {
        "model": {"uri": "hf://org/model"},
        "scaling": {"minReplicas": 0, "replicas": 1, "scaleDownDelaySeconds": 6},
        "engine": {"maxConcurrentRequests": 2},
    }
    im = cluster.create("InferenceModel", inference_model(spec, name=NAME))
    for kind in KINDS:
        obj = wait_for(functools.partial(cluster.get, kind, ACTIVATOR), what=f"activator {kind}")
        assert owned_by(obj, im), kind
    # A new scale-to-zero model starts at zero, and says so.
    wait_for(lambda: replicas(cluster) == 0, what="the model's Deployment at 0 replicas")
    standin = StandIn(per_replica=2)
    kubelet = Kubelet(cluster, standin, name=NAME)
    wait_for(lambda: phase(cluster) == "ScaledToZero", what="ScaledToZero")

    dep = cluster.get("Deployment", ACTIVATOR)
    assert dep is not None
    args = list(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    args[args.index("--upstream") + 1] = f"http://127.0.0.1:{standin.port}"
    act = Running([*args, "--poll-seconds=0.1"])
    pool = ThreadPoolExecutor(1)
    try:
        answer = pool.submit(
            httpx.post, act.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=60
        )
        wait_for(lambda: replicas(cluster) == 1, what="woken to scaling.replicas")
        wait_for(lambda: phase(cluster) == "Waking", what="Waking")
        # Several operator resyncs (2 s) while waking: the count stays the activator's.
        wait_for(
            lambda: act.metric("kubeinfer_activator_held_requests", f'model_name="{NAME}"') == 1, what="held"
        )
        assert replicas(cluster) == 1 and phase(cluster) == "Waking"
        kubelet.loaded.set()
        r = answer.result(timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "echo:hi"
        wait_for(lambda: phase(cluster) == "Ready", what="Ready")
        wait_for(lambda: kubelet.desired_seen[-3:] == [0, 1, 0], what="idle scale-down")
        wait_for(lambda: phase(cluster) == "ScaledToZero", what="ScaledToZero again")
        assert replicas(cluster) == 0
    finally:
        pool.shutdown()
        act.stop()
        kubelet.stop()
        standin.stop()

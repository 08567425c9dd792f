"""Every renderer: content checks, and every manifest valid against its schema (kubernetes-validate
--strict for built-in kinds; vendored upstream CRD schemas for ServiceMonitor and ScaledObject)."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
from kubeinfer_operator.render import (
    CACHE_DIR,
    SERVER_PORT,
    Capabilities,
    ChildRef,
    endpoint_url,
    is_subset,
    prometheus_query,
    render_all,
    render_deployment,
    render_hpa,
    render_pdb,
    render_scaledobject,
    render_service,
    render_servicemonitor,
    selector_labels,
    startup_failure_threshold,
    termination_grace_seconds,
)
from kubeinfer_operator.spec import DEFAULT_SERVER_IMAGE, InferenceModel
from op_apichecks import GATEWAY_KINDS, gateway_api_errors
from op_testlib import EXAMPLES, K8S_VERSIONS, inference_model, load_json_schema, load_yaml, lws_errors

UID = "6f1c8c0e-8a57-4a4c-9d6e-2f7f2b1f0a11"


def make(
    spec: dict[str, Any], name: str = "llm", namespace: str = "ml", uid: str | None = UID
) -> InferenceModel:
    doc = inference_model(spec, name=name, namespace=namespace)
    if uid is not None:
        doc["metadata"]["uid"] = uid
        doc["metadata"]["generation"] = 3
    return InferenceModel.from_manifest(doc)


HF = {"uri": "hf://org/model"}
HPA_SPEC: dict[str, Any] = {
    "model": HF,
    "scaling": {
        "autoscaler": "HPA",
        "minReplicas": 2,
        "maxReplicas": 6,
        "metric": "KVCacheUsage",
        "target": 0.8,
    },
}
KEDA_SPEC: dict[str, Any] = {
    "model": HF,
    "scaling": {
        "autoscaler": "KEDA",
        "minReplicas": 0,
        "replicas": 0,
        "maxReplicas": 4,
        "prometheusAddress": "http://prom:9090",
    },
}


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# ---------------------------------------------------------------- Deployment


def test_deployment_args_follow_the_spec() -> None:
    im = make(
        {
            "model": {"uri": "hf://org/model", "servedName": "chat"},
            "engine": {
                "quantization": "awq",
                "dtype": "float16",
                "task": "embed",
                "maxModelLen": 4096,
                "maxNumSeqs": 32,
                "maxConcurrentRequests": 100,
                "extraArgs": ["--block-size", "32"],
            },
            "resources": {"gpu": {"count": 1}},  # AWQ kernels are GPU kernels: the CUDA image
            "rollout": {"drainTimeoutSeconds": 90},
        }
    )
    c = container(render_deployment(im))
    args = c["args"]
    assert c["image"] == DEFAULT_SERVER_IMAGE
    assert flag(args, "--model") == "org/model"
    assert flag(args, "--served-model-name") == "chat"
    assert flag(args, "--quantize") == "awq"
    assert flag(args, "--dtype") == "float16"
    assert flag(args, "--task") == "embed"
    assert flag(args, "--max-total-tokens") == "4096"
    assert flag(args, "--max-num-seqs") == "32"
    assert flag(args, "--max-concurrent-requests") == "100"
    assert flag(args, "--port") == str(SERVER_PORT)
    assert flag(args, "--drain-timeout") == "90"
    assert flag(args, "--cache-dir") == CACHE_DIR
    assert "--enable-prefix-caching" in args
    assert args[-2:] == ["--block-size", "32"]


def test_deployment_leaves_optional_flags_out() -> None:
    args = container(render_deployment(make({"model": HF, "engine": {"enablePrefixCaching": False}})))["args"]
    for name in (
        "--quantize",
        "--task",  # auto: the server reads the model's config.json
        "--max-total-tokens",
        "--max-num-seqs",
        "--max-concurrent-requests",
        "--enable-prefix-caching",
    ):
        assert name not in args
    assert "--no-enable-prefix-caching" in args  # the server enables it by default: turn it off explicitly
    assert flag(args, "--served-model-name") == "org/model"


@pytest.mark.parametrize(
    ("uri", "model_arg", "claim"),
    [
        ("hf://org/model", "org/model", None),
        ("pvc://weights/llama/8b", "/models/weights/llama/8b", "weights"),
        ("pvc://weights", "/models/weights", "weights"),
        ("/opt/model", "/opt/model", None),
    ],
)
def test_model_sources(uri: str, model_arg: str, claim: str | None) -> None:
    dep = render_deployment(make({"model": {"uri": uri}}))
    assert flag(container(dep)["args"], "--model") == model_arg
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    if claim is None:
        assert "model" not in vols
    else:
        assert vols["model"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        mounts = {m["name"]: m for m in container(dep)["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True
        assert model_arg.startswith(mounts["model"]["mountPath"])


def test_probes_and_drain() -> None:
    im = make({"model": HF, "probes": {"startupTimeoutSeconds": 601}, "rollout": {"drainTimeoutSeconds": 40}})
    dep = render_deployment(im)
    c = container(dep)
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/ready", "port": "http"}
    # The probe may fail for at least the whole startup timeout before the kubelet restarts it.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 601
    assert startup["periodSeconds"] * (startup["failureThreshold"] - 1) < 601
    assert startup_failure_threshold(601) == startup["failureThreshold"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    # SIGTERM comes after preStop; the server then needs its whole drain timeout.
    assert grace >= pre_stop + 40
    assert grace == termination_grace_seconds(40)
    assert dep["spec"]["progressDeadlineSeconds"] > 601


def test_gpu_resources_and_scheduling() -> None:
    im = make(
        {
            "model": HF,
            "resources": {
                "gpu": {"count": 1, "product": "NVIDIA-H100-80GB-HBM3"},
                "cpu": 8,
                "memory": "64Gi",
            },
            "scheduling": {
                "nodeSelector": {"pool": "gpu"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "priorityClassName": "inference",
                "runtimeClassName": "nvidia",
                "affinity": {"nodeAffinity": {}},
            },
        }
    )
    dep = render_deployment(im)
    pod = dep["spec"]["template"]["spec"]
    res = container(dep)["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "1"
    assert res["requests"]["nvidia.com/gpu"] == "1"
    assert res["requests"]["cpu"] == "8"
    assert res["limits"]["memory"] == res["requests"]["memory"] == "64Gi"
    assert pod["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["priorityClassName"] == "inference"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["affinity"] == {"nodeAffinity": {}}


def test_cpu_only_has_no_gpu_request() -> None:
    dep = render_deployment(make({"model": HF, "resources": {"gpu": {"count": 0, "product": "X"}}}))
    # Default requests keep the pod out of BestEffort; no GPU, no limit the user did not ask for.
    assert container(dep)["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert "nodeSelector" not in dep["spec"]["template"]["spec"]


def test_secrets_and_cache() -> None:
    im = make(
        {
            "model": {
                "uri": "hf://org/model",
                "revision": "abc123",
                "credentialsSecretRef": {"name": "hub", "key": "token"},
            },
            "engine": {"apiKeySecretRef": {"name": "keys", "key": "k"}},
            "cache": {"claimName": "shared-cache"},
        }
    )
    dep = render_deployment(im)
    env = {e["name"]: e for e in container(dep)["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hub", "key": "token"}
    assert env["API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "k"}
    assert env["KUBEINFER_CACHE_DIR"]["value"] == CACHE_DIR
    assert env["MODEL_REVISION"]["value"] == "abc123"
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": "shared-cache"}}
    no_claim = render_deployment(make({"model": HF, "cache": {"sizeLimit": "100Gi"}}))
    vols = {v["name"]: v for v in no_claim["spec"]["template"]["spec"]["volumes"]}
    assert vols["cache"]["emptyDir"] == {"sizeLimit": "100Gi"}


def test_replicas_owned_by_operator_unless_autoscaled() -> None:
    assert (
        render_deployment(make({"model": HF, "scaling": {"replicas": 3, "maxReplicas": 3}}))["spec"][
            "replicas"
        ]
        == 3
    )
    assert "replicas" not in render_deployment(make(HPA_SPEC))["spec"]
    assert "replicas" not in render_deployment(make(KEDA_SPEC))["spec"]
    # Suspending wins over the autoscaler: zero replicas, and no autoscaler object.
    suspended = make({**HPA_SPEC, "suspend": True})
    assert render_deployment(suspended)["spec"]["replicas"] == 0
    kinds = {o["kind"] for o in render_all(suspended).objects}
    assert "HorizontalPodAutoscaler" not in kinds and "PodDisruptionBudget" not in kinds


def test_rollout_strategy() -> None:
    dep = render_deployment(make({"model": HF, "rollout": {"maxSurge": "25%", "maxUnavailable": 1}}))
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 1},
    }


def test_metadata_labels_and_owner() -> None:
    im = make({"model": HF})
    for obj in render_all(im).objects:
        meta = obj["metadata"]
        assert meta["name"] == "llm" and meta["namespace"] == "ml"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kubeinfer-operator"
        assert meta["labels"]["app.kubernetes.io/instance"] == "llm"
        (owner,) = meta["ownerReferences"]
        assert owner == {
            "apiVersion": "kubeinfer.dev/v1alpha1",
            "kind": "InferenceModel",
            "name": "llm",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    offline = make({"model": HF}, uid=None)
    assert all("ownerReferences" not in o["metadata"] for o in render_all(offline).objects)


def test_selector_matches_pod_labels() -> None:
    dep = render_deployment(make({"model": HF}))
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


# ---------------------------------------------------------------- Service, ServiceMonitor, PDB


def test_service() -> None:
    im = make({"model": HF})
    svc = render_service(im)
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}
    ]
    assert svc["spec"]["selector"] == selector_labels(im)
    assert endpoint_url(im) == f"http://llm.ml.svc:{SERVER_PORT}"


def test_servicemonitor() -> None:
    im = make(
        {"model": HF, "monitoring": {"serviceMonitor": {"interval": "15s", "labels": {"release": "prom"}}}}
    )
    sm = render_servicemonitor(im)
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert sm["spec"]["selector"]["matchLabels"].items() <= render_service(im)["metadata"]["labels"].items()
    assert sm["metadata"]["labels"]["release"] == "prom"


def test_servicemonitor_depends_on_the_crd_and_the_switch() -> None:
    im = make({"model": HF})
    assert render_all(im, Capabilities(service_monitor=True)).monitoring_skipped_reason is None
    plan = render_all(im, Capabilities(service_monitor=False))
    assert plan.monitoring_skipped_reason == "CRDNotInstalled"
    assert ChildRef("ServiceMonitor", im.child_name) in plan.absent
    off = render_all(make({"model": HF, "monitoring": {"serviceMonitor": {"enabled": False}}}))
    assert off.monitoring_skipped_reason == "Disabled"


def test_pdb_only_with_more_than_one_replica() -> None:
    kinds = lambda spec: {o["kind"] for o in render_all(make(spec)).objects}  # noqa: E731
    assert "PodDisruptionBudget" not in kinds({"model": HF})
    assert "PodDisruptionBudget" in kinds({"model": HF, "scaling": {"replicas": 2}})
    assert "PodDisruptionBudget" in kinds(HPA_SPEC)  # minReplicas 2
    assert "PodDisruptionBudget" in kinds(KEDA_SPEC)  # up to 4 replicas: a maxUnavailable budget
    pdb = render_pdb(make({"model": HF, "scaling": {"replicas": 3}, "disruption": {"minAvailable": "50%"}}))
    assert pdb["spec"]["minAvailable"] == "50%"
    assert pdb["spec"]["selector"]["matchLabels"] == selector_labels(make({"model": HF}))


# ---------------------------------------------------------------- autoscalers


@pytest.mark.parametrize(
    ("metric", "target", "name", "average"),
    [
        ("QueueDepth", None, "vllm_num_requests_waiting", "5"),
        ("KVCacheUsage", 0.8, "vllm_kv_cache_usage_perc", "800m"),
        ("RunningRequests", 12, "vllm_num_requests_running", "12"),
    ],
)
def test_hpa(metric: str, target: float | None, name: str, average: str) -> None:
    scaling: dict[str, Any] = {
        "autoscaler": "HPA",
        "maxReplicas": 5,
        "metric": metric,
        "scaleDownDelaySeconds": 120,
    }
    if target is not None:
        scaling["target"] = target
    hpa = render_hpa(make({"model": HF, "scaling": scaling}))
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 5)
    (m,) = spec["metrics"]
    assert m["type"] == "Pods"
    assert m["pods"]["metric"]["name"] == name
    assert m["pods"]["target"] == {"type": "AverageValue", "averageValue": average}
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120


@pytest.mark.parametrize(
    ("metric", "series"),
    [
        ("QueueDepth", "vllm:num_requests_waiting"),
        ("KVCacheUsage", "vllm:kv_cache_usage_perc"),
        ("RunningRequests", "vllm:num_requests_running"),
    ],
)
def test_scaledobject(metric: str, series: str) -> None:
    spec_doc = {
        **KEDA_SPEC,
        "scaling": {**KEDA_SPEC["scaling"], "metric": metric},
        "model": {"uri": "hf://org/model", "servedName": "chat"},
    }
    so = render_scaledobject(make(spec_doc))
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == "llm"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 4)
    # minReplicas 0: the activator's trigger wakes the model from zero (test_op_activator.py).
    trigger, activation = spec["triggers"]
    assert activation["name"] == "activator" and activation["metadata"]["activationThreshold"] == "0"
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["serverAddress"] == "http://prom:9090"
    assert all(isinstance(v, str) for v in trigger["metadata"].values())
    expr: Any = promql_parser.parse(trigger["metadata"]["query"])
    assert isinstance(expr, promql_parser.AggregateExpr) and str(expr.op) == "sum"
    selector: Any = expr.expr
    assert isinstance(selector, promql_parser.VectorSelector)
    assert selector.name == series
    matchers = {m.name: m.value for m in selector.matchers.matchers}
    assert matchers == {"namespace": "ml", "service": "llm", "model_name": "chat"}
    assert float(trigger["metadata"]["threshold"]) > 0


def test_prometheus_query_is_namespaced() -> None:
    assert 'namespace="ml"' in prometheus_query(make(KEDA_SPEC))


# ---------------------------------------------------------------- schemas


SPECS: dict[str, dict[str, Any]] = {
    "minimal": {"model": HF},
    "full": {
        "model": {"uri": "pvc://w/m", "servedName": "m", "credentialsSecretRef": {"name": "s", "key": "k"}},
        "engine": {"quantization": "gptq", "maxModelLen": 2048, "apiKeySecretRef": {"name": "a", "key": "b"}},
        "resources": {"gpu": {"count": 1, "product": "NVIDIA-L4"}, "cpu": "500m", "memory": "16Gi"},
        "cache": {"claimName": "c"},
        "scaling": {"replicas": 2},
        "scheduling": {"tolerations": [{"key": "k", "operator": "Exists"}], "nodeSelector": {"a": "b"}},
    },
    "hpa": HPA_SPEC,
    "keda": KEDA_SPEC,
    "zero": {"model": HF, "scaling": {"minReplicas": 0, "replicas": 2}},
    "suspended": {**HPA_SPEC, "suspend": True},
    "adapters": {
        "model": HF,
        "adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}, {"name": "b", "uri": "/a/b"}],
    },
}
ALL_OBJECTS = [
    pytest.param(obj, id=f"{name}-{obj['kind']}")
    for name, spec in SPECS.items()
    for obj in render_all(make(spec)).objects
] + [
    pytest.param(obj, id=f"{path.stem}-{obj['kind']}")
    for path in EXAMPLES
    for obj in render_all(InferenceModel.from_manifest(load_yaml(path))).objects
]
CRD_KIND_SCHEMAS = {
    "ServiceMonitor": "servicemonitor.monitoring.coreos.com_v1.json",
    "ScaledObject": "scaledobject.keda.sh_v1alpha1.json",
}


def test_every_kind_is_covered() -> None:
    kinds = {p.values[0]["kind"] for p in ALL_OBJECTS}  # type: ignore[index]
    assert kinds == {
        "PersistentVolumeClaim",  # examples/shared-cache.yaml: the cache claim and its loader Job
        "Job",
        "Deployment",
        "Service",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "PodDisruptionBudget",
        "ConfigMap",
        "LeaderWorkerSet",  # examples/multi-node.yaml
        "NetworkPolicy",  # every model, and its router (netpol.py)
        "ServiceAccount",  # the activator's (keda, zero: minReplicas 0)
        "Role",
        "RoleBinding",
        "InferencePool",  # examples/gateway.yaml (spec.routing.gateway)
        "HTTPRoute",
        "InferenceObjective",  # examples/gateway-priority.yaml
    }


@pytest.mark.parametrize("obj", ALL_OBJECTS)
def test_manifest_is_valid(obj: dict[str, Any]) -> None:
    kind = obj["kind"]
    if kind == "LeaderWorkerSet":
        assert lws_errors(obj) == []  # the vendored LWS CRD schema, strict (more in test_op_lws.py)
    elif kind in GATEWAY_KINDS:
        assert gateway_api_errors(obj) == []  # no schema vendored: the published rules (op_apichecks)
    elif kind in CRD_KIND_SCHEMAS:
        jsonschema.Draft7Validator(load_json_schema(CRD_KIND_SCHEMAS[kind])).validate(obj)
    else:
        for version in K8S_VERSIONS:
            if version < "1.35" and _has_image_volume(obj):
                continue  # an oci:// model: the operator applies nothing below 1.35 (ImageVolumeUnsupported)
            kubernetes_validate.validate(obj, version, strict=True)


def _has_image_volume(obj: dict[str, Any]) -> bool:
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    return any("image" in v for v in pod.get("volumes") or [])


def test_strict_validation_catches_a_typo() -> None:
    # The check above can fail: an unknown field in a built-in kind and in a CRD kind is rejected.
    dep = render_deployment(make({"model": HF}))
    dep["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)
    so = render_scaledobject(make(KEDA_SPEC))
    so["spec"]["minReplicas"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(load_json_schema(CRD_KIND_SCHEMAS["ScaledObject"])).validate(so)
    sm = render_servicemonitor(make({"model": HF}))
    sm["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(load_json_schema(CRD_KIND_SCHEMAS["ServiceMonitor"])).validate(sm)


# ---------------------------------------------------------------- drift detection


def test_is_subset_ignores_server_defaults_but_sees_edits() -> None:
    desired = render_deployment(make({"model": HF}))
    live = {**desired, "status": {"replicas": 1}}
    live["spec"] = {**desired["spec"], "revisionHistoryLimit": 5, "paused": False}
    assert is_subset(desired, live)
    edited = render_deployment(make({"model": HF}))
    container(edited)["image"] = "evil:latest"
    assert not is_subset(desired, edited)
    assert is_subset({"a": 1}, {"a": "1"})
    assert not is_subset({"a": [1, 2]}, {"a": [1]})


def test_pod_customization_reaches_the_pod() -> None:
    from op_admission_table import ADMISSION

    (row,) = [r for r in ADMISSION if r.id == "pod-all-fields"]
    dep = render_deployment(make(row.spec))
    tmpl = dep["spec"]["template"]
    pod, c = tmpl["spec"], container(dep)
    assert tmpl["metadata"]["labels"]["team"] == "search"
    assert tmpl["metadata"]["labels"]["app.kubernetes.io/instance"] == "llm"
    assert tmpl["metadata"]["annotations"]["prometheus.io/scrape"] == "false"
    assert pod["serviceAccountName"] == "llm-reader" and pod["automountServiceAccountToken"] is False
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"} in c["env"]
    assert c["envFrom"] == [{"configMapRef": {"name": "tuning"}, "prefix": "TUNING_"}]
    assert {"name": "extra", "configMap": {"name": "chat-templates"}} in pod["volumes"]
    assert {"name": "extra", "mountPath": "/data/templates", "readOnly": True} in c["volumeMounts"]
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)


def test_pdb_never_forbids_every_eviction() -> None:
    kinds = lambda spec: {o["kind"]: o for o in render_all(make(spec)).objects}  # noqa: E731
    one_to_four = {"model": HF, "scaling": {"autoscaler": "HPA", "minReplicas": 1, "maxReplicas": 4}}
    pdb = kinds(one_to_four)["PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    two = kinds({"model": HF, "scaling": {"replicas": 2}})["PodDisruptionBudget"]
    assert two["spec"]["minAvailable"] == 1
    assert "PodDisruptionBudget" not in kinds({"model": HF})


# ---------------------------------------------------------------- LoRA adapters


ADAPTERS_SPEC: dict[str, Any] = {
    "model": {"uri": "pvc://models/base"},
    "adapters": [
        {"name": "sql", "uri": "hf://org/sql-lora"},
        {"name": "chat", "uri": "pvc://models/adapters/chat"},
        {"name": "baked", "uri": "/adapters/baked"},
    ],
}


def test_adapters_render_into_lora_flags_and_a_configmap() -> None:
    plan = render_all(make(ADAPTERS_SPEC))
    objs = {o["kind"]: o for o in plan.objects}
    cm = objs["ConfigMap"]
    assert cm["metadata"]["name"] == "llm-adapters" and cm["metadata"]["ownerReferences"][0]["uid"] == UID
    assert cm["data"] == {
        "LORA_MODULES": "sql=org/sql-lora chat=/models/models/adapters/chat baked=/adapters/baked"
    }
    kinds = [o["kind"] for o in plan.objects]
    assert kinds.index("ConfigMap") < kinds.index("Deployment")  # pods start with their list in place
    c = container(objs["Deployment"])
    args = c["args"]
    assert "--lora-modules" not in args  # the list stays out of the pod template
    assert "--enable-lora" in args and "--allow-runtime-lora-updating" in args
    assert flag(args, "--max-loras") == "4" and flag(args, "--max-cpu-loras") == "16"
    env = {e["name"]: e for e in c["env"]}
    assert env["LORA_MODULES"]["valueFrom"] == {
        "configMapKeyRef": {"name": "llm-adapters", "key": "LORA_MODULES"}
    }
    # the server parses what the operator renders, the env var resolved as the kubelet resolves it
    from server.cli import build_parser, config_from_args

    lora = config_from_args(build_parser(dict(cm["data"])).parse_args(args)).engine.lora
    assert [m.name for m in lora.lora_modules] == ["sql", "chat", "baked"]
    assert lora.max_loras == 4 and lora.allow_runtime_updating
    # without adapters: no LoRA flags, no env, the ConfigMap wanted absent
    plain = render_all(make({"model": HF}))
    assert "--enable-lora" not in container(render_deployment(make({"model": HF})))["args"]
    assert ChildRef("ConfigMap", "llm-adapters") in plain.absent
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(cm, version, strict=True)


def test_adapter_list_changes_leave_the_pod_template_alone() -> None:
    """Adding or removing one adapter among others changes the ConfigMap only (no rolling update); the
    first adapter, the last one, and a model behind an API key change the template."""
    template = lambda spec: render_deployment(make(spec))["spec"]["template"]  # noqa: E731
    cm = lambda spec: render_all(make(spec)).objects  # noqa: E731
    two = {**ADAPTERS_SPEC, "adapters": ADAPTERS_SPEC["adapters"][:2]}
    assert template(two) == template(ADAPTERS_SPEC)
    assert [o for o in cm(two) if o["kind"] == "ConfigMap"] != [
        o for o in cm(ADAPTERS_SPEC) if o["kind"] == "ConfigMap"
    ]
    base = {"model": ADAPTERS_SPEC["model"]}
    assert template(base) != template({**base, "adapters": ADAPTERS_SPEC["adapters"][:1]})
    keyed = {**ADAPTERS_SPEC, "engine": {"apiKeySecretRef": {"name": "a", "key": "b"}}}
    keyed_two = {**two, "engine": keyed["engine"]}
    assert "--allow-runtime-lora-updating" not in container(render_deployment(make(keyed)))["args"]
    assert template(keyed) != template(keyed_two)  # the list's hash is in the pod annotations
    assert "kubeinfer.dev/adapters-hash" in template(keyed)["metadata"]["annotations"]


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ([{"name": "a", "uri": "/x"}, {"name": "a", "uri": "/y"}], "must be unique"),
        ([{"name": "base", "uri": "/x"}], "is the model's served name"),
        ([{"name": "a", "uri": "pvc://other/x"}], "must live on the model's claim"),
        (
            [{"name": "a", "uri": "/x", "credentialsSecretRef": {"name": "s", "key": "k"}}],
            "must be the model's",
        ),
    ],
)
def test_adapter_semantic_errors(adapters: list[dict[str, Any]], message: str) -> None:
    from kubeinfer_operator.spec import semantic_errors

    im = make({"model": {"uri": "hf://org/model", "servedName": "base"}, "adapters": adapters})
    assert any(message in e for e in semantic_errors(im.spec)), semantic_errors(im.spec)

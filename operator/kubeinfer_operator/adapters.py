"""LoRA adapters (`spec.adapters`) as the Deployment and its pods see them. Pure functions.

Adding or removing an adapter must not restart the pods, so the adapter list stays out of the pod
template (any change there is a rolling update):
- the list lives in a ConfigMap (`<child>-adapters`, key `LORA_MODULES`, the server's space-separated
  `name=path` form), read by the server at start through an env var `valueFrom.configMapKeyRef`: a pod
  that starts (or restarts) later serves the current list, yet editing the ConfigMap changes nothing in
  the template;
- pods already running get the change through the server's run-time routes (`adapter_sync.py`), which
  the template enables with `--allow-runtime-lora-updating`.
The template changes (a rolling update) only when that cannot work: the first adapter of a model (the
pods run without `--enable-lora`), the last one removed (LoRA off again), and a model behind an API key
(the operator holds no key for the pods' routes; the adapter list's hash goes into a pod annotation).
`--max-loras` and `--max-cpu-loras` are fixed values, not derived from the list, for the same reason.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .cache import adapter_path
from .spec import InferenceModel, model_location

LORA_MODULES_KEY = "LORA_MODULES"
# Adapters resident in one batch (vLLM's --max-loras) and kept loaded in memory (LRU beyond; evicted
# ones are re-read from the cache volume). Fixed, so that the list can change without a rollout.
MAX_LORAS = 4
MAX_CPU_LORAS = 16
ADAPTERS_HASH_ANNOTATION = "kubeinfer.dev/adapters-hash"

Manifest = dict[str, Any]


def configmap_name(im: InferenceModel) -> str:
    return f"{im.base_child_name}-adapters"


def desired_adapters(im: InferenceModel) -> dict[str, str]:
    """name -> the path the server loads (a hub id, fetched into the cache volume, or a folder; with a
    shared cache, a hub adapter's folder the loader Job filled)."""
    shared = im.spec.cache.shared
    return {
        a.name: (adapter_path(a.uri) if shared else None) or model_location(a.uri).server_model
        for a in im.spec.adapters
    }


def lora_modules_value(im: InferenceModel) -> str:
    """`LORA_MODULES` for the server: space-separated `name=path` (server/cli.py's env form)."""
    return " ".join(f"{name}={path}" for name, path in desired_adapters(im).items())


def runtime_updates(im: InferenceModel) -> bool:
    """Whether running pods take adapter changes through the run-time routes (else a rolling update)."""
    return bool(im.spec.adapters) and im.spec.engine.api_key_secret_ref is None


def lora_server_args(im: InferenceModel) -> list[str]:
    """Server flags for LoRA: none without adapters; the module list itself comes from the ConfigMap."""
    if not im.spec.adapters:
        return []
    args = ["--enable-lora", "--max-loras", str(MAX_LORAS), "--max-cpu-loras", str(MAX_CPU_LORAS)]
    if runtime_updates(im):
        args.append("--allow-runtime-lora-updating")
    return args


def lora_env(im: InferenceModel) -> list[dict[str, Any]]:
    if not im.spec.adapters:
        return []
    ref = {"name": configmap_name(im), "key": LORA_MODULES_KEY}
    return [{"name": LORA_MODULES_KEY, "valueFrom": {"configMapKeyRef": ref}}]


def lora_pod_annotations(im: InferenceModel) -> dict[str, str]:
    """Without run-time updates a changed list must restart the pods: its hash goes into the template."""
    if not im.spec.adapters or runtime_updates(im):
        return {}
    digest = hashlib.sha256(lora_modules_value(im).encode()).hexdigest()[:16]
    return {ADAPTERS_HASH_ANNOTATION: digest}


def render_adapters_configmap(im: InferenceModel, metadata: dict[str, Any]) -> Manifest:
    """The ConfigMap the server reads `LORA_MODULES` from; `metadata` = the model's child metadata."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**metadata, "name": configmap_name(im)},
        "data": {LORA_MODULES_KEY: lora_modules_value(im)},
    }

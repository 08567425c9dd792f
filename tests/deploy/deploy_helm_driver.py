"""Runs one helm-sdkpy action; executed by the Python >= 3.12 of .venv-helm, not by pytest.

Reads a JSON request on stdin and prints {"ok": true, "result": ...} or {"ok": false, "error": "..."}.
  {"action": "lint", "chart": PATH}
  {"action": "install", "chart": PATH, "kubeconfig": PATH, "namespace": NS, "release": NAME, "values": {}}
Helm runs in-process (a Go library through cffi); HELM_DRIVER=memory keeps releases out of the cluster.
"""

import asyncio
import json
import sys

import helm_sdkpy


def main() -> None:
    request = json.load(sys.stdin)
    try:
        if request["action"] == "lint":
            config = helm_sdkpy.Configuration(namespace=request.get("namespace", "default"))
            result = asyncio.run(helm_sdkpy.Lint(config).run(request["chart"]))
        elif request["action"] == "install":
            config = helm_sdkpy.Configuration(
                namespace=request["namespace"], kubeconfig=request["kubeconfig"]
            )
            result = asyncio.run(
                helm_sdkpy.Install(config).run(
                    request["release"],
                    request["chart"],
                    values=request.get("values") or None,
                    wait=False,
                    timeout=120,
                    # Helm's own schema check of rendered objects needs /openapi/v2, which the API
                    # mock does not serve; the test validates every object with kubernetes-validate.
                    disable_openapi_validation=True,
                )
            )
        else:
            raise ValueError(f"unknown action {request['action']!r}")
    except helm_sdkpy.HelmError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return
    print(json.dumps({"ok": True, "result": result}, default=str))


if __name__ == "__main__":
    main()

"""kubeinfer's inference server: engine (core, worker, models, attention, quant) and HTTP API."""

from server.cpu_env import configure_cpu_runtime

# Every `server.*` module loads this package first, so the environment is in place before any of them
# imports torch (libgomp and oneDNN read it once).
configure_cpu_runtime()

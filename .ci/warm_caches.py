"""CI warm-up before `make test`: converts the embedded model and builds the CPU kernels into the cache
(~/.cache/kubeinfer or $KUBEINFER_CACHE_DIR) once, here, on a clean clone's cold cache.

Without it the first test that needs either pays for it inside its own 600 s pytest-timeout (fixture
setup counts), next to server processes on a loaded machine: the conversion alone took a minute there.
Best-effort: a failure is printed and the tests then build what they need themselves (and report their
own error if that fails too)."""

from __future__ import annotations

import importlib
import sys
import time
import traceback

# Modules that define a `NATIVE` kernel source (server/native.py builds and caches each one).
KERNEL_MODULES = ("server.models.cpu_fused", "server.attention.cpu_kernel", "server.quant.cpu_qlinear")


def main() -> int:
    from server.config import default_cache_dir

    steps = [("the embedded model", _embedded_model)]
    steps += [(name, lambda name=name: _kernel(name)) for name in KERNEL_MODULES]
    print(f"warm caches in {default_cache_dir()}", flush=True)
    for what, step in steps:
        t0 = time.monotonic()
        try:
            step()
        except Exception:
            print(f"warning: warming {what} failed; the tests will try themselves:", flush=True)
            traceback.print_exc()
        else:
            print(f"  {what}: {time.monotonic() - t0:.1f} s", flush=True)
    return 0


def _embedded_model() -> None:
    from server.models.loader import resolve_model

    resolve_model(None)


def _kernel(module: str) -> None:
    from server.config import default_cache_dir
    from server.native import load_library

    load_library(importlib.import_module(module).NATIVE, default_cache_dir())


if __name__ == "__main__":
    sys.exit(main())

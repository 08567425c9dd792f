"""CI warm-up before `make test`: converts the embedded model and builds the CPU kernels into the cache
(~/.cache/kubeinfer or $KUBEINFER_CACHE_DIR) once, here, on a clean clone's cold cache.

Without it the first test that needs either pays for it inside its own 600 s pytest-timeout (fixture
setup counts), next to server processes on a loaded machine: the conversion alone took a minute there.
Best-effort: a failure is printed and the tests then build what they need themselves (and report their
own error if that fails too)."""

from __future__ import annotations

import concurrent.futures
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.native import NativeSource


def main() -> int:
    from server.config import default_cache_dir
    from server.cpu_env import usable_cpus

    # every kernel the server builds (the image's list), each compiler on a CPU of its own beside the
    # conversion (one Python thread): the steps overlap instead of leaving a core idle
    steps = [("the embedded model", _embedded_model)]
    try:
        from server.prebuild_kernels import SOURCES as sources
    except Exception:  # best-effort, as every step: the tests build their kernels themselves
        print(f"warning: the kernels' list did not import:\n{traceback.format_exc()}", flush=True)
        sources = ()
    steps += [(f"the {src.name} kernel", lambda src=src: _kernel(src)) for src in sources]
    print(f"warm caches in {default_cache_dir()}", flush=True)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=usable_cpus() + 1) as pool:
        for what, step in steps:
            pool.submit(_timed, what, step)
    print(f"  all: {time.monotonic() - t0:.1f} s", flush=True)
    return 0


def _timed(what: str, step: Callable[[], None]) -> None:
    t0 = time.monotonic()
    try:
        step()
    except Exception:
        print(
            f"warning: warming {what} failed; the tests will try themselves:\n{traceback.format_exc()}",
            flush=True,
        )
    else:
        print(f"  {what}: {time.monotonic() - t0:.1f} s", flush=True)


def _embedded_model() -> None:
    from server.models.loader import resolve_model

    resolve_model(None)


def _kernel(src: NativeSource) -> None:
    from server.config import default_cache_dir
    from server.native import load_library

    load_library(src, default_cache_dir())


if __name__ == "__main__":
    sys.exit(main())

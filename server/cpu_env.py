"""Process environment for torch's CPU runtime; read once by libgomp and oneDNN, so it must be in place
before torch loads (`server/__init__.py` applies it). A value the user set always wins.

OpenMP wait policy. Measured on the 2-core CI machine (fp32 SmolLM2, benchmarks/offline_throughput.py
and serve_load.py):
- libgomp's default (spin ~300k iterations, then sleep) starves the HTTP event loop and any neighbour
  process: torch slows 10-50x next to a busy process, and serving at 16 users drops ~25%;
- OMP_WAIT_POLICY=PASSIVE (sleep at once) wakes the workers with a futex for every op: in a decode
  step, where ops are small and many, that costs ~0.4 ms per op (a 64-row RMSNorm takes 0.5 ms
  instead of 0.07 ms);
- a short spin (GOMP_SPINCOUNT=20000, some tens of microseconds) covers the gap between consecutive
  ops of one forward pass and still sleeps as soon as the step ends: ~10% more offline throughput and
  ~15% more requests/s at 16 users than PASSIVE.

oneDNN caches. The pre-packed CPU matmuls (models/serving_weights.py) get a compiled primitive per
input row count, kept in two LRU caches (torch's ideep cache, LRU_CACHE_CAPACITY, and oneDNN's own,
ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 entries each by default at ~0.3 MB an entry. A server sees a
new row count almost every step, so its memory grew by hundreds of MB before the caches filled
(tests/reliability soak: +22% RSS between requests 200 and 1000). 64 entries keep the ~5 shapes of a
step for the last dozen distinct batch sizes at no measurable cost in speed.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "GOMP_SPINCOUNT": "20000",
    "LRU_CACHE_CAPACITY": "64",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
}


def configure_cpu_runtime() -> None:
    for key, value in DEFAULTS.items():
        if key == "GOMP_SPINCOUNT" and "OMP_WAIT_POLICY" in os.environ:
            continue  # the user chose a wait policy; a spin count would override part of it
        os.environ.setdefault(key, value)

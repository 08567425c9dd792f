"""The adapters this server knows (by name) and the loaded weights kept in memory (an LRU of
`max_cpu_loras`). Shared by the HTTP layer (load/unload routes, name lookups) and the engine thread
(weights for a step), hence the lock. Evicted weights are read again from their folder when needed.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from server.config import LoRAConfig
from server.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter, resolve_adapter_path
from server.models.arch import ArchConfig
from server.request import LoRARequest

log = logging.getLogger(__name__)


class LoRAConflictError(ValueError):
    """Loading a name that is already loaded (HTTP 400 in vLLM)."""


class LoRANotFoundError(KeyError):
    """Unloading or using a name that is not loaded (HTTP 404 in vLLM)."""


class LoRARegistry:
    def __init__(
        self, config: LoRAConfig, arch: ArchConfig, dtype: torch.dtype, cache_dir: Path | None = None
    ) -> None:
        self.config = config
        self.arch = arch
        self.dtype = dtype
        self.cache_dir = cache_dir
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}
        self._weights: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Read, check and register an adapter. Raises LoRAConflictError or LoRAAdapterError."""
        if not name:
            raise LoRAAdapterError("lora_name must be non-empty")
        with self._lock:
            if name in self._by_name:
                raise LoRAConflictError(f"The lora adapter '{name}' has already been loaded.")
        folder = resolve_adapter_path(path, self.cache_dir)
        adapter = load_adapter(name, folder, self.arch, self.config.max_lora_rank, self.dtype)
        with self._lock:
            if name in self._by_name:
                raise LoRAConflictError(f"The lora adapter '{name}' has already been loaded.")
            req = LoRARequest(
                name=name, lora_int_id=next(self._ids), path=str(folder), base_model_name=base_model_name
            )
            self._by_name[name] = req
            self._cache(req.lora_int_id, adapter)
        log.info(
            "loaded LoRA adapter %s (rank %d, %d modules, %.1f MiB) from %s",
            name,
            adapter.rank,
            len(adapter.weights),
            adapter.nbytes / 2**20,
            folder,
        )
        return req

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            req = self._by_name.pop(name, None)
            if req is None:
                raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
            self._weights.pop(req.lora_int_id, None)
            return req

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def names(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())

    def weights(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter's weights, from memory or read again from its folder (LRU beyond max_cpu_loras)."""
        with self._lock:
            adapter = self._weights.get(req.lora_int_id)
            if adapter is not None:
                self._weights.move_to_end(req.lora_int_id)
                return adapter
        adapter = load_adapter(req.name, Path(req.path), self.arch, self.config.max_lora_rank, self.dtype)
        with self._lock:
            self._cache(req.lora_int_id, adapter)
        return adapter

    def _cache(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        self._weights[lora_int_id] = adapter
        self._weights.move_to_end(lora_int_id)
        while len(self._weights) > self.config.cpu_capacity:
            self._weights.popitem(last=False)

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._weights)

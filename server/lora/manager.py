"""Wraps the served model's projections for LoRA and keeps up to `max_loras` adapters in weight slots.

Called by the model runner once per step (`prepare`), with each scheduled request's adapter and token
count: it puts every adapter of the step in a slot (least recently used slots are reused) and sets the
per-token slot index and the step's plan (dense or grouped by slot, see layers.py) that the wrapped
projections read. The scheduler guarantees at most `max_loras`
distinct adapters per step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from server.lora.adapter import LoRAAdapter, LoRAAdapterError
from server.lora.layers import LoRALinear, LoRAStepState
from server.lora.registry import LoRARegistry
from server.models.layers import MLP
from server.models.llama import LlamaForCausalLM
from server.request import LoRARequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAStepResult:
    errors: dict[str, str]  # request id -> why its adapter could not be used in this step


def wrap_model(
    model: LlamaForCausalLM, state: LoRAStepState, max_loras: int, device: torch.device, dtype: torch.dtype
) -> list[tuple[int, LoRALinear]]:
    """Replace every q/k/v/o/gate/up/down projection (fused or not) by a LoRALinear around it."""
    wrapped: list[tuple[int, LoRALinear]] = []

    def wrap(parent: nn.Module, attr: str, layer: int, subs: list[tuple[str, int]]) -> None:
        base = getattr(parent, attr)
        lin = LoRALinear(base, subs, state, max_loras, device, dtype)
        setattr(parent, attr, lin)
        wrapped.append((layer, lin))

    from server.lora.adapter import module_shapes

    shapes = module_shapes(model.config)
    for i, layer in enumerate(model.decoder_layers()):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None:
            wrap(attn, "qkv_proj", i, [(m, shapes[m][1]) for m in ("q_proj", "k_proj", "v_proj")])
        else:
            for m in ("q_proj", "k_proj", "v_proj"):
                wrap(attn, m, i, [(m, shapes[m][1])])
        wrap(attn, "o_proj", i, [("o_proj", shapes["o_proj"][1])])
        if not isinstance(mlp, MLP):
            continue  # a mixture-of-experts block: adapters for it are refused at load (lora/adapter.py)
        if mlp.gate_up_proj is not None:
            wrap(mlp, "gate_up_proj", i, [(m, shapes[m][1]) for m in ("gate_proj", "up_proj")])
        else:
            for m in ("gate_proj", "up_proj"):
                wrap(mlp, m, i, [(m, shapes[m][1])])
        wrap(mlp, "down_proj", i, [("down_proj", shapes["down_proj"][1])])
    return wrapped


class LoRAManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        registry: LoRARegistry,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.registry = registry
        self.max_loras = registry.config.max_loras
        self.state = LoRAStepState(max_rank=registry.config.max_lora_rank)
        self.state.use_kernels = device.type == "cuda"
        self.device = device
        self.dtype = dtype
        self.modules = wrap_model(model, self.state, self.max_loras, device, dtype)
        # slot -> lora_int_id, in least-recently-used order (first = next to reuse)
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(self.max_loras))

    @property
    def resident(self) -> list[int]:
        return list(self._slots.values())

    def slot_bytes(self) -> int:
        """Memory of one slot over all wrapped projections (what one resident adapter costs)."""
        return sum(m.slot_nbytes for _, m in self.modules)

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, mod in self.modules:
            per_sub = []
            for name, _ in mod.sub_modules:
                w = adapter.weights.get((layer, name))
                per_sub.append(None if w is None else (w.a, w.b))
            mod.set_slot(slot, per_sub)

    def _slot_for(self, lora: LoRARequest, needed: set[int]) -> int:
        for slot, lid in self._slots.items():
            if lid == lora.lora_int_id:
                self._slots.move_to_end(slot)
                return slot
        adapter = self.registry.weights(lora)  # may raise LoRAAdapterError
        if self._free_slots:
            slot = self._free_slots.pop(0)
        else:
            slot = next((s for s, lid in self._slots.items() if lid not in needed), -1)
            assert slot >= 0, "more distinct adapters in one step than max_loras"
            del self._slots[slot]
        self._load_slot(slot, adapter)
        self._slots[slot] = lora.lora_int_id
        return slot

    def prepare(self, rows: Sequence[tuple[str, LoRARequest | None, int]]) -> LoRAStepResult:
        """rows: (request id, adapter or None, number of tokens) in batch order. Sets the step state."""
        errors: dict[str, str] = {}
        needed = {lora.lora_int_id for _, lora, _ in rows if lora is not None}
        if not needed:
            self.state.set(None, self.dtype, self.device)
            return LoRAStepResult(errors)
        slot_of: dict[int, int] = {}
        token_slots: list[int] = []
        for rid, lora, n in rows:
            slot = -1
            if lora is not None:
                if lora.lora_int_id not in slot_of:
                    try:
                        slot_of[lora.lora_int_id] = self._slot_for(lora, needed)
                    except (LoRAAdapterError, OSError) as e:
                        log.error("LoRA adapter %s cannot be used: %s", lora.name, e)
                        slot_of[lora.lora_int_id] = -2
                slot = slot_of[lora.lora_int_id]
                if slot == -2:
                    errors[rid] = f"LoRA adapter {lora.name!r} could not be loaded"
                    slot = -1
            token_slots.extend([slot] * n)
        self.state.set(token_slots, self.dtype, self.device)
        return LoRAStepResult(errors)

"""Multi-LoRA serving: PEFT adapters on the base model's projections, mixed per token in one batch.

`adapter.py` reads and validates PEFT folders, `registry.py` names them and keeps weights (LRU),
`layers.py` wraps projections with stacked adapter slots, `manager.py` wraps the model and fills slots
per step. The engine owns the registry; the model runner calls `LoRAManager.prepare` once per step.
"""

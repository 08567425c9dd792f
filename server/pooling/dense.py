"""sentence-transformers' `Dense` modules after the pooling (EmbeddingGemma's 2_Dense and 3_Dense, LaBSE's
tanh projection): `activation(x @ W.T + b)` on the pooled vector, before `Normalize`. Source:
sentence_transformers' Dense module (`config.json`: in_features, out_features, bias,
activation_function as a torch.nn class path; weights `linear.weight` / `linear.bias` in
model.safetensors).

Shapes: `[batch, in_features]` float32 -> `[batch, out_features]` float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

# activation_function class paths (torch.nn) we run; sentence-transformers' default is Tanh
_ACTIVATIONS: dict[str, nn.Module] = {
    "torch.nn.modules.linear.Identity": nn.Identity(),
    "torch.nn.modules.activation.Tanh": nn.Tanh(),
    "torch.nn.modules.activation.ReLU": nn.ReLU(),
    "torch.nn.modules.activation.GELU": nn.GELU(),
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid(),
    "torch.nn.modules.activation.SiLU": nn.SiLU(),
}
_SENTENCE_EMBEDDING = "sentence_embedding"


@dataclass(frozen=True)
class DenseConfig:
    """One Dense module's config.json. Raises ValueError for what we do not run: another activation,
    a residual branch (`use_residual`), an input or output other than the pooled vector."""

    in_features: int
    out_features: int
    bias: bool
    activation: str

    @classmethod
    def from_file(cls, path: Path) -> DenseConfig:
        cfg = json.loads(path.read_text())
        act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"{path}: Dense activation_function {act!r} is not one of {sorted(_ACTIVATIONS)}"
            )
        if cfg.get("use_residual"):
            raise ValueError(f"{path}: Dense with use_residual is not supported")
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key, _SENTENCE_EMBEDDING) != _SENTENCE_EMBEDDING:
                raise ValueError(f"{path}: Dense {key} {cfg[key]!r}: only the pooled vector is supported")
        return cls(int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)), act)


class DenseStack(nn.Module):
    """The folder's Dense modules in modules.json order (`load_dense_stack`)."""

    def __init__(self, configs: list[DenseConfig]) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(c.in_features, c.out_features, bias=c.bias) for c in configs)
        self.activations = [_ACTIVATIONS[c.activation] for c in configs]

    @property
    def out_features(self) -> int:
        last = self.linears[-1]
        assert isinstance(last, nn.Linear)
        return last.out_features

    def forward(self, x: Tensor) -> Tensor:  # x: [batch, in_features] -> [batch, out_features]
        for linear, act in zip(self.linears, self.activations, strict=True):
            x = act(linear(x))
        return x


def load_dense_stack(folder: Path, paths: tuple[str, ...], in_features: int) -> DenseStack:
    """The Dense modules under `folder`/`paths` chained from the pooled `in_features`, in float32.
    ValueError: a config we do not run (DenseConfig), sizes that do not chain, weights missing or not
    in model.safetensors (a pickled pytorch_model.bin is not read)."""
    configs = [DenseConfig.from_file(folder / p / "config.json") for p in paths]
    width = in_features
    for p, c in zip(paths, configs, strict=True):
        if c.in_features != width:
            raise ValueError(f"{folder / p}: Dense in_features {c.in_features}, but its input has {width}")
        width = c.out_features
    stack = DenseStack(configs)
    for p, linear in zip(paths, stack.linears, strict=True):
        file = folder / p / "model.safetensors"
        if not file.is_file():
            raise ValueError(f"{folder / p}: Dense weights must be in model.safetensors")
        state = {k.removeprefix("linear."): v.float() for k, v in load_file(str(file)).items()}
        missing, unexpected = linear.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{file}: missing {missing}, unexpected {unexpected}")
    return stack.eval().requires_grad_(False).to(torch.float32)

"""Rotary position embeddings: inverse frequencies for every `RopeSpec` kind and their cos/sin tables.

Formulas as in transformers' modeling_rope_utils (the checkpoints' own definitions), written here:
`linear` (positions / factor), `llama3` (Llama 3.1's banded rescale), `yarn` (NTK-by-parts with a
ramp between beta_fast and beta_slow rotations and the 0.1 ln(s) + 1 attention factor), `longrope`
(Phi-3: per-channel short or long factors, attention factor sqrt(1 + ln(s) / ln(original))),
`dynamic` (dynamic NTK: equal to plain RoPE for sequences up to max_position_embeddings, which is
the only range served: `check_rope_servable`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from server.models.layer_spec import RopeSpec, UnsupportedModelError


def rope_inv_freq(
    spec: RopeSpec, max_positions: int, max_position_embeddings: int
) -> tuple[Tensor, float]:  # inv_freq [rotary_dim / 2] fp32, attention factor (cos/sin multiplier)
    """`max_positions`: the longest sequence served (max_model_len), which picks LongRoPE's factors;
    `max_position_embeddings`: config.json's, for the factors derived from it."""
    dim, base = spec.rotary_dim, spec.theta
    s = dict(spec.scaling or ())
    kind = spec.kind
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]
    inv_freq = 1.0 / (base**exponents)
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    original = int(s.get("original_max_position_embeddings") or max_position_embeddings)
    raw_factor = s.get("factor")
    factor = max_position_embeddings / original if raw_factor is None else float(raw_factor)
    if kind == "longrope":
        attention = s.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        key = "long_factor" if max_positions > original else "short_factor"
        ext = torch.tensor(s[key], dtype=torch.float32)
        if ext.shape != (dim // 2,):
            raise UnsupportedModelError(f"rope_scaling.{key} has {ext.numel()} values, expected {dim // 2}")
        return 1.0 / (ext * base**exponents), float(attention)
    assert kind == "yarn", kind  # RopeSpec validated the kind

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        ms, ms_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base**exponents
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def check_rope_servable(spec: RopeSpec, max_positions: int, max_position_embeddings: int) -> None:
    """Dynamic NTK changes every position's rotation once a sequence outgrows max_position_embeddings
    (transformers recomputes it per forward), which a KV cache of already-rotated keys cannot follow:
    refused beyond that length, exact below it."""
    if spec.kind == "dynamic" and max_positions > max_position_embeddings:
        raise UnsupportedModelError(
            f"rope_scaling type 'dynamic' is exact only up to max_position_embeddings "
            f"({max_position_embeddings}); set --max-model-len to at most that (asked: {max_positions})"
        )


class RotaryEmbedding(nn.Module):
    cos: Tensor  # [max_positions, rotary_dim] fp32
    sin: Tensor  # [max_positions, rotary_dim] fp32, first half negated (see apply_rotary)

    def __init__(self, spec: RopeSpec, max_positions: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.spec = spec
        inv_freq, attention = rope_inv_freq(spec, max_positions, max_position_embeddings)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, rotary_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions: [T] -> cos, sin: [T, 1, rotary_dim] in the activation dtype, once per step for all layers
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, R] (R <= D: the leading R channels rotate, Phi-3's partial rotary)
    # The reference computes x * cos + cat(-x2, x1) * sin; with the sign folded into `sin` the rotated
    # half is a plain roll, and q and k go through together: 3 ops per layer instead of 10, which
    # matters in decode steps where each op costs more in dispatch than in math.
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(r // 2, dims=-1), sin)
    rot = x[..., :r]
    return torch.cat((torch.addcmul(rot * cos, rot.roll(r // 2, dims=-1), sin), x[..., r:]), dim=-1)

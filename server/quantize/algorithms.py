"""AWQ (activation-aware scale search + clipping) and GPTQ (Hessian-based error-compensating rounding),
written after the AutoAWQ / AutoGPTQ algorithms, for our model's layer structure.

Both work on one decoder layer at a time with the calibration activations that reach it; weights are
nn.Linear layout [N, K] here and become Int4Weights ([K, N], the checkpoint layout) at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from server.models.llama import MLP, DecoderLayer
from server.quant.formats import MAXQ, Int4Weights, group_params, quantize_rtn, trivial_g_idx
from server.quantize.evaluation import SequenceRunner


def linear(layer: nn.Module, name: str) -> nn.Linear:
    """A projection of a decoder layer that is still a plain Linear (the quantizer works in full precision)."""
    lin = layer.get_submodule(name)
    if not isinstance(lin, nn.Linear):
        raise TypeError(f"{name} is a {type(lin).__name__}, not a full-precision Linear")
    return lin


def fake_quantize(weight: Tensor, group_size: int) -> Tensor:  # weight: [N, K] -> [N, K] dequantized
    """Asymmetric RTN exactly as the AWQ checkpoint will store it (fp16 scales), back in float."""
    n_dim, k_dim = weight.shape
    w = weight.float().reshape(n_dim, k_dim // group_size, group_size)
    p = group_params(w.amin(dim=2).t(), w.amax(dim=2).t(), sym=False)  # [K/G, N]
    s, z = p.scales.t()[:, :, None], p.zeros.t()[:, :, None].float()
    q = torch.round(w / s + z).clamp(0, MAXQ)
    return ((q - z) * s).reshape(n_dim, k_dim).to(weight.dtype)


# ------------------------------------------------------------------ AWQ


@dataclass(frozen=True)
class AwqOptions:
    group_size: int
    grid: int = 20  # scale exponents tried: 0, 1/grid, ..., (grid-1)/grid
    clip: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5
    clip_tokens: int = 64


def _search_scales(
    x: Tensor,  # [T, K] input of the linears
    linears: list[nn.Linear],
    block: Callable[[Tensor], Tensor],  # x -> output of the part of the layer the linears feed
    opts: AwqOptions,
) -> Tensor:  # [K] per-input-channel scales s: weights get * s, the op before them / s
    k_dim = x.shape[1]
    g = opts.group_size
    x_mean = x.abs().float().mean(dim=0)  # [K]
    w = torch.cat([lin.weight.detach() for lin in linears], dim=0).float()  # [sumN, K]
    wg = w.abs().reshape(-1, g)
    w_mean = (wg / wg.amax(dim=1, keepdim=True).clamp(min=1e-8)).reshape(w.shape).mean(dim=0)  # [K]
    originals = [lin.weight.detach().clone() for lin in linears]
    with torch.no_grad():
        ref = block(x).float()
        best_loss, best = math.inf, torch.ones(k_dim)
        for i in range(opts.grid):
            ratio = i / opts.grid
            s = (x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4)).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for lin, orig in zip(linears, originals, strict=True):
                lin.weight.copy_(fake_quantize(orig * s[None, :], g) / s[None, :])
            loss = float((block(x).float() - ref).pow(2).mean())
            if loss < best_loss:
                best_loss, best = loss, s.clone()
        for lin, orig in zip(linears, originals, strict=True):
            lin.weight.copy_(orig)
    return best


def _search_clip(x: Tensor, weight: Tensor, opts: AwqOptions) -> Tensor:
    """Per (output channel, group) clipping range minimising the group's output error: [N, K/G] max |w|."""
    g = opts.group_size
    n_dim, k_dim = weight.shape
    step = max(1, x.shape[0] // opts.clip_tokens)
    xs = x[::step][: opts.clip_tokens].float()  # [T', K]
    xg = xs.reshape(-1, k_dim // g, g).transpose(0, 1)  # [K/G, T', G]
    best_max = torch.empty(n_dim, k_dim // g)
    for n0 in range(0, n_dim, 256):
        w = weight[n0 : n0 + 256].float().reshape(-1, k_dim // g, g)  # [n, K/G, G]
        wt = w.permute(1, 2, 0)  # [K/G, G, n]
        ref = torch.bmm(xg, wt)  # [K/G, T', n]
        org_max = w.abs().amax(dim=2)  # [n, K/G]
        best_err = torch.full_like(org_max, math.inf)
        chunk_best = org_max.clone()
        for i in range(int(opts.clip_max_shrink * opts.clip_grid)):
            max_val = org_max * (1 - i / opts.clip_grid)
            clipped = torch.maximum(torch.minimum(w, max_val[:, :, None]), -max_val[:, :, None])
            q = fake_quantize(clipped.reshape(-1, k_dim), g).reshape(w.shape)
            err = (torch.bmm(xg, q.permute(1, 2, 0)) - ref).pow(2).mean(dim=1).t()  # [n, K/G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            chunk_best = torch.where(better, max_val, chunk_best)
        best_max[n0 : n0 + 256] = chunk_best
    return best_max


@torch.no_grad()
def _apply_clip(lin: nn.Linear, max_val: Tensor, group_size: int) -> None:  # max_val: [N, K/G]
    n_dim, k_dim = lin.weight.shape
    w = lin.weight.reshape(n_dim, k_dim // group_size, group_size)
    m = max_val[:, :, None].to(w.dtype)
    lin.weight.copy_(torch.maximum(torch.minimum(w, m), -m).reshape(n_dim, k_dim))


def awq_layer(
    runner: SequenceRunner, layer: DecoderLayer, h: Tensor, opts: AwqOptions
) -> dict[str, Int4Weights]:
    """Scales folded into the norms / previous projections, clipping applied, then 4-bit RTN of the result."""
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(mlp, MLP)  # calibration runs the Llama layer only (quantize_model checks)
    captured: dict[str, Tensor] = {}

    def grab(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[Tensor, ...]) -> None:
            captured[name] = args[0].detach()

        return hook

    with torch.no_grad():
        handles = [
            attn.o_proj.register_forward_pre_hook(grab("o")),
            mlp.down_proj.register_forward_pre_hook(grab("down")),
        ]
        x_attn = layer.input_layernorm(h)
        attn_out = runner.attention(layer, x_attn)
        x_mlp = layer.post_attention_layernorm(h + attn_out)
        mlp(x_mlp)
        for handle in handles:
            handle.remove()

        # 1. input_layernorm -> q, k, v, judged on the attention output.
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        s = _search_scales(x_attn, qkv, lambda x: runner.attention(layer, x), opts)
        layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
        for lin in qkv:
            lin.weight.mul_(s[None, :].to(lin.weight.dtype))
        # 2. v -> o, only when v's outputs are o's inputs one to one (no grouped-query sharing).
        if attn.v_proj.out_features == attn.o_proj.in_features:
            s = _search_scales(captured["o"], [attn.o_proj], attn.o_proj, opts)
            attn.v_proj.weight.div_(s[:, None].to(attn.v_proj.weight.dtype))
            if attn.v_proj.bias is not None:
                attn.v_proj.bias.div_(s.to(attn.v_proj.bias.dtype))
            attn.o_proj.weight.mul_(s[None, :].to(attn.o_proj.weight.dtype))
        # 3. post_attention_layernorm -> gate, up, judged on the MLP output.
        s = _search_scales(x_mlp, [mlp.gate_proj, mlp.up_proj], mlp, opts)
        layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
        for lin in (mlp.gate_proj, mlp.up_proj):
            lin.weight.mul_(s[None, :].to(lin.weight.dtype))
        # 4. up -> down.
        s = _search_scales(captured["down"], [mlp.down_proj], mlp.down_proj, opts)
        mlp.up_proj.weight.div_(s[:, None].to(mlp.up_proj.weight.dtype))
        mlp.down_proj.weight.mul_(s[None, :].to(mlp.down_proj.weight.dtype))

        # Clipping sees the inputs after scaling (AutoAWQ skips q and k: their error is amplified by softmax).
        x_attn = layer.input_layernorm(h)
        handles = [
            attn.o_proj.register_forward_pre_hook(grab("o")),
            mlp.down_proj.register_forward_pre_hook(grab("down")),
        ]
        attn_out = runner.attention(layer, x_attn)
        x_mlp = layer.post_attention_layernorm(h + attn_out)
        mlp(x_mlp)
        for handle in handles:
            handle.remove()
        inputs = {
            "self_attn.v_proj": x_attn,
            "self_attn.o_proj": captured["o"],
            "mlp.gate_proj": x_mlp,
            "mlp.up_proj": x_mlp,
            "mlp.down_proj": captured["down"],
        }
        if opts.clip:
            for name, x in inputs.items():
                lin = linear(layer, name)
                _apply_clip(lin, _search_clip(x, lin.weight.detach(), opts), opts.group_size)

    return {name: quantize_rtn(linear(layer, name).weight.detach(), opts.group_size) for name in _PROJ}


_PROJ = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def rtn_layer(layer: DecoderLayer, group_size: int) -> dict[str, Int4Weights]:
    return {name: quantize_rtn(linear(layer, name).weight.detach(), group_size) for name in _PROJ}


# ------------------------------------------------------------------ GPTQ


@dataclass(frozen=True)
class GptqOptions:
    group_size: int
    sym: bool = True
    act_order: bool = False
    damp_percent: float = 0.01


def gptq_quantize_weight(
    weight: Tensor,  # [N, K] float
    hessian: Tensor,  # [K, K] fp32, 2/T * X^T X of the calibration inputs
    opts: GptqOptions,
) -> Int4Weights:
    """One GPTQ pass: columns quantized in (act-)order, each one's rounding error pushed onto the columns
    not yet quantized through the inverse Hessian's Cholesky factor."""
    g = opts.group_size
    w = weight.detach().float().clone()
    n_dim, k_dim = w.shape
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if opts.act_order else torch.arange(k_dim)
    w = w[:, perm]
    h = h[perm][:, perm]
    h += opts.damp_percent * torch.mean(torch.diag(h)) * torch.eye(k_dim)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    # The column loop runs ~100k times per model: numpy's per-call overhead is a fraction of torch's.
    # Rows of `wt` are the weight's columns (input channels), so each step touches contiguous memory.
    wt = w.t().contiguous().numpy()  # [K, N]
    hinv_np = hinv.numpy()
    q_all = np.zeros((k_dim, n_dim), dtype=np.float32)  # integer values, kept in float until the end
    scales = torch.zeros(k_dim // g, n_dim)
    zeros = torch.zeros(k_dim // g, n_dim, dtype=torch.int32)
    # A block holds whole groups, so each group's parameters come from its error-updated weights.
    block = g * max(1, 64 // g)
    min_zero = 0 if opts.sym else 1  # GPTQ v1 cannot store a zero of 0 (see formats.gptq_encode)
    for i1 in range(0, k_dim, block):
        i2 = min(i1 + block, k_dim)
        w1 = wt[i1:i2].copy()  # [B, N]
        err1 = np.zeros_like(w1)
        h1 = hinv_np[i1:i2, i1:i2]
        scale = zero = np.empty(0, dtype=np.float32)
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                grp = torch.from_numpy(w1[i : i + g])
                p = group_params(grp.amin(dim=0), grp.amax(dim=0), opts.sym, min_zero)
                scales[col // g], zeros[col // g] = p.scales, p.zeros
                scale, zero = p.scales.numpy(), p.zeros.float().numpy()
            wc = w1[i]
            qc = np.clip(np.round(wc / scale) + zero, 0, MAXQ)
            q_all[col] = qc
            e = (wc - (qc - zero) * scale) / h1[i, i]
            # The error of this column, spread over the block's remaining columns (rank-1 update).
            w1[i:] -= np.outer(h1[i, i:], e)
            err1[i] = e
        wt[i2:] -= hinv_np[i1:i2, i2:].T @ err1
    q_int = torch.from_numpy(q_all).to(torch.int32).t()  # [N, K]

    invperm = torch.argsort(perm)
    g_idx = trivial_g_idx(k_dim, g)[invperm]  # group of original channel c = its position in the order // G
    return Int4Weights(
        intweight=q_int[:, invperm].t().contiguous(),
        zeros=zeros,
        scales=scales.half(),
        g_idx=g_idx.to(torch.int32),
        group_size=g,
    )


def _hessian(x: Tensor) -> Tensor:  # x: [T, K] -> [K, K]
    xf = x.float()
    return 2.0 / xf.shape[0] * (xf.t() @ xf)


@torch.no_grad()
def _set_dequantized(lin: nn.Linear, q: Int4Weights) -> None:
    from server.quant.formats import dequantize

    lin.weight.copy_(dequantize(q).t().to(lin.weight.dtype))


def gptq_layer(
    runner: SequenceRunner, layer: DecoderLayer, h: Tensor, opts: GptqOptions
) -> dict[str, Int4Weights]:
    """True-sequential GPTQ: each sub-block's inputs come from the already quantized sub-blocks before it."""
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(mlp, MLP)  # calibration runs the Llama layer only (quantize_model checks)
    out: dict[str, Int4Weights] = {}
    captured: dict[str, Tensor] = {}

    def grab(_m: nn.Module, args: tuple[Tensor, ...]) -> None:
        captured["x"] = args[0].detach()

    with torch.no_grad():
        x_attn = layer.input_layernorm(h)
        _gptq_shared(
            layer, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), _hessian(x_attn), opts, out
        )
        handle = attn.o_proj.register_forward_pre_hook(grab)
        runner.attention(layer, x_attn)
        handle.remove()
        _gptq_shared(layer, ("self_attn.o_proj",), _hessian(captured["x"]), opts, out)
        x_mlp = layer.post_attention_layernorm(h + runner.attention(layer, x_attn))
        _gptq_shared(layer, ("mlp.gate_proj", "mlp.up_proj"), _hessian(x_mlp), opts, out)
        x_down = F.silu(mlp.gate_proj(x_mlp)) * mlp.up_proj(x_mlp)
        _gptq_shared(layer, ("mlp.down_proj",), _hessian(x_down), opts, out)
    return out


def _gptq_shared(
    layer: DecoderLayer,
    names: tuple[str, ...],
    hessian: Tensor,
    opts: GptqOptions,
    out: dict[str, Int4Weights],
) -> None:
    """Linears reading the same input share the Hessian, and GPTQ treats output rows independently, so one
    pass over their stacked rows is the same as one pass each, at a fraction of the per-column overhead."""
    lins = [linear(layer, n) for n in names]
    stacked = gptq_quantize_weight(torch.cat([lin.weight for lin in lins], dim=0), hessian, opts)
    n0 = 0
    for name, lin in zip(names, lins, strict=True):
        n1 = n0 + lin.out_features
        q = Int4Weights(
            intweight=stacked.intweight[:, n0:n1].contiguous(),
            zeros=stacked.zeros[:, n0:n1].contiguous(),
            scales=stacked.scales[:, n0:n1].contiguous(),
            g_idx=stacked.g_idx.clone(),  # each checkpoint tensor owns its storage (safetensors refuses shared ones)
            group_size=stacked.group_size,
        )
        out[name] = q
        _set_dequantized(lin, q)
        n0 = n1

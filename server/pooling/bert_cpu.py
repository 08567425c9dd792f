"""BERT encoder layers for fp32 on the CPU: fewer, fused oneDNN calls per layer, the same arithmetic.

A 6-layer MiniLM at small batch is dispatch-bound: our `BertLayer` runs ~15 torch ops per layer (three
projections, an output projection, an add, a LayerNorm, a feed-forward matmul, GELU, another matmul, an
add, a LayerNorm, head reshapes). `CpuBertLayer` runs 7: one fused Q/K/V projection, attention, the
output projection with its residual add fused (oneDNN binary post-op), LayerNorm, the first
feed-forward projection with its GELU fused (oneDNN eltwise post-op, exact erf or tanh as the config
says), the second with its residual add, LayerNorm. Every projection's weight is pre-packed once into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, as `models/serving_weights.py`
does for decoders), so no matmul re-lays its weight out per call. Attention gets no mask when the batch
has no padding (one text, or texts of one length), which lets SDPA take its unmasked path.

`--dtype bfloat16` (and `auto` for an embedder on a CPU with native bf16, model.auto_gemm_dtype) packs
the weights in bf16 and rounds each GEMM's input to bf16 (AVX512-BF16: 1.3x-2x the fp32 GEMM rate
measured here), with
everything else in fp32 as `quant/gemm_dtype.py` does for decoders; all-MiniLM-L6-v2 keeps cosine >=
0.99997 against sentence-transformers' fp32 on the test texts.

Same weights and operations as `bert.BertLayer`; results differ only by summation order (~1e-6
relative; tests/pooling/test_pooling_model.py holds the model to sentence-transformers at cosine >=
0.9999). Source of the fused ops: PyTorch's `mkldnn::_linear_pointwise` (aten/src/ATen/native/mkldnn/
Linear.cpp), the ops Inductor's CPU backend emits for the same fusions.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from .bert import BertConfig, BertLayer, BertModel, _Packing

# hidden_act -> oneDNN eltwise post-op (attr, algorithm) of _linear_pointwise
_POST_OPS = {
    "gelu": ("gelu", "none"),  # exact erf
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
}


_LINEAR = torch.ops.mkldnn._linear_pointwise


def cpu_layers_supported(module: nn.Module, dtype: torch.dtype) -> bool:
    """fp32 weights on the CPU with oneDNN available (the packed layout is fp32-only here)."""
    p = next(module.parameters())
    return dtype == torch.float32 and p.device.type == "cpu" and torch.backends.mkldnn.is_available()


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


@functools.cache
def bf16_packing_supported() -> bool:
    """Whether oneDNN packs bf16 linear weights on this CPU: it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT and
    raises RuntimeError without them (seen on an AVX2-only AMD EPYC)."""
    try:
        _pack(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


class CpuBertLayer(nn.Module):
    """One `BertLayer`'s weights, fused and pre-packed: `forward(x, packing)` as BertLayer's
    (x `[tokens, hidden]` packed, or `[batch, seq, hidden]` without padding when `packing` is None)."""

    def __init__(self, layer: BertLayer, c: BertConfig, gemm_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if gemm_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the encoder's GEMMs run in float32 or bfloat16, not {gemm_dtype}")
        att = layer.attention
        sa = att.self
        self.num_heads = c.num_attention_heads
        self.hidden = c.hidden_size
        self.gemm_dtype = gemm_dtype
        g = gemm_dtype
        self.qkv_w = _pack(torch.cat([sa.query.weight, sa.key.weight, sa.value.weight]).to(g))
        self.qkv_b = torch.cat([sa.query.bias, sa.key.bias, sa.value.bias]).detach().to(g)
        self.o_w = _pack(att.output.dense.weight.to(g))
        self.o_b = att.output.dense.bias.detach().to(g)
        self.ln1 = att.output.LayerNorm
        self.ffn1_w = _pack(layer.intermediate.dense.weight.to(g))
        self.ffn1_b = layer.intermediate.dense.bias.detach().to(g)
        self.act, self.act_algorithm = _POST_OPS[c.hidden_act]
        self.ffn2_w = _pack(layer.output.dense.weight.to(g))
        self.ffn2_b = layer.output.dense.bias.detach().to(g)
        self.ln2 = layer.output.LayerNorm

    def forward(self, x: Tensor, packing: _Packing | None) -> Tensor:
        if self.gemm_dtype == torch.bfloat16:
            return self._forward_bf16(x, packing)
        shape = x.shape
        flat = x.reshape(-1, self.hidden)  # [T, H]; packed inputs already are
        # explicit overloads: resolving the packet would try `other` as the default overload's scalars
        linear, linear_add = _LINEAR.default, _LINEAR.binary
        qkv = linear(flat, self.qkv_w, self.qkv_b, "none", [], "")  # [T, 3H]
        a = self._attention(qkv, shape, x.dim(), packing)
        h = self.ln1(linear_add(a, flat, self.o_w, self.o_b, "add"))
        f = linear(h, self.ffn1_w, self.ffn1_b, self.act, [], self.act_algorithm)
        out = self.ln2(linear_add(f, h, self.ffn2_w, self.ffn2_b, "add"))
        return out.view(shape)

    def _forward_bf16(self, x: Tensor, packing: _Packing | None) -> Tensor:
        """GEMM inputs rounded to bf16, oneDNN accumulating in fp32; the residual stream, LayerNorm and
        attention stay fp32 (the feed-forward's activation stays bf16: it only feeds the next GEMM)."""
        shape = x.shape
        flat = x.reshape(-1, self.hidden)
        linear, bf16 = _LINEAR.default, torch.bfloat16
        qkv = linear(flat.to(bf16), self.qkv_w, self.qkv_b, "none", [], "").float()
        a = self._attention(qkv, shape, x.dim(), packing)
        h = self.ln1(linear(a.to(bf16), self.o_w, self.o_b, "none", [], "").float() + flat)
        f = linear(h.to(bf16), self.ffn1_w, self.ffn1_b, self.act, [], self.act_algorithm)
        out = self.ln2(linear(f, self.ffn2_w, self.ffn2_b, "none", [], "").float() + h)
        return out.view(shape)

    def _attention(self, qkv: Tensor, shape: torch.Size, dims: int, packing: _Packing | None) -> Tensor:
        """qkv `[T, 3H]` fp32 -> attention output `[T, H]` (packed rows, attention within each row, when
        `packing` is given: bert._Packing.attend)."""
        if packing is not None:
            return packing.attend(qkv, self.num_heads)
        b, s = (shape[0], shape[1]) if dims == 3 else (1, shape[0])
        hd = self.hidden // self.num_heads
        q, k, v = qkv.view(b, s, 3, self.num_heads, hd).permute(2, 0, 3, 1, 4).unbind(0)  # [b, nh, s, hd]
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        return a.transpose(1, 2).reshape(b * s, self.hidden)


def use_cpu_layers(model: BertModel, gemm_dtype: torch.dtype = torch.float32) -> int:
    """Replaces the encoder's layers with `CpuBertLayer`s in place, their GEMMs in `gemm_dtype`
    (float32, or bfloat16 for `--dtype bfloat16`); returns how many. The original layers' weights are
    not kept (the packed copies replace them). Raises ValueError for another gemm_dtype, and for bfloat16
    on a CPU where oneDNN cannot pack bf16 weights (`bf16_packing_supported`)."""
    if gemm_dtype == torch.bfloat16 and not bf16_packing_supported():
        raise ValueError(
            "--dtype bfloat16: this CPU cannot run oneDNN's packed bf16 GEMMs (they need AVX512-BW/VL/DQ or "
            "AVX-NE-CONVERT); use --dtype auto or float32"
        )
    layers = model.encoder.layer
    for i, layer in enumerate(layers):
        assert isinstance(layer, BertLayer)
        layers[i] = CpuBertLayer(layer, model.config, gemm_dtype)
    return len(layers)

"""Triton kernels for the GPU path: paged attention, KV-cache store, weight-only quantized GEMMs, LoRA shrink/expand,
the mixture-of-experts grouped GEMM.

Plain-torch twins and the AWQ/GPTQ/fp8 packing helpers live in `kubeinfer_kernels.reference`.

Triton decides at kernel *definition* time whether to compile for a GPU or to interpret on CPU
(TRITON_INTERPRET=1). Without CUDA there is no driver to compile for, so importing this package on
such a machine turns the interpreter on (unless TRITON_INTERPRET is already set): the kernels then
run, slowly, on CPU tensors, which is what the tests and the CPU parity checks rely on.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kubeinfer_kernels.attention_decode import paged_attention_decode
from kubeinfer_kernels.attention_prefill import paged_prefill_attention
from kubeinfer_kernels.fused_moe import fused_moe, moe_align_block_size
from kubeinfer_kernels.gemm_fp8 import fp8_gemm
from kubeinfer_kernels.gemm_int4 import int4_gemm
from kubeinfer_kernels.kv_store import store_kv_cache
from kubeinfer_kernels.lora import lora_expand, lora_shrink

__all__ = [
    "fp8_gemm",
    "fused_moe",
    "int4_gemm",
    "lora_expand",
    "lora_shrink",
    "moe_align_block_size",
    "paged_attention_decode",
    "paged_prefill_attention",
    "store_kv_cache",
]

"""benchmarks/prefill_ceiling.py's work count (issue 49 item 3's prefill fraction): a dense model's prefill
FLOPs, against torch's own FLOP counter over transformers' Llama at the same shape."""

from __future__ import annotations

import torch
from benchmark_modules import load_benchmark


def test_prefill_flop_is_the_models_matmul_work_with_causal_attention() -> None:
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from server.models.registry import arch_from_hf

    hf = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        attn_implementation="eager",  # attention as two matmuls the counter sees (full T x T, no causal skip)
    )
    arch = arch_from_hf(hf.to_dict())
    model = LlamaForCausalLM(hf).eval()
    t = 24
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.arange(t)[None], logits_to_keep=1)  # the LM head for the last token only, as we serve
    full_attention = 2 * 2 * t * t * 4 * 16 * 3  # QK^T and PV over all T x T pairs, 3 layers
    causal_attention = 2 * 2 * t * (t + 1) // 2 * 4 * 16 * 3
    want = counter.get_total_flops() - full_attention + causal_attention
    assert load_benchmark("prefill_ceiling.py").prefill_flop(arch, t) == want

"""Random-weight models in the exact shapes of the models users serve (issue 49 item 1), as Hugging Face
folders (bf16 safetensors, config.json, tokenizer), so ours and the peers (vLLM, llama.cpp after a GGUF
conversion) serve the same weights. Nothing is downloaded. Prints JSON (folder, parameters, bytes,
seconds per model).

    python benchmarks/real_shape_models.py [--models llama-3.2-1b qwen3-4b qwen3-moe-2b]
        [--out ~/.cache/kubeinfer/real-shapes]

Shapes (config.json values of the public models; the checkpoints' tensor names):
- llama-3.2-1b: Llama-3.2-1B (16 layers, hidden 2048, 32 heads / 8 KV heads of 64, MLP 8192, vocab
  128,256 tied, llama3 RoPE scaling): 1.24B parameters.
- qwen3-4b: Qwen3-4B (36 layers, hidden 2560, 32 / 8 heads of 128 with q/k RMSNorm, MLP 9728, vocab
  151,936 tied): 4.02B.
- qwen3-moe-2b: a Qwen3-MoE with Qwen3-30B-A3B's layer shapes (hidden 2048, 32 / 4 heads of 128,
  experts of 768, 8 routed per token, normalized top-k) but 16 of its 48 layers and 16 of its 128
  experts, vocab 151,936 untied: 2.10B total, 0.85B active per token.

The tokenizer is the embedded SmolLM2's (49,152 tokens; no download). The embedding and LM-head rows of
the ids beyond it are zero: those ids never come in, and greedy decoding never picks them (their logit 0
is below the largest of 49,152 random logits), so every id that comes out decodes, while every matmul
keeps the real shape. Weights ~ N(0, 0.02) (norms 1), written shard by shard (at most 2 GB in memory).

Our server serves the two dense shapes; it refuses the MoE one (no architecture module serves a MoE
block yet: docs/design.md, "Mixture of experts"), which vLLM serves. GGUF files of these shapes (Q8_0,
Q4_K_M) for llama.cpp are not written yet (issue 49 item 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from safetensors.torch import save_file

TOKENIZER_TOKENS = 49152  # the embedded SmolLM2's vocabulary
SHARD_BYTES = 2 << 30

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "mlp_bias": False,
    },
    "qwen3-4b": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
    },
    "qwen3-moe-2b": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 16,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
    },
}


def tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor, in the public checkpoints' names."""
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            yield p + "self_attn.q_norm.weight", (d,)
            yield p + "self_attn.k_norm.weight", (d,)
        if cfg["model_type"] == "qwen3_moe":
            e, m = cfg["num_experts"], cfg["moe_intermediate_size"]
            yield p + "mlp.gate.weight", (e, h)
            for j in range(e):
                yield p + f"mlp.experts.{j}.gate_proj.weight", (m, h)
                yield p + f"mlp.experts.{j}.up_proj.weight", (m, h)
                yield p + f"mlp.experts.{j}.down_proj.weight", (h, m)
        else:
            m = cfg["intermediate_size"]
            yield p + "mlp.gate_proj.weight", (m, h)
            yield p + "mlp.up_proj.weight", (m, h)
            yield p + "mlp.down_proj.weight", (h, m)
    yield "model.norm.weight", (h,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (v, h)


def _tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(torch.bfloat16)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        t[TOKENIZER_TOKENS:] = 0  # ids the tokenizer has not: never in, never picked (module docstring)
    return t


def make_hf_folder(name: str, out: Path, seed: int = 0) -> dict[str, Any]:
    """Writes SHAPES[name] as a Hugging Face folder under out/name; returns what it wrote."""
    from server.models.loader import resolve_model

    cfg = SHAPES[name]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files, params, total = 0, 0, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, files
        if shard:
            files += 1
            fname = f"model-{files:05d}.safetensors"
            save_file(shard, str(folder / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            shard, shard_bytes = {}, 0

    for tname, shape in tensor_shapes(cfg):
        t = _tensor(tname, shape, gen)
        if shard_bytes + t.nbytes > SHARD_BYTES:
            flush()
        shard[tname] = t
        shard_bytes += t.nbytes
        params += t.numel()
        total += t.nbytes
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    embedded = resolve_model(None).folder
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded / f).is_file():
            shutil.copy(embedded / f, folder / f)
    return {
        "model": name,
        "folder": str(folder),
        "parameters": params,
        "bytes": total,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "kubeinfer" / "real-shapes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    made = []
    for name in args.models:
        made.append(make_hf_folder(name, args.out, args.seed))
        print(json.dumps(made[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"made": made}, indent=2))


if __name__ == "__main__":
    main()

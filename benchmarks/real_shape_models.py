"""Random-weight models in the exact shapes of the models users serve (issues 44 item 6, 47 item 6, 49
item 1), as Hugging Face folders (bf16 safetensors, config.json, tokenizer) and GGUF files made from them
the way users make them, so ours and the peers (vLLM on the folder, llama.cpp on the GGUF) serve the same
weights. Nothing is downloaded. Prints JSON (folder, parameters, bytes, seconds per step and model).

    python benchmarks/real_shape_models.py [--models gemma-3-1b phi-4-mini llama-3.2-1b qwen3-moe-2b]
        [--out ~/.cache/kubeinfer/real-shapes] [--gguf Q4_K_M Q8_0] [--reuse]

Shapes (config.json values of the public models; the checkpoints' tensor names):
- gemma-3-1b: Gemma-3-1B (Gemma3ForCausalLM text: 26 layers, hidden 1152, 4 heads / 1 KV head of 256,
  MLP 6912 GeGLU, q/k norms, sliding windows of 512 on five layers of every six, vocab 262,144 tied):
  999.9M parameters.
- phi-4-mini: Phi-4-mini-instruct (32 layers, hidden 3072, 24 / 8 heads of 128 with 3/4 rotated,
  LongRoPE, fused qkv and gate_up, MLP 8192, vocab 200,064 tied): 3.84B.
- llama-3.2-1b: Llama-3.2-1B (16 layers, hidden 2048, 32 heads / 8 KV heads of 64, MLP 8192, vocab
  128,256 tied, llama3 RoPE scaling): 1.24B parameters.
- qwen3-4b: Qwen3-4B (36 layers, hidden 2560, 32 / 8 heads of 128 with q/k RMSNorm, MLP 9728, vocab
  151,936 tied): 4.02B.
- qwen3-moe-2b: the MoE of at most 3B total (issue 47 item 6): a Qwen3-MoE with Qwen3-30B-A3B's layer
  shapes (hidden 2048, 32 / 4 heads of 128, experts of 768, 8 routed per token, normalized top-k) but 16
  of its 48 layers and 16 of its 128 experts, vocab 151,936 untied: 2.10B total, 0.85B active per token.

The tokenizer is the embedded SmolLM2's (49,152 tokens, declared `GPT2Tokenizer`; no download). The
embedding and LM-head rows of the ids beyond it are zero: those ids never come in, and greedy decoding
never picks them (their logit 0 is below the largest of 49,152 random logits), so every id that comes out
decodes, while every matmul keeps the real shape. Gemma 3's vocabulary is padded with `<unusedN>` entries
to its 262,144 (`_write_tokenizer`: else llama.cpp's converter would cut the embedding). Weights ~ N(0, 0.02),
norms the identity, written shard by shard (at most 2 GB in memory).

GGUF (`--gguf`, default Q4_K_M and Q8_0; `--gguf` alone: none): llama.cpp's own `convert_hf_to_gguf.py`
to bf16, then its `llama-quantize` (built in llama.cpp's `build/` as the peers' setup builds
llama-server: `cmake --build build --target llama-quantize`), written as `<folder>/<name>-<TYPE>.gguf`;
the bf16 intermediate is deleted unless `--keep-bf16-gguf`. The converter runs under the peers' vLLM
environment's python (`--convert-python`), which has the sentencepiece it imports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
DEFAULT_OUT = Path.home() / ".cache" / "kubeinfer" / "real-shapes"

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
    "smollm2-135m": {
        # the embedded SmolLM2-135M-Instruct's shape: the tests' stand-in for it where its package is
        # absent (the device machine, benchmarks/gpu_session.sh), and the size of the earlier benchmarks
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "pad_token_id": 2,
        "mlp_bias": False,
    },
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
    "gemma-3-1b": {
        # google/gemma-3-1b-pt's config.json (transformers' gemma3_text); layer_types spelled out as the
        # hub's current config does: five sliding layers of 512, then one global, 26 layers.
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 262144,
    },
    "phi-4-mini": {
        # microsoft/Phi-4-mini-instruct's config.json: fused qkv and gate_up, 3/4 of each head rotated,
        # LongRoPE (48 factors per list; the long list here is a smooth ramp, not the published values:
        # the same arithmetic), a 262,144 window that never binds (so no layer is windowed).
        **_COMMON,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "full_attn_mod": 1,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "interpolate_factor": 1,
        "lm_head_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "num_attention_heads": 24,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "partial_rotary_factor": 0.75,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 48,
            "long_factor": [round(1.0 + 47.0 * (i / 47) ** 2, 4) for i in range(48)],
        },
        "sliding_window": 262144,
        "tie_word_embeddings": True,
        "vocab_size": 200064,
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


# what a run with no --models makes: the users' sizes (smollm2-135m is made where it is asked for)
DEFAULT_MODELS = tuple(name for name in SHAPES if name != "smollm2-135m")


def tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor, in the public checkpoints' names."""
    h, v, mt = cfg["hidden_size"], cfg["vocab_size"], cfg["model_type"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        if mt == "gemma3_text":
            yield p + "pre_feedforward_layernorm.weight", (h,)
            yield p + "post_feedforward_layernorm.weight", (h,)
        if mt == "phi3":
            yield p + "self_attn.qkv_proj.weight", (q + 2 * kv, h)
        else:
            yield p + "self_attn.q_proj.weight", (q, h)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
            yield p + "self_attn.q_norm.weight", (d,)
            yield p + "self_attn.k_norm.weight", (d,)
        if mt == "qwen3_moe":
            e, m = cfg["num_experts"], cfg["moe_intermediate_size"]
            yield p + "mlp.gate.weight", (e, h)
            for j in range(e):
                yield p + f"mlp.experts.{j}.gate_proj.weight", (m, h)
                yield p + f"mlp.experts.{j}.up_proj.weight", (m, h)
                yield p + f"mlp.experts.{j}.down_proj.weight", (h, m)
        elif mt == "phi3":
            m = cfg["intermediate_size"]
            yield p + "mlp.gate_up_proj.weight", (2 * m, h)
            yield p + "mlp.down_proj.weight", (h, m)
        else:
            m = cfg["intermediate_size"]
            yield p + "mlp.gate_proj.weight", (m, h)
            yield p + "mlp.up_proj.weight", (m, h)
            yield p + "mlp.down_proj.weight", (h, m)
    yield "model.norm.weight", (h,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (v, h)


def _tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, norm_offset: bool) -> torch.Tensor:
    if len(shape) == 1:
        # Gemma's RMSNorm scales by (1 + w): w = 0 is the same identity scale as w = 1 elsewhere
        return (torch.zeros if norm_offset else torch.ones)(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(torch.bfloat16)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        t[TOKENIZER_TOKENS:] = 0  # ids the tokenizer has not: never in, never picked (module docstring)
    return t


def _write_tokenizer(src: Path, folder: Path, cfg: dict[str, Any]) -> None:
    """The embedded tokenizer, declared as the GPT-2 BPE it is (`GPT2Tokenizer`, what Phi-4-mini's folder
    says and what llama.cpp's Phi-3 converter needs to take the BPE path). For Gemma 3 the BPE vocabulary
    is padded with `<unusedN>` entries up to `vocab_size`: llama.cpp's converter cuts Gemma 3's embedding
    to the tokenizer's size, which would shrink the tied LM head from 262,144 rows to 49,152 and the
    GGUF's decode work by a quarter. Plain vocabulary entries that no merge produces: never emitted by
    encoding, and held as compactly as a real 262k vocabulary (as added tokens they cost a tokenizers
    process ~500 MB of matching tables, which would inflate every Python server's resident memory)."""
    tok = json.loads((src / "tokenizer.json").read_text())
    if cfg["model_type"] == "gemma3_text":
        vocab = tok["model"]["vocab"]
        have = len(vocab)
        taken = {t["id"] for t in tok["added_tokens"]} | set(vocab.values())
        assert len(taken) == have, "the embedded tokenizer's added tokens are inside its vocabulary"
        vocab.update({f"<unused{i - have}>": i for i in range(have, cfg["vocab_size"])})
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "GPT2Tokenizer"
    for k in ("backend", "is_local", "local_files_only"):
        tc.pop(k, None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=1, ensure_ascii=False))
    if (src / "chat_template.jinja").is_file():
        shutil.copy(src / "chat_template.jinja", folder / "chat_template.jinja")


def make_hf_folder(name: str, out: Path, seed: int = 0, tokenizer_from: Path | None = None) -> dict[str, Any]:
    """Writes SHAPES[name] as a Hugging Face folder under out/name; returns what it wrote. `tokenizer_from`:
    a folder with the embedded SmolLM2's tokenizer files (None: the embedded model's own folder)."""
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
        t = _tensor(tname, shape, gen, cfg["model_type"] == "gemma3_text")
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
    _write_tokenizer(tokenizer_from or resolve_model(None).folder, folder, cfg)
    return {
        "model": name,
        "folder": str(folder),
        "parameters": params,
        "bytes": total,
        "seconds": round(time.perf_counter() - t0, 1),
    }


DEFAULT_LLAMA_CPP = (
    Path.home() / ".cache" / "kubeinfer-peers" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
)
GGUF_TYPES = ("Q4_K_M", "Q8_0")
# llama.cpp's converter needs sentencepiece (imported before it looks for a tokenizer.model), which our
# environment does not carry; the peers' vLLM environment has it with torch and transformers.
_PEERS_PY = Path.home() / ".cache" / "kubeinfer-peers" / "venv-vllm" / "bin" / "python"
DEFAULT_CONVERT_PYTHON = _PEERS_PY if _PEERS_PY.is_file() else Path(sys.executable)


def gguf_path(folder: Path, qtype: str) -> Path:
    """Where make_gguf writes `folder`'s GGUF of `qtype` (llama.cpp's ftype name, e.g. Q4_K_M)."""
    return folder / f"{folder.name}-{qtype}.gguf"


def _run(cmd: list[str], env: dict[str, str] | None) -> None:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if r.returncode:
        raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout[-2000:], r.stderr[-4000:])


def make_gguf(
    folder: Path, qtypes: list[str], llama_cpp: Path, python: Path, keep_bf16: bool = False
) -> dict[str, Any]:
    """GGUF files of the HF `folder` as users make them: llama.cpp's own `convert_hf_to_gguf.py` to bf16
    (lossless for these bf16 weights), then `llama-quantize` to each of `qtypes`, written next to the
    folder's safetensors (`gguf_path`). Raises FileNotFoundError when llama.cpp's source or its
    llama-quantize (cmake --build build --target llama-quantize) is missing, CalledProcessError when a
    step fails (with its output's tail). `python` runs the converter. Returns the files, their bytes and the seconds of each step."""
    convert = llama_cpp / "convert_hf_to_gguf.py"
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    for need in (convert, quantize):
        if not need.is_file():
            raise FileNotFoundError(f"{need} is missing (llama.cpp source and its llama-quantize build)")
    bf16 = gguf_path(folder, "BF16")
    out: dict[str, Any] = {"files": {}, "bytes": {}, "seconds": {}}
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH="")  # its own gguf-py, not an installed gguf
    _run([str(python), str(convert), str(folder), "--outtype", "bf16", "--outfile", str(bf16)], env)
    out["seconds"]["convert_bf16"] = round(time.perf_counter() - t0, 1)
    threads = str(os.cpu_count() or 1)
    for qtype in qtypes:
        t0 = time.perf_counter()
        dst = gguf_path(folder, qtype)
        _run([str(quantize), str(bf16), str(dst), qtype, threads], None)
        out["seconds"][qtype] = round(time.perf_counter() - t0, 1)
        out["files"][qtype], out["bytes"][qtype] = str(dst), dst.stat().st_size
    if keep_bf16:
        out["files"]["BF16"], out["bytes"]["BF16"] = str(bf16), bf16.stat().st_size
    else:
        bf16.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(SHAPES))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--gguf",
        nargs="*",
        default=list(GGUF_TYPES),
        help="llama-quantize types to make ('--gguf' alone: none)",
    )
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP, help="llama.cpp source with build/")
    ap.add_argument("--convert-python", type=Path, default=DEFAULT_CONVERT_PYTHON)
    ap.add_argument("--keep-bf16-gguf", action="store_true", help="keep the intermediate bf16 GGUF")
    ap.add_argument("--reuse", action="store_true", help="keep a folder already made with the same config")
    ap.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="folder with the embedded SmolLM2's tokenizer files (default: the embedded model's folder)",
    )
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    made = []
    for name in args.models:
        folder = args.out / name
        same = (folder / "config.json").is_file() and json.loads(
            (folder / "config.json").read_text()
        ) == SHAPES[name]
        if args.reuse and same and (folder / "model.safetensors.index.json").is_file():
            row: dict[str, Any] = {"model": name, "folder": str(folder), "reused": True}
        else:
            row = make_hf_folder(name, args.out, args.seed, args.tokenizer_from)
        todo = [q for q in args.gguf if not (args.reuse and same and gguf_path(folder, q).is_file())]
        if todo:
            row["gguf"] = make_gguf(folder, todo, args.llama_cpp, args.convert_python, args.keep_bf16_gguf)
        print(json.dumps(row), file=sys.stderr, flush=True)
        made.append(row)
    print(json.dumps({"made": made}, indent=2))


if __name__ == "__main__":
    main()

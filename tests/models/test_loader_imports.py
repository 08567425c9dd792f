"""What loading a model imports: the loaders build the model on the meta device and assign the
checkpoint's tensors, and the tokenizer is read, and nothing on that path may pull in torch's compiler
stack, which a server never uses: torch._dynamo with sympy and torch._inductor (~70 MiB of resident
memory) and triton where it is installed (~74 MiB more), measured on a Gemma-3-1B Q4_K_M server (RSS
1,683 -> 1,556 MiB, 2026-12-05)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

_LOAD = """
import sys
from pathlib import Path

import torch

from server.models.loader import load_model

loaded = load_model(Path(sys.argv[1]), torch.float32, torch.device("cpu"), 64)
assert loaded.model.rotary.cos.shape[0] == 64  # the tables are built once the weights are in
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy", "triton") if m in sys.modules))
"""


def test_loading_a_model_imports_no_compiler(tiny_model_factory: Callable[..., Path]) -> None:
    """nn.Embedding's normal_ and the rotary tables' arithmetic on meta tensors run torch's Python meta
    kernels, whose first call imports torch._dynamo: the loaders' model skips both (TokenEmbedding,
    max_positions=None) and builds the tables once the weights are assigned."""
    folder = tiny_model_factory("llama")
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(folder)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]


_TOKENIZER = """
import sys
from server.tokenizer import Tokenizer

tok = Tokenizer(sys.argv[1])
assert tok.decode(tok.encode("Hello there")) == "Hello there"
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy", "triton") if m in sys.modules))
"""


def test_reading_a_llama_tokenizer_imports_no_compiler(tiny_model_factory: Callable[..., Path]) -> None:
    """AutoTokenizer reads config.json through AutoConfig, and Llama's config module imports
    transformers.activations and through it torch._dynamo (Qwen3's, Gemma 3's and most others do not):
    the server's tokenizer is read with transformers' base config where tokenizer_config.json names the
    class."""
    folder = tiny_model_factory("llama")
    out = subprocess.run(
        [sys.executable, "-c", _TOKENIZER, str(folder)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]


_POOLING = """
import sys
from pathlib import Path

from server.pooling.model import load_pooling_model

model = load_pooling_model(Path(sys.argv[1]))
assert model.tokenizer.encode("Hello there")
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy", "triton") if m in sys.modules))
"""


def test_loading_a_decoder_embedder_imports_no_compiler(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The pooling loader's tokenizer is read the same way: a Llama-based embedder (its config module is
    the one that imports torch._dynamo) as sentence-transformers saves it."""
    from embedding_models import build_qwen3_embedding

    folder = build_qwen3_embedding(tiny_model_factory("llama", tie=True), tmp_path / "llama-embed")
    out = subprocess.run(
        [sys.executable, "-c", _POOLING, str(folder)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_tokenizer_read_without_the_config_class_is_autotokenizers(
    arch: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """The same class, ids, special tokens and chat template as `AutoTokenizer.from_pretrained(folder)`."""
    from transformers import AutoTokenizer

    from server.tokenizer import load_hf_tokenizer

    folder = tiny_model_factory(arch)
    ours, theirs = load_hf_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(theirs)
    text = "Hello <|im_start|> world  h\u00e9llo\n\n  x <|endoftext|> 12345"
    assert ours.encode(text) == theirs.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id, ours.all_special_ids, len(ours)) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.all_special_ids,
        len(theirs),
    )
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )

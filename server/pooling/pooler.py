"""The pooling step: token states -> one vector per sequence, as sentence-transformers' `Pooling` and
`Normalize` modules do (source: sentence_transformers/models/Pooling.py), plus Matryoshka truncation.

Shapes: hidden `[batch, seq, dim]`, attention_mask `[batch, seq]` (1 = token, 0 = padding; padding on
the right for mean/cls/max, either side for last-token), result `[batch, dim]` float32.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


class PoolingMode(enum.StrEnum):
    MEAN = "mean"
    CLS = "cls"
    MAX = "max"
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"
    LAST = "lasttoken"


# 1_Pooling/config.json's boolean keys (sentence-transformers v2-v5 spelling)
_FLAG_KEYS = {
    "pooling_mode_mean_tokens": PoolingMode.MEAN,
    "pooling_mode_cls_token": PoolingMode.CLS,
    "pooling_mode_max_tokens": PoolingMode.MAX,
    "pooling_mode_mean_sqrt_len_tokens": PoolingMode.MEAN_SQRT_LEN,
    "pooling_mode_lasttoken": PoolingMode.LAST,
}


@dataclass(frozen=True)
class PoolingConfig:
    """How a model's token states become an embedding.

    mode: the pooling; normalize: L2-normalize (a `Normalize` module in modules.json); max_seq_length:
    sentence-transformers' limit (sentence_bert_config.json), None = the model's positions;
    matryoshka_dimensions: allowed `dimensions` (None = any smaller size when `is_matryoshka`, () = no
    truncation allowed)."""

    mode: PoolingMode = PoolingMode.MEAN
    normalize: bool = False
    max_seq_length: int | None = None
    matryoshka_dimensions: tuple[int, ...] | None = ()
    include_prompt: bool = True
    # config_sentence_transformers.json: instruction prompts by name (prepended to a text before
    # tokenizing, as sentence-transformers' encode(prompt_name=...) does) and the one used when a request
    # names none (null: no prompt)
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    # the Dense modules' folders after the pooling, in order (dense.py: EmbeddingGemma's 2_Dense, 3_Dense)
    dense: tuple[str, ...] = ()

    def prompt(self, name: str | None) -> str:
        """The text of prompt `name` (None: the default prompt, else ""); KeyError for an unknown name."""
        name = name if name is not None else self.default_prompt_name
        return "" if name is None else dict(self.prompts)[name]

    @classmethod
    def from_folder(cls, folder: Path, default_mode: PoolingMode, hf_config: dict) -> PoolingConfig:
        """Reads modules.json, the Pooling module's config.json and sentence_bert_config.json.
        Raises ValueError for modules we do not implement (combined pooling modes, a Dense before the
        pooling or after Normalize, any other module)."""
        mode, normalize, max_len = default_mode, False, None
        dense: list[str] = []
        pooled = False
        modules_file = folder / "modules.json"
        if modules_file.is_file():
            for m in json.loads(modules_file.read_text()):
                kind = m.get("type", "").rsplit(".", 1)[-1]
                if kind == "Transformer":
                    sb = folder / m.get("path", "") / "sentence_bert_config.json"
                    if sb.is_file():
                        max_len = json.loads(sb.read_text()).get("max_seq_length")
                    tc = folder / m.get("path", "") / "tokenizer_config.json"
                    if max_len is None and tc.is_file():
                        # sentence-transformers >= 6 saves the limit as the tokenizer's model_max_length
                        # (and falls back to it on load); tokenizers without a limit say ~1e30
                        limit = json.loads(tc.read_text()).get("model_max_length")
                        max_len = int(limit) if isinstance(limit, int | float) and limit < 1 << 31 else None
                elif kind == "Pooling":
                    mode = _pooling_mode(json.loads((folder / m["path"] / "config.json").read_text()))
                    pooled = True
                elif kind == "Dense" and pooled and not normalize:
                    dense.append(str(m["path"]))
                elif kind == "Normalize":
                    normalize = True
                else:
                    raise ValueError(f"sentence-transformers module {m.get('type')!r} is not supported")
        dims: tuple[int, ...] | None = ()
        if hf_config.get("matryoshka_dimensions"):
            dims = tuple(int(d) for d in hf_config["matryoshka_dimensions"])
        elif hf_config.get("is_matryoshka"):
            dims = None
        prompts, default_prompt = _prompts(folder / "config_sentence_transformers.json")
        return cls(
            mode=mode,
            normalize=normalize,
            max_seq_length=max_len,
            matryoshka_dimensions=dims,
            prompts=prompts,
            default_prompt_name=default_prompt,
            dense=tuple(dense),
        )


def _prompts(path: Path) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """`prompts` and `default_prompt_name` of config_sentence_transformers.json (sentence-transformers
    >= 2.4); a default naming no prompt is refused, as sentence-transformers refuses it."""
    if not path.is_file():
        return (), None
    cfg = json.loads(path.read_text())
    raw = cfg.get("prompts") or {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise ValueError(f"{path}: `prompts` must map names to strings")
    default = cfg.get("default_prompt_name")
    if default is not None and default not in raw:
        raise ValueError(f"{path}: default_prompt_name {default!r} is not one of the prompts {sorted(raw)}")
    return tuple(sorted(raw.items())), default


def _pooling_mode(cfg: dict) -> PoolingMode:
    if cfg.get("include_prompt") is False:
        raise ValueError("pooling with include_prompt=false is not supported")
    named = cfg.get("pooling_mode")  # sentence-transformers >= 6 names the mode (or a list of modes)
    if isinstance(named, list) and len(named) == 1:
        named = named[0]
    if isinstance(named, str):
        return PoolingMode(named)
    if named is not None:
        raise ValueError(f"exactly one pooling mode is supported, the model's config names {named}")
    on = [mode for key, mode in _FLAG_KEYS.items() if cfg.get(key)]
    if len(on) != 1:
        raise ValueError(f"exactly one pooling mode is supported, the model's config turns on {on}")
    return on[0]


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """[batch, seq, dim] -> [batch, dim] float32 (see the module docstring)."""
    h = hidden.float()
    mask = attention_mask.to(h.dtype).unsqueeze(-1)
    if mode is PoolingMode.CLS:
        return h[:, 0]
    if mode is PoolingMode.LAST:
        # The last real token of each row, whichever side the padding is on.
        positions = torch.arange(h.shape[1], device=h.device).expand_as(attention_mask)
        last = torch.where(attention_mask.bool(), positions, -1).max(dim=1).values
        return h[torch.arange(h.shape[0], device=h.device), last]
    if mode is PoolingMode.MAX:
        return h.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    summed = (h * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    if mode is PoolingMode.MEAN_SQRT_LEN:
        return summed / counts.sqrt()
    return summed / counts


def finish_embedding(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation to the first `dimensions` values, then L2 normalization (vLLM's order:
    a truncated normalized vector is normalized again)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector

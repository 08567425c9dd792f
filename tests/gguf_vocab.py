"""The embedded SmolLM2 GGUF's `tokenizer.*` keys, for the tiny GGUF files tests write (their models use
SmolLM2's 49,152-token vocabulary). gguf-py's reader takes ~3 s to parse them: read once a process."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _tokenizer_keys() -> tuple[tuple[str, Any, Any, Any], ...]:
    import gguf

    from server.models.loader import embedded_gguf_path

    source = gguf.GGUFReader(str(embedded_gguf_path()))
    keys = []
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            keys.append((key, field.contents(), vtype, sub))
    return tuple(keys)


def add_embedded_tokenizer(writer: Any) -> None:
    """Adds SmolLM2's tokenizer keys (vocabulary, merges, token types, special ids, chat template) to a
    `gguf.GGUFWriter`."""
    for key, value, vtype, sub in _tokenizer_keys():
        writer.add_key_value(key, value, vtype, sub_type=sub)

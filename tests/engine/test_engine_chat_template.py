"""The shipped tool-aware template for the embedded SmolLM2 renders exactly as the model's own template
without tools, and renders tools, tool calls and tool results in the Hermes format with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.tokenizer import Tokenizer, shipped_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_shipped_template_matches_model_template_without_tools(
    smollm2_dir: Path, add_generation_prompt: bool
) -> None:
    own = Tokenizer(smollm2_dir)
    shipped = Tokenizer(smollm2_dir, chat_template=shipped_chat_template("smollm2_tools"))
    assert not own.chat_template_knows_tools and shipped.chat_template_knows_tools
    for messages in CONVERSATIONS:
        assert shipped.apply_chat_template(messages, add_generation_prompt) == own.apply_chat_template(
            messages, add_generation_prompt
        )


def test_shipped_template_renders_tools_calls_and_results(smollm2_dir: Path) -> None:
    tok = Tokenizer(smollm2_dir, chat_template=shipped_chat_template("smollm2_tools"))
    messages = [
        {"role": "user", "content": "Time in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c2", "content": "13:00"},
    ]
    text = tok.decode(tok.apply_chat_template(messages, True, tools=TOOLS), skip_special_tokens=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_time"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>'
        in text
    )
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response><|im_end|>"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")

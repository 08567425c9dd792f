"""What the server does with every declared request field: the decision table.

Each field of each request model in `protocol.py` has one row here, keyed by the model class that
declares it (subclasses inherit their parents' rows). tests/api/test_api_conformance.py walks the
models and fails on a field without a row, sends every refused example and expects a 400/422 naming
the field, and checks that each implemented field's test exists and mentions it. Adding a field
means adding its row: implement it as the reference server does (vLLM, OpenAI, TGI) or refuse it.

how:
  implemented - does what the reference server does with it; `test` proves it.
  partial     - some values are implemented (`test`), others refused (`refused` is one of those).
  refused     - any value other than the default/null is refused (`refused` is an example).
  metadata    - describes the request and changes no output in the reference server either
                (OpenAI's `user`); accepted as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

How = Literal["implemented", "partial", "refused", "metadata"]


@dataclass(frozen=True)
class FieldPolicy:
    how: How
    note: str
    test: str | None = None  # a test function (in tests/) that exercises the field
    refused: Any = None  # a value the server must refuse, naming the field (partial/refused)


def _impl(test: str, note: str = "as the reference server") -> FieldPolicy:
    return FieldPolicy("implemented", note, test=test)


def _partial(test: str, refused: Any, note: str) -> FieldPolicy:
    return FieldPolicy("partial", note, test=test, refused=refused)


def _refused(example: Any, note: str) -> FieldPolicy:
    return FieldPolicy("refused", note, refused=example)


_STOP = "test_api_conf_stop_rules_table"
_LP = "test_api_conf_logprob_bytes_join_to_text"
_SCORE = "test_api_conf_prompt_scoring_matches_transformers"
_ENGINE = "test_api_openai_completions_match_engine"
_CHAT = "test_api_openai_chat_matches_engine"
_TGI = "test_api_tgi_client_generate_matches_engine"
_OAI_MAP = "test_api_conf_fields_reach_the_engine"
_TGI_MAP = _OAI_MAP
_STRUCT = "test_api_regex_and_choice_both_apis"
_ROUTER = "test_api_conf_router_added_fields_at_defaults"
_TOOLS = "test_api_tool_loop_required_named_and_stream"
_RESP = "test_api_responses_sdk_create_stream_retrieve_delete"
_REASONING = "test_api_reasoning_chat_split_stream_and_template_kwargs"
_RESP_TOOLS = "test_api_responses_tools_through_previous_response_id"

FIELD_POLICY: dict[str, dict[str, FieldPolicy]] = {
    "TGIRequest": {
        "inputs": _impl(_TGI_MAP),
        "parameters": _impl(_TGI_MAP),
        "stream": _impl("test_api_tgi_raw_sse_and_headers"),
    },
    "TGIParameters": {
        "best_of": _impl("test_api_tgi_sampling_best_of"),
        "decoder_input_details": _impl(_TGI),
        "details": _impl(_TGI),
        "do_sample": _impl("test_api_tgi_sampling_best_of"),
        "frequency_penalty": _impl(_TGI_MAP),
        "grammar": _impl(_STRUCT, "json (schema) or regex, as TGI"),
        "max_new_tokens": _impl(_TGI),
        "repetition_penalty": _impl(_TGI_MAP),
        "return_full_text": _impl(_TGI),
        "seed": _impl("test_api_tgi_sampling_best_of"),
        "stop": _impl("test_api_conf_tgi_token_text_with_stop"),
        "temperature": _impl(_TGI_MAP),
        "top_k": _impl(_TGI_MAP),
        "top_n_tokens": _impl(_TGI_MAP),
        "top_p": _impl(_TGI_MAP),
        "truncate": _impl("test_api_conf_tokenize_routes", "keeps the last `truncate` prompt tokens"),
        "typical_p": _partial(_TGI_MAP, 0.5, "1.0 (off) accepted; typical sampling is not implemented"),
        "watermark": _refused(True, "watermarking is not implemented"),
        "adapter_id": _impl(
            "test_tgi_adapter_id", "a LoRA adapter loaded with --lora-modules or at run time"
        ),
    },
    "TGITokenizeRequest": {
        "inputs": _impl("test_api_conf_tokenize_routes"),
        "parameters": _impl("test_api_conf_tokenize_routes", "TGI reads only `truncate` when tokenizing"),
    },
    "StreamOptions": {
        "include_usage": _impl("test_api_conf_continuous_usage_stats"),
        "continuous_usage_stats": _impl("test_api_conf_continuous_usage_stats"),
    },
    "SamplingFields": {
        "model": _impl("test_api_openai_malformed_unknown_model"),
        "n": _impl(_ENGINE),
        "stream": _impl(_ENGINE),
        "stream_options": _impl("test_api_conf_continuous_usage_stats"),
        "stop": _impl(_STOP),
        "seed": _impl(_OAI_MAP),
        "temperature": _impl(_ENGINE),
        "top_p": _impl(_OAI_MAP),
        "presence_penalty": _impl(_OAI_MAP),
        "frequency_penalty": _impl(_OAI_MAP),
        "logit_bias": _refused({"11": 5.0}, "logit bias is not implemented"),
        "user": FieldPolicy("metadata", "OpenAI's end-user id for abuse monitoring; no effect on output"),
        "top_k": _impl(_OAI_MAP),
        "min_p": _impl(_OAI_MAP),
        "repetition_penalty": _impl(_OAI_MAP),
        "ignore_eos": _impl(_OAI_MAP),
        "min_tokens": _impl(_STOP),
        "stop_token_ids": _impl(_STOP),
        "skip_special_tokens": _impl(_OAI_MAP),
        "include_stop_str_in_output": _impl(_STOP),
        "structured_outputs": _impl(_STRUCT, "json, regex, choice, grammar, json_object (vLLM)"),
        "guided_json": _impl(_STRUCT),
        "guided_regex": _impl(_STRUCT),
        "guided_choice": _impl(_STRUCT),
        "guided_grammar": _impl(_STRUCT, "EBNF as xgrammar takes it"),
        "no_stop_trim": _partial(_ROUTER, True, "false (vllm-router's default) accepted; stops are trimmed"),
        "return_hidden_states": _partial(_ROUTER, True, "false (vllm-router's default) accepted"),
        "priority": _impl(
            "test_api_priority_field",
            "lower first under --scheduling-policy priority; non-zero refused under fcfs",
        ),
    },
    "CompletionRequest": {
        "prompt": _impl(_ENGINE),
        "max_tokens": _impl(_SCORE, "0 with echo or prompt_logprobs scores the prompt only"),
        "logprobs": _impl(_LP),
        "echo": _impl(_SCORE),
        "best_of": _partial(_OAI_MAP, 3, "equal to n accepted; best_of > n is not implemented"),
        "suffix": _refused("tail", "insertion (suffix) is not implemented"),
        "prompt_logprobs": _impl(_SCORE),
    },
    "ChatMessage": {
        "role": _impl(_CHAT),
        "content": _impl(_CHAT, "a string or text parts; image, audio and file parts refused by type"),
        "name": _impl("test_api_conf_chat_echo_and_continue", "passed to the chat template, as vLLM"),
        "tool_call_id": _impl("test_api_conf_chat_echo_and_continue", "passed to the chat template, as vLLM"),
        "tool_calls": _impl(_TOOLS, "an assistant message's calls, passed to the chat template"),
    },
    "ChatCompletionRequest": {
        "messages": _impl(_CHAT),
        "max_tokens": _impl(_CHAT),
        "max_completion_tokens": _impl(_OAI_MAP),
        "logprobs": _impl(_LP),
        "top_logprobs": _impl(_LP),
        "tools": _impl(
            _TOOLS,
            "function tools, closed by path (shapes.py); strict is what required/named enforce, "
            "under auto calls are parsed, not constrained (as vLLM)",
        ),
        "tool_choice": _impl(_TOOLS, "none, auto (with --enable-auto-tool-choice), required, named"),
        "parallel_tool_calls": _impl(_TOOLS),
        "response_format": _impl(
            "test_api_openai_parse_validates_20_seeds", "text, json_object, json_schema"
        ),
        "add_generation_prompt": _impl("test_api_conf_chat_echo_and_continue"),
        "continue_final_message": _impl("test_api_conf_chat_echo_and_continue"),
        "echo": _impl("test_api_conf_chat_echo_and_continue"),
        "prompt_logprobs": _impl(_SCORE),
        "chat_template_kwargs": _impl(
            _REASONING, "variables for the chat template, e.g. enable_thinking (vLLM)"
        ),
        "reasoning_effort": _impl(_REASONING, "passed to templates that read reasoning_effort; else 400"),
        "separate_reasoning": _partial(
            _ROUTER, False, "true (vllm-router's default) accepted; no reasoning parser"
        ),
        "stream_reasoning": _partial(
            _ROUTER, False, "true (vllm-router's default) accepted; no reasoning parser"
        ),
        "include_reasoning": _partial(
            _ROUTER, False, "true (vllm-router's default) accepted; no reasoning parser"
        ),
    },
    # server/api/responses_protocol.py: OpenAI's Responses API (tests/api/test_api_responses.py)
    "ResponsesRequest": {
        "model": _impl(_RESP),
        "input": _impl(
            _RESP_TOOLS, "a string or message / function_call / function_call_output / reasoning items"
        ),
        "instructions": _impl(_RESP, "a system message in front; not carried to the next response"),
        "max_output_tokens": _impl(_RESP),
        "temperature": _impl(_RESP),
        "top_p": _impl(_RESP),
        "tools": _partial(
            _RESP_TOOLS, [{"type": "web_search"}], "function tools; hosted tools refused by type"
        ),
        "tool_choice": _impl(
            _RESP_TOOLS, "none, auto (with --enable-auto-tool-choice), required, a function"
        ),
        "parallel_tool_calls": _impl(_RESP_TOOLS),
        "text": _partial(
            "test_api_responses_parse_text_format",
            {"verbosity": "low"},
            "format: text, json_object, json_schema",
        ),
        "metadata": _impl(_RESP, "kept with the response and returned"),
        "user": FieldPolicy("metadata", "OpenAI's end-user id; no effect on output"),
        "safety_identifier": FieldPolicy("metadata", "OpenAI's end-user id; no effect on output"),
        "prompt_cache_key": FieldPolicy("metadata", "a cache hint; the prefix cache needs none"),
        "truncation": _impl("test_api_responses_truncation_auto", "auto drops the oldest turns to fit"),
        "store": _impl(_RESP, "kept per API key, bounded (--enable-responses-store)"),
        "previous_response_id": _impl(_RESP_TOOLS, "the stored conversation continues; 404 when unknown"),
        "include": _refused(["message.output_text.logprobs"], "no include value is served yet"),
        "stream": _impl(_RESP),
        "background": _refused(True, "responses run while the client waits"),
        "reasoning": _partial(
            "test_api_responses_refusals_name_the_field",
            {"summary": "auto"},
            "effort where the template reads it",
        ),
        "top_logprobs": _refused(5, "logprobs are not returned on /v1/responses yet"),
        "service_tier": _partial(_RESP, "flex", "auto and default accepted"),
        "seed": _impl(_RESP, "vLLM's extra"),
        "stop": _impl(_RESP, "vLLM's extra"),
        "ignore_eos": _impl(_RESP, "vLLM's extra (guidellm sends it)"),
    },
    "TokenizeCompletionRequest": {
        "model": _impl("test_api_conf_tokenize_routes"),
        "prompt": _impl("test_api_conf_tokenize_routes"),
        "add_special_tokens": _impl("test_api_conf_tokenize_routes"),
        "return_token_strs": _impl("test_api_conf_tokenize_routes"),
    },
    "TokenizeChatRequest": {
        "model": _impl("test_api_conf_tokenize_routes"),
        "messages": _impl("test_api_conf_tokenize_routes"),
        "add_generation_prompt": _impl("test_api_conf_tokenize_routes"),
        "continue_final_message": _impl("test_api_conf_tokenize_routes"),
        "add_special_tokens": _impl("test_api_conf_tokenize_routes"),
        "return_token_strs": _impl("test_api_conf_tokenize_routes"),
    },
    "DetokenizeRequest": {
        "model": _impl("test_api_conf_tokenize_routes"),
        "tokens": _impl("test_api_conf_tokenize_routes"),
    },
}


def policy_for(model: type, field: str) -> FieldPolicy | None:
    """The row for `field` of request model `model`, looked up along its class hierarchy."""
    for cls in model.__mro__:
        row = FIELD_POLICY.get(cls.__name__, {}).get(field)
        if row is not None:
            return row
    return None

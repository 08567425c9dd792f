"""Request bodies of both APIs as pydantic models (responses are built as plain dicts in the routes).

Every declared field is honoured or refused by name (the table in `fields.py` says which, and a test
walks these models against it). A field no model declares is refused with a 400/422 naming it, as
OpenAI's API does ("Unrecognized request argument supplied"), unless its value is null: a null asks
for nothing, and clients replaying earlier responses send e.g. `"tool_calls": null`.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import validation
from .shapes import chat_content_text


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validates a JSON body; pydantic errors become one validation APIError naming the fields, and
    so does a field that no model declares (null values aside)."""
    try:
        parsed = model.model_validate(data)
    except ValidationError as e:
        parts = []
        for err in e.errors()[:5]:
            loc = ".".join(str(x) for x in err["loc"]) or "body"
            parts.append(f"{loc}: {err['msg']}")
        first = e.errors()[0]["loc"] if e.errors() else ()
        raise validation("Input validation error: " + "; ".join(parts), _param(first)) from None
    unknown = _unknown_fields(parsed, "")
    if unknown:
        raise validation(f"Unrecognized request argument supplied: {unknown}", unknown)
    return parsed


def _unknown_fields(obj: Any, path: str) -> str | None:
    """The dotted path of the first undeclared field with a non-null value in a parsed body."""
    if isinstance(obj, BaseModel):
        for key, value in (obj.model_extra or {}).items():
            if value is not None:
                return f"{path}{key}"
        for name in type(obj).model_fields:
            found = _unknown_fields(getattr(obj, name), f"{path}{name}.")
            if found:
                return found
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found = _unknown_fields(item, f"{path[:-1]}[{i}].")
            if found:
                return found
    return None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param(loc: tuple[Any, ...]) -> str | None:
    """The field path of an error, without pydantic's union-member tags (`prompt.str` -> `prompt`)."""
    keep = [str(x) for x in loc if isinstance(x, int) or ("[" not in str(x) and str(x) not in _TYPE_TAGS)]
    return ".".join(keep) or None


def _none_to_list(v: Any) -> Any:
    return [] if v is None else v


def _admits_none(annotation: Any) -> bool:
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits_none(a) for a in typing.get_args(annotation))
    return False


@functools.cache
def _null_means_default(cls: type[BaseModel]) -> frozenset[str]:
    """The optional fields of `cls` whose type has no null: there a null is the field's default."""
    return frozenset(
        name for name, f in cls.model_fields.items() if not f.is_required() and not _admits_none(f.annotation)
    )


class NullIsUnset(BaseModel):
    """A null for an optional field reads as the field left out, as OpenAI, vLLM and TGI read it
    (`"n": null`, `"echo": null`, `"parameters": null`; clients built from the peers' schemas send
    them). Fields whose own type has a null keep it: there it means what the field says it means. A
    required field's null is still refused; an undeclared field's null asks for nothing and is dropped
    (a non-null one is refused by name: `parse`, or `extra="forbid"`)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unset = _null_means_default(cls)
            fields = cls.model_fields
            drop = [k for k, v in data.items() if v is None and (k in unset or k not in fields)]
            if drop:
                return {k: v for k, v in data.items() if k not in drop}
        return data


class RequestModel(NullIsUnset):
    """Base of every request body: undeclared fields are kept aside so `parse` can refuse them."""

    model_config = ConfigDict(extra="allow")


_Lenient = RequestModel  # the former name, for code written against it


# ---- TGI ---------------------------------------------------------------------------------------
class TGIParameters(_Lenient):
    best_of: int | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: Any = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    return_full_text: bool | None = False
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False
    adapter_id: str | None = None

    _stop_none = field_validator("stop", mode="before")(_none_to_list)


class TGIRequest(_Lenient):
    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False

    @field_validator("parameters", mode="before")
    @classmethod
    def _params_none(cls, v: Any) -> Any:
        return {} if v is None else v


class TGITokenizeRequest(_Lenient):
    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)

    @field_validator("parameters", mode="before")
    @classmethod
    def _params_none(cls, v: Any) -> Any:
        return {} if v is None else v


# ---- OpenAI ------------------------------------------------------------------------------------
class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Lenient):
    """Fields both OpenAI routes share, with vLLM's extras."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's structured outputs (server/api/structured.py): one object, or the older guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vllm-router forwards every request as SGLang's request types, which add these at their defaults;
    # the defaults are what this server does, another value is refused (openai._check_common).
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # vLLM's request priority: lower is scheduled first under --scheduling-policy priority; a non-zero
    # value under fcfs is refused (as vLLM does).
    priority: int = 0

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM extra: each prompt token's logprob and this many top alternatives
    prompt_logprobs: int | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self, path: str = "messages") -> str:
        """The content as text (text parts joined); any other part is refused naming `path`'s part."""
        return chat_content_text(self.content, self.role, path)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # added by vllm-router at these defaults; this server has no reasoning parser, so only they are served
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None
    # thinking models (server/api/reasoning.py): template variables (vLLM), OpenAI's effort
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


# ---- vLLM utility routes -------------------------------------------------------------------------
class TokenizeCompletionRequest(RequestModel):
    """vLLM's POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel):
    """vLLM's POST /tokenize with messages (the chat template applied)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]

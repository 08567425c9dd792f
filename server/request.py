"""Requests and their sampling parameters: plain Python, shared by the API, the scheduler and the worker."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # client went away or asked to cancel
    ERROR = "error"  # the engine failed this request (the others keep running)


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS: logits / 1e-300 overflow to inf, and the
# limit of softmax(logits / T) as T -> 0 is the argmax.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint, as text the grammar library compiles (server/structured/).

    kind: "json" (value = a JSON schema, as JSON text), "json_object" (any JSON object; value ""),
    "regex" (value = the pattern), "choice" (value = a JSON list of strings), "grammar" (value = EBNF
    in the GBNF dialect xgrammar takes).
    start_after: token ids that must appear in the output before the grammar holds (a reasoning
    model's `</think>`): until they do the output is free, and the grammar constrains what follows
    their first occurrence. Empty: the grammar holds from the first output token.
    """

    kind: str
    value: str = ""
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.start_after):
            raise ValueError(f"start_after must hold token ids, got {self.start_after!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. A temperature below SAMPLING_EPS (1e-5) means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None = no logprobs; n >= 0 = chosen token + n top alternatives
    # None = off; n >= 0 = each prompt token's logprob (the first is None) + n top alternatives (vLLM)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrained decoding: every sampled token keeps the output inside this grammar.
    structured: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= 100.0):
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not (0 <= self.prompt_logprobs <= 20)
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an int in [0, 20], got {self.prompt_logprobs!r}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.structured is not None:
            # Both would have to force tokens past the grammar's end, where only EOS is allowed.
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured outputs")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs under. lora_int_id is unique per load, so reloading a name with new
    weights never shares prefix-cache blocks or weight slots with the old ones."""

    name: str
    lora_int_id: int  # >= 1
    path: str
    base_model_name: str | None = None  # --lora-modules' JSON form; /v1/models' `parent`

    @property
    def cache_key(self) -> bytes:
        """Seeds the prefix-cache hash chain: blocks computed under different adapters never match."""
        return f"lora:{self.lora_int_id}:{self.name}".encode()


@dataclass(frozen=True)
class PoolingParams:
    """Marks a pooling request (embed, score): one forward over the whole prompt, no token sampled, and
    nothing kept after it (no KV blocks). `token_type_ids`: BERT segment ids of a (query, document) pair,
    one per prompt token; None = all 0. `per_token`: the last hidden state of every prompt token
    (TEI's /embed_all, vLLM's token_embed) instead of the pooled vector (embedding models only)."""

    token_type_ids: tuple[int, ...] | None = None
    per_token: bool = False


@dataclass
class Request:
    """A request as the engine tracks it. Block ids live in the KV cache manager, not here."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens of the prompt found in the prefix cache at the first admission (for stats and headers).
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Draft tokens proposed for the next step (speculative decoding); never part of the sequence until
    # the target model accepts them.
    spec_token_ids: list[int] = field(default_factory=list)
    lora: LoRARequest | None = None  # None = the base model
    pooling: PoolingParams | None = None  # set: a pooling request (server/pooling/), never sampled
    # --scheduling-policy priority: lower is scheduled first (vLLM's `priority`); 0 under fcfs.
    priority: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

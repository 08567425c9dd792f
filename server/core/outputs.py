"""Plain types that cross the scheduler / worker / engine boundaries. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.request import FinishReason, Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [start, start + num_new_tokens) of its sequence."""

    request: Request
    num_new_tokens: int
    start: int  # == request.num_computed_tokens when scheduled
    block_ids: tuple[int, ...]  # the request's whole block table after allocation
    # True when this chunk ends at the last known token, so the step yields a new token for it.
    sample: bool
    # Draft tokens verified in this step after the last known token (speculative decoding). They are
    # the last len(spec_token_ids) of the num_new_tokens positions.
    spec_token_ids: tuple[int, ...] = ()
    # The tables of KV layer groups 1.. (server/core/kv_groups.py), each covering the same positions as
    # block_ids; empty where the cache has one group.
    group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that finished or were aborted since the previous step: the worker drops their state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float
    rank: int | None = None  # 1 = most likely; set for prompt tokens (vLLM's prompt_logprobs rank)


@dataclass(frozen=True)
class TokenLogprobs:
    chosen: Logprob
    top: list[Logprob]  # most likely first, len == SamplingParams.logprobs


@dataclass
class ModelOutput:
    """What one forward + sampling step produced, keyed by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Speculating rows: the accepted draft tokens, then the target's own next token (1..k+1 tokens).
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # each prompt token's logprob given its prefix, with SamplingParams.prompt_logprobs top alternatives
    # (None for the first token); TGI's decoder_input_details, vLLM's prompt_logprobs and echo
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # A failure confined to one request (bad sampling state, injected fault): that request ends with ERROR.
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    """One step's news for one request, streamed to its caller."""

    request_id: str
    new_token_ids: list[int]
    text: str  # newly released text (held back while it may still become a stop string)
    finished: bool
    # Each new token's own text (see DetokenizerUpdate.token_texts); [] when not computed.
    new_token_texts: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = None
    # A pooling request's result (server/pooling/): a float32 tensor, `[dim]` or `[num_labels]`; typed
    # loosely because this module stays free of torch.
    pooled: object | None = None


# vLLM's vllm:iteration_tokens_total buckets (tokens per engine step; its upper ones follow the
# CUDA-graph capture sizes, fixed here).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class StepTokenHistogram:
    """Tokens per engine step, cumulative: `counts[i]` steps had at most `ITERATION_TOKEN_BUCKETS[i]`
    tokens (a Prometheus histogram's `le` buckets), `steps` and `tokens` in all. Plain Python: the
    scheduler observes, metrics.py exports."""

    counts: list[int] = field(default_factory=lambda: [0] * len(ITERATION_TOKEN_BUCKETS))
    steps: int = 0
    tokens: int = 0

    def observe(self, n: int) -> None:
        self.steps += 1
        self.tokens += n
        for i, bound in enumerate(ITERATION_TOKEN_BUCKETS):
            if n <= bound:
                self.counts[i] += 1

    def snapshot(self) -> tuple[tuple[int, ...], int, int]:
        """(cumulative bucket counts, steps, tokens)."""
        return tuple(self.counts), self.steps, self.tokens


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # the fullest KV group's fraction of blocks held by live requests, 0..1
    # over every KV layer group (server/core/kv_groups.py; blocks of one layer each), so that free ==
    # total means nothing is held anywhere, the windowed group included
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int  # cumulative
    num_prompt_tokens: int  # cumulative prompt tokens computed (cache hits excluded)
    num_generation_tokens: int  # cumulative
    num_batched_tokens: int = 0  # last step
    # speculative decoding, cumulative (vLLM's vllm:spec_decode_* counters)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    running_lora_adapters: tuple[str, ...] = ()  # adapter names of running requests
    waiting_lora_adapters: tuple[str, ...] = ()  # adapter names of waiting requests
    # tokens per step, cumulative: (bucket counts over ITERATION_TOKEN_BUCKETS, steps, tokens)
    iteration_tokens: tuple[tuple[int, ...], int, int] = ((), 0, 0)

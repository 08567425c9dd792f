"""Why a request finished: the one place that decides, for every route and every caller.

The scheduler asks after each sampled token (it knows the token, not the text); the engine asks
again once the detokenizer has looked for stop strings in the text that token completed. Speculative
decoding and grammar code call `decide_finish` per accepted token, in order, and stop at the first
decision.

The rules (vLLM's meaning, applied alike to EOS, `stop_token_ids` and stop strings):

1. While the stopping token would be one of the first `min_tokens` output tokens, nothing stops the
   request but the length limit (the sampler also bans EOS and stop ids there).
2. EOS stops (reason STOP, stop_reason None) unless `ignore_eos`; `ignore_eos` touches EOS only.
3. A token in `stop_token_ids` stops (STOP, stop_reason = that id), `ignore_eos` or not.
4. A stop string completed by this token's text stops (STOP, stop_reason = the string).
5. Otherwise `max_tokens` output tokens, or the context length, stop with LENGTH.

A stop (2-4) wins over the length limit on the same token: the output was cut by the stop, which is
what OpenAI's finish_reason "stop" says (vLLM behaves the same). The text of the stopping token or
string is left out of the output unless `include_stop_str_in_output` (the detokenizer applies that).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.request import FinishReason, SamplingParams


@dataclass(frozen=True)
class FinishDecision:
    """The verdict for one output token.

    reason: STOP or LENGTH (ABORT and ERROR are not decided here).
    stop_reason: the stop token id (int) or stop string (str) that matched; None for EOS or LENGTH.
    """

    reason: FinishReason
    stop_reason: int | str | None = None

    @property
    def by_token(self) -> bool:
        """The token itself stopped the request (EOS or a stop token id), not its text."""
        return self.reason is FinishReason.STOP and not isinstance(self.stop_reason, str)


def stops_count(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether EOS, stop ids and stop strings may end the request at output token number
    `num_output_tokens` (1-based, the token being judged included): only past `min_tokens`."""
    return num_output_tokens > params.min_tokens


def decide_finish(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    max_model_len: int,
    eos_token_ids: frozenset[int],
    stop_string: str | None = None,
) -> FinishDecision | None:
    """Whether, and why, a request ends with this output token.

    params: the request's sampling parameters.
    token_id: the output token being judged (the last one appended).
    num_output_tokens: output tokens so far, this one included (>= 1).
    num_tokens: prompt + output tokens so far, this one included.
    max_model_len: the model's context length in tokens.
    eos_token_ids: the model's end-of-sequence ids.
    stop_string: a stop string that the text up to and including this token completes, if the
        detokenizer found one (the scheduler, which sees no text, passes None).
    Returns None when the request goes on.
    """
    if num_output_tokens < 1:
        raise ValueError(f"num_output_tokens must be >= 1, got {num_output_tokens}")
    if stops_count(params, num_output_tokens):
        if not params.ignore_eos and token_id in eos_token_ids:
            return FinishDecision(FinishReason.STOP, None)
        if token_id in params.stop_token_ids:
            return FinishDecision(FinishReason.STOP, token_id)
        if stop_string is not None:
            return FinishDecision(FinishReason.STOP, stop_string)
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return FinishDecision(FinishReason.LENGTH, None)
    return None

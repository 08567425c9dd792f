"""Continuous-batching scheduler: a per-step token budget, running requests first, then waiting ones.

Plain Python. Each `schedule()` returns a SchedulerOutput; the engine runs it and hands the sampled
tokens back through `update_from_output()`. Long prompts are split into chunks (chunked prefill);
when blocks run out the most recently admitted running request is preempted and later recomputed.

While any running request is decoding, a step's prefill tokens (all prompt chunks together) are capped
at `long_prefill_token_threshold`: a step's time grows with its tokens, so one 2048-token chunk beside
32 decodes would hold every stream's next token for the whole chunk (ITL spikes). With no decode
running the whole budget goes to prompts (time to first token of a burst is unchanged). vLLM's
`long_prefill_token_threshold` caps each request's chunk; ours caps the step's prefill share, which
also bounds many short prompts arriving together. Except for a burst: while at least as many waiting
prompts can be admitted (free seats under max_num_seqs) as streams decode, the step admits those that
finish their prefill in it up to the whole budget (a prompt already running, e.g. the rest of a long
one, keeps the cap). A waiting prompt longer than what is left of the budget gets only what is left of
the ordinary cap after the prompts before it, and those behind it wait (first come, first served, as
vLLM fills its budget): admitting each long prompt of a burst with the rest of the budget and then
trickling it at the cap behind the older ones made every prompt finish late and every step beside the
decodes a whole-budget one (issue 49: 8 users x 3,000-token prompts, TTFT p50 14.2 s against vLLM's
7.8 s; docs/benchmarks.md, "Long prompts: a burst's long prompts get the cap, oldest first"). Trickling W
waiting prompts in at one cap per step delays each of them by the steps before its turn, more in all
than one long step delays the D <= W running streams once (32 users over a shared prefix: the
13th..32nd prompts waited ~20 capped steps, 3.7 s, and those steps held every stream's next token,
ITL p99 0.16-0.25 s). The rule is applied step by step: a burst larger than one step's budget ends when
its admitted prompts, now decoding, outnumber those still waiting, as the same argument says it should
(keeping it going measured ITL p99 2-3x worse at 32 users on an fp32 CPU: docs/benchmarks.md, "CPU: an
AVX2-only AMD EPYC"). With `burst_bound` (server/core/burst_bound.py, `--burst-itl-factor` f, 16 by
default) a burst step is bounded by its measured cost, not by the budget alone: it takes at most the
prompt tokens that keep it within f quiet decode steps of its streams, and never fewer than the
ordinary cap. A whole-budget step is seconds long for a 1B model on 2 cores and held every running
stream's next token (issue 49: 64 users x 128-token prompts on the Llama-3.2-1B shape, ITL p99 16 s
against llama-server's 0.26 s); split into such steps a burst's prompts lose at most 1/f of their
prefill rate by the cost line (burst_bound.py's
docstring), but at f = 4 on that shape the real steps lost more (TTFT p50 1.8x, throughput 0.53x while
ITL p99 fell 16 -> 3.3 s: smaller steps cost more per row than the line says); at f = 16 ITL p99 fell
8.4 -> 2.2 s with TTFT p50 0.87x and the same throughput, hence 16 by default. f x the quiet step grows
with the running streams (~1.8 s at 64 on that shape), so the step is also bounded in seconds
(`--burst-itl-seconds`, 0.5 by default; burst_bound.py, "Why seconds too").

Long prefills: with a measured cap (`prefill_cap`, server/core/prefill_cap.py; on CPU by default) whose
`min_prompt_tokens` is set, a prompt admitted with more uncached tokens than that takes, beside decodes,
at most the measured cap in each of its chunks to the last (within the ordinary share, whose rest a short
prompt next in line may take): such a prefill holds the streams for its whole length, tens of seconds at 8k,
so its chunks are sized for the streams' ITL, while a short prompt's few steps are not. A burst's long prompt
that ends its prefill in the step is admitted as the burst rule says. A waiting long prompt that finds no long
share left waits, and the prompts behind it with it (first come, first served, as in a burst): long prompts
prefill one after another beside the streams. With `min_prompt_tokens` 0 the
measured cap replaces the ordinary share for every prompt.

Waiting order and preemption victims follow `--scheduling-policy` (server/core/request_queue.py): fcfs,
or priority (`Request.priority`, lower first, FCFS within a level). Under priority a waiting request
that finds no seat (max_num_seqs) or no blocks preempts running requests of a strictly worse level (worst
first, even ones already scheduled in this step, whose tokens go back to the budget) and is admitted in
the same step; a running request that needs blocks preempts the worst running request, never a better
one than itself.

Pooling requests (`Request.pooling`: embed, score) share the queue, the token budget and max_num_seqs
with generation: each is a prompt scheduled whole in one step (never chunked: its forward keeps no KV to
continue from), holds no KV blocks, and finishes in `update_from_output` right after its forward. With
`pooling_step_tokens` (--pooling-step-tokens) a step takes pooling inputs only while they fit that many
tokens (the first whatever its length): the pooling engine's budget is the model's whole context (a
longest input must fit a step), so 64 texts arriving together ran as one step and all 64 answered at its
end (Qwen3-Embedding-0.6B shape on 2 cores: p50 9.0 s against vLLM's 4.4 s, docs/benchmarks-log.md);
in steps of the target the first answers come after a fraction of the work, and a step of a few hundred
tokens is still wide enough for the GEMMs (measured: docs/benchmarks-log.md, "Pooling steps of a token
target").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from server.core.burst_bound import BurstBound
from server.core.finish import decide_finish
from server.core.kv_cache_manager import ComputedBlocks, KVCacheManager
from server.core.outputs import (
    ModelOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    StepTokenHistogram,
)
from server.core.prefill_cap import AdaptivePrefillCap
from server.core.request_queue import SCHEDULING_POLICIES, RequestQueue, SchedulingPolicy
from server.request import FinishReason, Request, RequestStatus
from server.spec_decode.stats import SpecDecodingStats


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    max_loras: int = 0  # distinct LoRA adapters among running requests; 0 = LoRA disabled
    # While decodes run, at most this many prompt tokens per step (0 = no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    scheduling_policy: SchedulingPolicy = "fcfs"  # vLLM's --scheduling-policy (request_queue.py)
    # Pooling inputs per step while they fit this many tokens (a step's first runs whatever its length);
    # 0 = the whole budget (module docstring, "pooling").
    pooling_step_tokens: int = 0

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        if self.pooling_step_tokens < 0:
            raise ValueError(f"pooling_step_tokens must be >= 0, got {self.pooling_step_tokens}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


@dataclass(frozen=True)
class FinishedRequest:
    request: Request
    reason: FinishReason


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        prefill_cap: AdaptivePrefillCap | None = None,
        burst_bound: BurstBound | None = None,
    ) -> None:
        """`prefill_cap`: the prefill share cap sized from measured step costs (core/prefill_cap.py),
        asked once per step instead of `config.long_prefill_token_threshold`. `burst_bound`: the cost
        bound of a burst step (core/burst_bound.py); None = a burst may take the whole budget."""
        self.config = config
        self.prefill_cap = prefill_cap
        self.burst_bound = burst_bound
        self.kv = kv_cache
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._last_batched_tokens = 0
        self.last_prefill_cap = 0  # the cap the last step applied (0: none, no decodes)
        self.last_long_prefill_cap = 0  # the long prefills' share the last step applied (0: none)
        # Requests whose prefill runs under the long share (admitted with more uncached tokens than the
        # measured cap's min_prompt_tokens) until it ends, they are preempted or they finish.
        self._long_prefills: set[str] = set()
        self.iteration_tokens = StepTokenHistogram()
        self.spec_stats = SpecDecodingStats()

    # ---- intake -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.check_priority(request.priority)
        if request.pooling is not None:
            self._check_pooling(request)
            self.requests[request.request_id] = request
            self.waiting.add(request)
            return
        limit = request.num_prompt_tokens + request.sampling_params.max_tokens
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the model's context is "
                f"{self.config.max_model_len} tokens"
            )
        if not self.kv.can_ever_fit(min(limit, self.config.max_model_len)):
            raise ValueError(
                f"prompt + max_tokens = {limit} tokens can never fit in the KV cache "
                f"({self.kv.pool.num_blocks} blocks of {self.kv.block_size} tokens)"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def check_priority(self, priority: int) -> None:
        """Raises ValueError for a request priority this scheduler does not honour (vLLM refuses a
        non-zero priority unless --scheduling-policy is priority)."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs --scheduling-policy priority (this server schedules fcfs)"
            )

    def _check_pooling(self, request: Request) -> None:
        n = request.num_prompt_tokens
        if n > self.config.max_model_len:
            raise ValueError(f"input has {n} tokens; the model takes at most {self.config.max_model_len}")
        if n > self.config.max_num_batched_tokens:
            raise ValueError(
                f"input has {n} tokens; a pooling input runs whole in one step of at most "
                f"{self.config.max_num_batched_tokens} tokens (--max-num-batched-tokens)"
            )
        types = request.pooling.token_type_ids if request.pooling is not None else None
        if types is not None and len(types) != n:
            raise ValueError(f"token_type_ids has {len(types)} entries for {n} tokens")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        now = time.monotonic()
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        threshold = self.config.long_prefill_token_threshold
        measured = self.prefill_cap.cap(decoding) if self.prefill_cap is not None and decoding else 0
        long_min = self.prefill_cap.config.min_prompt_tokens if self.prefill_cap is not None else 0
        long_only = long_min > 0
        if measured and not long_only:
            threshold = measured
        self.last_prefill_cap = threshold if decoding else 0
        # Prompt tokens this step may still take (the cap applies only beside running decodes).
        # (Without chunked prefill a prompt runs whole or not at all: a cap would starve long ones.)
        capped = threshold and decoding and self.config.enable_chunked_prefill
        prefill_left = threshold if capped else budget
        prefill_cap = prefill_left
        # ... of which long prefills' chunks may take this many (module docstring, "Long prefills"): the
        # measured cap, never more than the ordinary share.
        long_capped = bool(measured and long_only and self.config.enable_chunked_prefill)
        long_left = min(measured, prefill_left) if long_capped else prefill_left
        self.last_long_prefill_cap = long_left if long_capped else 0
        # A burst (module docstring): at least as many prompts can be admitted as streams decode. Only
        # the admission of waiting prompts is uncapped; prompts already running keep the cap.
        admissible = min(len(self.waiting), self.config.max_num_seqs - len(self.running))
        burst = capped and admissible >= decoding

        # Tokens each request was given in this step so far (drafts included) and the prompt share of
        # them: what goes back to the budget if a priority preemption takes it out again.
        given: dict[str, tuple[int, int]] = {}

        def take_back(victim: Request) -> bool:
            """Preempt `victim`; returns whether it came before index i of the running list."""
            nonlocal budget, prefill_left, long_left
            before = self.running.index(victim) < i
            self.running.remove(victim)
            if victim.request_id in given:
                tokens, prompt = given.pop(victim.request_id)
                scheduled[:] = [s for s in scheduled if s.request is not victim]
                budget += tokens
                prefill_left += prompt
                long_left += prompt
            self._preempt(victim)
            preempted.append(victim.request_id)
            return before

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            assert req.pooling is None, "a pooling request finishes in the step that schedules it"
            remaining = req.num_tokens - req.num_computed_tokens
            assert remaining > 0, "a running request always has at least one token to compute"
            if remaining == 1:
                self._long_prefills.discard(req.request_id)
            share = long_left if remaining > 1 and req.request_id in self._long_prefills else prefill_left
            if remaining > 1 and share <= 0:
                i += 1  # a prompt chunk beyond this step's prefill share: next step
                continue
            num_new = min(remaining, budget, share) if remaining > 1 else 1
            spec = self._drafts_to_verify(req, num_new, budget)
            blocks = self.kv.allocate_slots(req, num_new + len(spec))
            if blocks is None and spec:
                spec = ()  # short of blocks: drop the drafts before preempting anybody
                blocks = self.kv.allocate_slots(req, num_new)
            while blocks is None:
                victim = self.waiting.victim(self.running)  # fcfs: the last admitted; priority: the worst
                if take_back(victim):
                    i -= 1
                if victim is req:
                    break
                blocks = self.kv.allocate_slots(req, num_new)
            if blocks is None:
                break
            scheduled.append(self._scheduled(req, num_new, blocks, spec))
            budget -= num_new + len(spec)
            prompt = num_new if remaining > 1 else 0
            prefill_left -= prompt
            long_left -= prompt
            given[req.request_id] = (num_new + len(spec), prompt)
            i += 1
        growth_preempted = bool(preempted)
        i = len(self.running)  # from here on every running request counts as before the index

        def make_room(req: Request) -> bool:
            """Priority policy: preempt the worst running request if its level is strictly worse than
            req's; whether one was."""
            if self.config.scheduling_policy != "priority" or not self.running:
                return False
            victim = self.waiting.victim(self.running)
            if victim.priority <= req.priority:
                return False
            take_back(victim)
            return True

        # Admit waiting requests only when no running request had to be preempted to grow: otherwise they
        # would thrash. (A priority preemption to admit a better level does not stop admissions.)
        # A request whose adapter would exceed max_loras distinct adapters in the batch waits (skipped,
        # keeping its place) while the requests behind it may still be admitted.
        running_loras = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        # What is left of the ordinary cap after the prompts before: all that a burst gives a prompt that
        # cannot finish its prefill in this step (module docstring).
        cap_left = prefill_left
        if burst:
            prefill_left = prefill_cap = budget
            bound = self.burst_bound.tokens(decoding) if self.burst_bound is not None else None
            if bound is not None:  # never below the ordinary cap (module docstring)
                prefill_left = prefill_cap = min(budget, max(bound, cap_left))
        pooled = 0  # pooling tokens in this step
        w = 0
        while w < len(self.waiting) and budget > 0 and prefill_left > 0 and not growth_preempted:
            req = self.waiting[w]
            while len(self.running) >= self.config.max_num_seqs and make_room(req):
                pass
            if len(self.running) >= self.config.max_num_seqs:
                break
            if (
                req.lora is not None
                and req.lora.lora_int_id not in running_loras
                and len(running_loras) >= self.config.max_loras
            ):
                w += 1
                continue
            if req.pooling is not None:
                # Whole or not at all, in arrival order; beyond the prefill cap only as the step's first
                # prompt, so a pooling input longer than the cap still runs beside decodes.
                n = req.num_prompt_tokens
                if n > budget or (n > prefill_left and prefill_left < prefill_cap):
                    break
                target = self.config.pooling_step_tokens
                if target and pooled and pooled + n > target:
                    break
                pooled += n
                del self.waiting[w]
                self._admit(req, None, now)
                self.running.append(req)
                scheduled.append(self._scheduled(req, n, []))
                given[req.request_id] = (n, n)
                budget -= n
                prefill_left -= n
                long_left -= n
                cap_left -= n
                continue
            # Prompt logprobs need every prompt position computed, so such requests skip the cache.
            use_cache = req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None
            computed = self.kv.get_computed_blocks(req) if use_cache else None
            num_cached = computed.num_tokens if computed else 0
            num_new = req.num_tokens - req.num_computed_tokens - num_cached
            if num_new > min(budget, prefill_left) and not self.config.enable_chunked_prefill:
                break
            # A long prefill (more uncached tokens than the measured cap's min_prompt_tokens) takes at most
            # the long share beside decodes, except as a burst's prompt that ends its prefill in this step.
            uncached = num_new
            is_long = 0 < long_min < uncached
            long = long_capped and is_long
            finishes_in_burst = burst and num_new <= min(budget, prefill_left)
            if burst and num_new > prefill_left:
                if cap_left <= 0:
                    break  # FCFS: nobody behind a long prompt overtakes it
                num_new = cap_left
            num_new = min(num_new, budget, prefill_left)
            if long and not finishes_in_burst:
                if long_left <= 0:
                    break  # FCFS, as above
                num_new = min(num_new, long_left)
            blocks = self.kv.allocate_slots(req, num_new, computed)
            while blocks is None and make_room(req):
                blocks = self.kv.allocate_slots(req, num_new, computed)
            if blocks is None:
                break
            del self.waiting[w]
            if req.lora is not None:
                running_loras.add(req.lora.lora_int_id)
            self._admit(req, computed, now)
            if is_long and num_new < uncached:  # its prefill goes on in later steps
                self._long_prefills.add(req.request_id)
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new, blocks))
            given[req.request_id] = (num_new, num_new)
            budget -= num_new
            prefill_left -= num_new
            long_left -= num_new
            cap_left -= num_new

        finished, self._finished_ids = self._finished_ids, []
        num_batched = self.config.max_num_batched_tokens - budget
        self._last_batched_tokens = num_batched
        if num_batched:
            self.iteration_tokens.observe(num_batched)
        return SchedulerOutput(scheduled, num_batched, preempted, finished)

    def _scheduled(
        self, req: Request, num_new: int, blocks: list[int], spec: tuple[int, ...] = ()
    ) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request=req,
            num_new_tokens=num_new + len(spec),
            start=start,
            block_ids=tuple(blocks),
            sample=start + num_new == req.num_tokens,
            spec_token_ids=spec,
            group_block_ids=self.kv.group_block_ids(req.request_id),
        )

    def _drafts_to_verify(self, req: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """The request's proposed tokens that fit this step: only for a decode row (one known token
        left), within the token budget, the context length and max_tokens (the last token of a request
        never needs a draft: the target's own token covers it)."""
        if not req.spec_token_ids or num_new != 1:
            return ()
        room = min(
            budget - 1,
            self.config.max_model_len - req.num_tokens - 1,
            req.sampling_params.max_tokens - len(req.output_token_ids) - 1,
        )
        return tuple(req.spec_token_ids[: max(room, 0)])

    def _admit(self, req: Request, computed: ComputedBlocks | None, now: float) -> None:
        if computed is not None:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += computed.num_tokens
            req.num_computed_tokens = computed.num_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = computed.num_tokens
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self._long_prefills.discard(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(req)

    # ---- results ------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, output: ModelOutput) -> list[FinishedRequest]:
        """Advance every scheduled request; returns those that finished in this step."""
        finished: list[FinishedRequest] = []
        now = time.monotonic()
        for item in sched.scheduled:
            req = item.request
            if req.is_finished:  # aborted while the step ran
                continue
            # Prompt tokens recomputed after a preemption are not new prompt work for the counters.
            prompt_part = max(0, min(item.start + item.num_new_tokens, req.num_prompt_tokens) - item.start)
            if req.num_preemptions == 0:
                self.num_prompt_tokens += prompt_part
            num_drafts = len(item.spec_token_ids)
            req.num_computed_tokens = item.start + item.num_new_tokens - num_drafts
            if req.request_id in output.errors:
                req.error = output.errors[req.request_id]
                self.finish_request(req.request_id, FinishReason.ERROR)
                finished.append(FinishedRequest(req, FinishReason.ERROR))
                continue
            if req.pooling is not None:  # its forward was all of it: nothing is sampled or kept
                self.finish_request(req.request_id, FinishReason.STOP)
                finished.append(FinishedRequest(req, FinishReason.STOP))
                continue
            if not item.sample:
                continue
            if num_drafts:
                tokens = output.accepted_token_ids[req.request_id]
                self.spec_stats.observe(num_drafts, len(tokens) - 1)
            else:
                tokens = [output.sampled_token_ids[req.request_id]]
            if req.first_token_time is None:
                req.first_token_time = now
            for token in tokens:  # an accepted run stops at the first token that ends the request
                req.output_token_ids.append(token)
                self.num_generation_tokens += 1
                reason = self._check_stop(req, token)
                if reason is not None:
                    self.finish_request(req.request_id, reason)
                    finished.append(FinishedRequest(req, reason))
                    break
            if num_drafts and not req.is_finished:
                # The verified row computed the last known token and the drafts; the accepted drafts'
                # KV is valid, the rejected drafts' slots are given back.
                req.num_computed_tokens = item.start + len(tokens)
                self.kv.free_excess(req)
        return finished

    def discard_output_tail(self, req: Request, num_tokens: int) -> None:
        """Forget the last num_tokens outputs of a request that a stop string ended inside an accepted
        run of speculative tokens: they were never generated as far as the client is concerned."""
        if num_tokens > 0:
            del req.output_token_ids[-num_tokens:]
            self.num_generation_tokens -= num_tokens

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        decision = decide_finish(
            req.sampling_params,
            token,
            len(req.output_token_ids),
            req.num_tokens,
            self.config.max_model_len,
            req.eos_token_ids,
        )
        if decision is None:
            return None
        req.stop_reason = decision.stop_reason
        return decision.reason

    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None
    ) -> Request | None:
        """End a request now (stop string, abort, error). Idempotent; unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(request_id)
        self._long_prefills.discard(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if stop_reason is not None:
            req.stop_reason = stop_reason
        self._finished_ids.append(request_id)
        return req

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=sum(g.pool.num_free_blocks for g in self.kv.groups),
            num_total_blocks=sum(g.pool.num_blocks for g in self.kv.groups),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_batched_tokens=self._last_batched_tokens,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_stats.accepted_per_pos),
            running_lora_adapters=tuple(sorted({r.lora.name for r in self.running if r.lora is not None})),
            waiting_lora_adapters=tuple(sorted({r.lora.name for r in self.waiting if r.lora is not None})),
            iteration_tokens=self.iteration_tokens.snapshot(),
        )

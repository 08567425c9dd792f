"""Draft-model proposer (`{"model": <path or hub id>, "num_speculative_tokens": k}`; vLLM's
`draft_model` method; Leviathan et al. 2023): a small model with the target's vocabulary runs k greedy
steps per speculating request, and the target verifies them as it does n-gram drafts.

Design (the simplest correct one we found):
- The draft has its own paged KV cache: per layer `k_cache`, `v_cache` of
  `[num_blocks, block_size, draft_kv_heads, draft_head_dim]`, the target's block size and block count,
  in the draft's own `core.block_pool.BlockPool` (the same allocate/free rules, prefix caching off).
  Its block tables are its own: they never have to mirror the target's, so preemption, prefix-cache
  hits and freed lookahead slots on the target side need nothing here.
- The draft catches up lazily. Per request it remembers how many known tokens its cache covered when
  it last ran (`num_known`) and which drafts it fed after them; the next time, the prefix of those
  drafts the target accepted is still valid KV, and every later known token (the rest of the prompt on
  the first call, the target's correction or bonus token) is fed in one multi-token row before the
  first draft step. A request whose draft state is gone (preempted, new) is simply caught up from 0.
- Drafts are the draft's argmax at each step: a point-mass proposal q, which is what
  `rejection_sampler.verify_drafts` assumes (accept with p(x), resample from p without x), so the
  output stays distributed exactly as the target's for sampled rows and equals plain greedy for greedy
  rows. (Sampled drafts with their q would accept more often at high temperature; not done.)
- A request's draft blocks are freed when it leaves the running set (finish, abort, preemption:
  `retain`) or is aborted between steps (`drop`). When the draft's pool is short, a request gets no
  drafts that step (its draft state is freed): speculation never preempts anybody.

Costs: k draft forward passes per engine step (the first one also carrying any catch-up tokens), the
draft's KV cache on top of `--kv-cache-memory`. The draft is loaded by `server.models.loader` with the
target's dtype and without `--quantize`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from server.attention import AttentionBackend
from server.attention.kv_cache_dtype import allocate_kv_cache, check_int8_kv_cache
from server.core.block_pool import BlockPool
from server.core.outputs import ScheduledRequest, SchedulerOutput
from server.models.llama import LlamaForCausalLM
from server.models.loader import LoadedModel, ModelLoadError, load_gguf_model, load_model, resolve_model
from server.models.serving_weights import prepare_for_serving
from server.request import Request
from server.spec_decode.config import SpeculativeConfig
from server.tokenizer import Tokenizer
from server.worker.input_batch import build_forward_batch

log = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _DraftState:
    """What the draft's KV cache holds for one request: positions [0, num_known) with the request's
    known tokens, then `fed` draft tokens at num_known, num_known + 1, ..."""

    block_ids: list[int]
    num_known: int
    fed: list[int]

    def valid_len(self, req: Request) -> int:
        """Positions whose cached KV was computed from the request's actual tokens."""
        n = min(self.num_known, req.num_tokens)
        for d in self.fed:
            if n >= req.num_tokens or req.token_at(n) != d:
                break
            n += 1
        return n


class DraftModelProposer:
    """Proposes up to k tokens per request with a draft model over its own paged KV cache."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,  # the target's --kv-cache-dtype: the draft's cache follows it
        device: torch.device,
        k: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.k = k
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, enable_caching=False)
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches: list[tuple[Tensor, Tensor]] = [
            (
                allocate_kv_cache(*shape, kv_cache_dtype, device),
                allocate_kv_cache(*shape, kv_cache_dtype, device),
            )
            for _ in range(cfg.num_layers)
        ]
        self._states: dict[str, _DraftState] = {}
        self.num_forward_passes = 0  # cumulative draft forward passes (benchmarks, tests)

    # ---- block bookkeeping --------------------------------------------------------------------
    def drop(self, request_ids: Iterable[str]) -> None:
        """Free the draft blocks of these requests (unknown ids are ignored)."""
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if state is not None and state.block_ids:
                self.pool.free(list(reversed(state.block_ids)))

    def retain(self, request_ids: set[str]) -> None:
        """Free the draft blocks of every request not in request_ids (finished, aborted, preempted)."""
        self.drop([rid for rid in self._states if rid not in request_ids])

    @property
    def num_held_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    # ---- proposing ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_ks: Sequence[int]) -> list[list[int]]:
        """Draft tokens for each request (at most max_ks[i], and k; [] when none could be made).
        Every request must be in decode: its target KV covers all but its last known token."""
        out: list[list[int]] = [[] for _ in requests]
        rows: list[tuple[int, Request, _DraftState, int, int]] = []  # (index, req, state, start, steps)
        for i, (req, max_k) in enumerate(zip(requests, max_ks, strict=True)):
            # Draft j (1-based) is fed at position num_tokens + j - 2; the last one is never fed.
            steps = min(max_k, self.k, self.max_model_len - req.num_tokens)
            if steps < 1:
                continue
            state = self._states.get(req.request_id)
            start = min(state.valid_len(req), req.num_tokens - 1) if state else 0
            blocks = state.block_ids if state else []
            need = _cdiv(req.num_tokens + steps - 1, self.block_size)
            if need > len(blocks):
                new = self.pool.allocate(need - len(blocks))
                if new is None:  # the draft cache is full: no drafts for this request this step
                    self.drop([req.request_id])
                    continue
                blocks = blocks + new
            state = _DraftState(blocks, req.num_tokens, [])
            self._states[req.request_id] = state
            rows.append((i, req, state, start, steps))
        if not rows:
            return out

        # Step 1: the tokens the draft has not seen (at least the last known one) -> draft 1.
        items = [
            ScheduledRequest(req, req.num_tokens - start, start, tuple(state.block_ids), True)
            for _, req, state, start, _ in rows
        ]
        for (i, *_), token in zip(rows, self._argmax(items), strict=True):
            out[i].append(token)
        # Steps 2..k: feed draft j - 1 at position num_tokens + j - 2 -> draft j.
        for j in range(2, max(steps for *_, steps in rows) + 1):
            active = [r for r in rows if r[4] >= j]
            items = []
            for i, req, state, _, _ in active:
                view = dataclasses.replace(req, output_token_ids=[*req.output_token_ids, *out[i]])
                items.append(ScheduledRequest(view, 1, view.num_tokens - 1, tuple(state.block_ids), True))
                state.fed.append(out[i][-1])
            for (i, *_), token in zip(active, self._argmax(items), strict=True):
                out[i].append(token)
        return out

    def _argmax(self, items: list[ScheduledRequest]) -> list[int]:
        """One draft forward pass over rows that each end at the token to predict from."""
        sched = SchedulerOutput(items, sum(it.num_new_tokens for it in items))
        batch = build_forward_batch(sched, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, self.backend)
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))  # [rows, V]
        self.num_forward_passes += 1
        return logits.argmax(-1).tolist()


def check_same_vocabulary(
    draft: LoadedModel, draft_folder: Path, target: LoadedModel, tokenizer: Tokenizer
) -> None:
    """Raises ModelLoadError unless the draft's token ids mean what the target's mean: the same number
    of embedding rows and, when the draft ships a tokenizer, the same token -> id table."""
    dv, tv = draft.arch.vocab_size, target.arch.vocab_size
    if dv != tv:
        raise ModelLoadError(
            f"the speculative draft model's vocabulary has {dv} tokens, the target's {tv}: "
            "a draft model must use the target's tokenizer"
        )
    has_tokenizer = any((draft_folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    if has_tokenizer and Tokenizer(draft_folder).hf.get_vocab() != tokenizer.hf.get_vocab():
        raise ModelLoadError(
            f"the speculative draft model's tokenizer ({draft_folder}) maps tokens to other ids than "
            "the target's: a draft model must use the target's tokenizer"
        )


def load_draft_proposer(
    config: SpeculativeConfig,
    target: LoadedModel,
    tokenizer: Tokenizer,
    backend: AttentionBackend,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    device: torch.device,
    cache_dir: Path | None = None,
    keep_gguf: bool = False,
    optimize_weights: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
    gemm_dtype: torch.dtype | None = None,
) -> DraftModelProposer:
    """Loads `config.model` with the target's loader and dtype (a GGUF draft stays quantized when the
    target is served from GGUF: `keep_gguf`, its tensors laid out for `gemm_dtype`, the engine's GEMM
    dtype that apply_gemm_dtype then sets on it (None: `auto`'s); fused/pre-packed like the target with
    `optimize_weights`) and checks its vocabulary. Its KV cache has `kv_cache_dtype` (None: the target's
    dtype). Raises ModelLoadError."""
    assert config.model is not None
    source = resolve_model(config.model, cache_dir, keep_gguf=keep_gguf)
    if source.gguf is not None:
        draft = load_gguf_model(source.gguf, source.folder, device, max_model_len, cache_dir, gemm_dtype)
    else:
        draft = load_model(source.folder, target.dtype, device, max_model_len)
    check_same_vocabulary(draft, source.folder, target, tokenizer)
    try:
        check_int8_kv_cache(
            kv_cache_dtype or target.dtype,
            getattr(backend, "decode_kernel", None),
            draft.model.config.head_dim,
            f"the draft model {source.model_id}",
        )
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if optimize_weights:
        prepare_for_serving(draft.model, device, draft.dtype, cache_dir)
    log.info(
        "speculative draft model %s: %s, %.1f M parameters, %d layers",
        source.model_id,
        draft.arch.architecture,
        draft.num_parameters / 1e6,
        draft.arch.num_layers,
    )
    return DraftModelProposer(
        draft.model,
        backend,
        num_blocks,
        block_size,
        kv_cache_dtype or target.dtype,
        device,
        config.num_speculative_tokens,
        max_model_len,
    )

"""Owns the model, the KV cache tensors and the attention backend; runs one SchedulerOutput."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from server.attention import AttentionBackend, int8_kv
from server.attention.kv_cache_dtype import allocate_kv_cache
from server.core.kv_groups import KVLayout
from server.core.outputs import Logprob, ModelOutput, SchedulerOutput, TokenLogprobs
from server.lora.manager import LoRAManager
from server.models.llama import LlamaForCausalLM
from server.spec_decode.rejection_sampler import verify_drafts
from server.structured import StructuredOutputManager
from server.worker.cpu_sampling import try_load_cpu_sampling
from server.worker.input_batch import ForwardBatch, build_forward_batch
from server.worker.sampler import Sampler, SamplerOutput, SamplingRow

log = logging.getLogger(__name__)


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's K and V over all layers, for a cache of `dtype` (--kv-cache-dtype): a bf16
    or fp16 cache fits twice the blocks of an fp32 one in the same --kv-cache-memory, an int8 one (with
    its scales, int8_kv.py) 32 / 9 times."""
    cfg = model.config
    if dtype == torch.int8:
        return 2 * cfg.num_layers * int8_kv.block_bytes(block_size, cfg.num_kv_heads, cfg.head_dim)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    # False on tensor-parallel ranks >= 1: they run the forward pass and its collectives, rank 0 samples.
    is_driver = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,  # the caches' element type (kv_cache_dtype.py), not the model's
        device: torch.device,
        structured: StructuredOutputManager | None = None,
        lora: LoRAManager | None = None,
        logprobs_mode: str = "raw_logprobs",
        layout: KVLayout | None = None,
    ) -> None:
        """`layout`: the KV layer groups (server/core/kv_groups.py): each layer's caches get its group's
        block count and its Attention reads its group's tables; None: one group of `num_blocks`."""
        self.model = model
        self.lora = lora  # wraps the model's projections; None = LoRA disabled
        self.backend = backend
        self.block_size = block_size
        self.device = device
        cfg = model.config
        if layout is not None:
            if len(layout.layer_group) != cfg.num_layers:
                raise ValueError(f"layout: {len(layout.layer_group)} layers, the model has {cfg.num_layers}")
            for layer, g in zip(model.decoder_layers(), layout.layer_group, strict=True):
                layer.self_attn.kv_group = g
        self.layout = layout
        self.kv_caches: list[tuple[Tensor, Tensor]] = []
        for i in range(cfg.num_layers):
            n = num_blocks if layout is None else layout.layer_num_blocks(i)
            self.kv_caches.append(
                (
                    allocate_kv_cache(n, block_size, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype, device),
                    allocate_kv_cache(n, block_size, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype, device),
                )
            )
        self.logprobs_mode = logprobs_mode
        # The compiled argmax (greedy rows' tokens) where the model has the fused CPU ops built with AVX-512
        ops = model.fused_ops if device.type == "cpu" else None
        argmax = ops.argmax_rows if ops is not None and ops.argmax_vectorized else None
        # Sampled rows in one compiled call on CPU (temperature, top-k/p, min-p and the draw)
        sampling = try_load_cpu_sampling() if device.type == "cpu" else None
        self.sampler = Sampler(logprobs_mode, argmax=argmax, cpu_sampling=sampling)
        self._prompt_lps: dict[str, list[TokenLogprobs | None]] = {}
        self.structured = structured

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        for rid in sched.finished_request_ids + sched.preempted_request_ids:
            self._prompt_lps.pop(rid, None)
        if self.structured is not None:
            self.structured.drop(sched.finished_request_ids)
        out = ModelOutput()
        if sched.is_empty:
            return out
        batch = build_forward_batch(sched, self.block_size, self.device)
        if self.lora is not None:
            rows = zip(batch.request_ids, batch.lora_requests, batch.attn.query_lens_cpu, strict=True)
            out.errors.update(self.lora.prepare(list(rows)).errors)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, self.backend)
        self._prompt_logprobs(sched, hidden, out)
        if not batch.sampled_request_ids and not batch.spec_request_ids:
            return out
        indices = batch.logits_indices
        if batch.spec_request_ids:
            indices = torch.cat([indices, batch.spec_logits_indices])
        logits = self.model.compute_logits(hidden.index_select(0, indices))
        if not self.is_driver:  # tensor-parallel ranks >= 1 take part in the collectives only
            return out
        num_plain = len(batch.sampled_request_ids)
        if num_plain:
            self._sample(sched, batch, logits[:num_plain], out)
        if batch.spec_request_ids:
            self._verify(sched, logits[num_plain:], out)
        return out

    def _verify(self, sched: SchedulerOutput, logits: Tensor, out: ModelOutput) -> None:
        """Speculating rows, in batch order; logits: [sum(k_i + 1), V], each row's k_i + 1 together."""
        offset = 0
        for item in sched.scheduled:
            if not item.spec_token_ids:
                continue
            req, k = item.request, len(item.spec_token_ids)
            rows = logits[offset : offset + k + 1]
            offset += k + 1
            try:
                out.accepted_token_ids[req.request_id] = verify_drafts(rows, req, item.spec_token_ids)
            except Exception as e:
                log.exception("verification failed for request %s", req.request_id)
                out.errors[req.request_id] = f"sampling failed: {type(e).__name__}: {e}"

    def _sample(self, sched: SchedulerOutput, batch: ForwardBatch, logits: Tensor, out: ModelOutput) -> None:
        by_id = {item.request.request_id: item.request for item in sched.scheduled}
        rows = [SamplingRow(by_id[rid]) for rid in batch.sampled_request_ids]
        model_logits: Tensor | None = None
        if self.structured is not None:
            if self.logprobs_mode.startswith("raw_") and any(
                r.params.logprobs is not None and r.params.structured is not None for r in rows
            ):
                model_logits = logits.clone()  # raw logprobs are the model's own, before the mask
            # Grammar-constrained rows: forbidden tokens to -inf; a row whose grammar state failed is
            # failed alone and not sampled.
            failed = self.structured.apply(logits, [r.request for r in rows])
            if failed:
                out.errors.update(failed)
                keep = [i for i, r in enumerate(rows) if r.request.request_id not in failed]
                rows = [rows[i] for i in keep]
                logits = logits[keep]
                if model_logits is not None:
                    model_logits = model_logits[keep]
                if not rows:
                    return
        try:
            result = self._call_sampler(logits, rows, model_logits)
            pairs = list(zip(rows, result.token_ids, result.logprobs, strict=True))
        except Exception:
            # Isolate the failing request(s): the rest of the batch samples as usual.
            log.exception("batched sampling failed; retrying row by row")
            pairs = []
            for i, row in enumerate(rows):
                try:
                    own = None if model_logits is None else model_logits[i : i + 1]
                    r = self._call_sampler(logits[i : i + 1], [row], own)
                    pairs.append((row, r.token_ids[0], r.logprobs[0]))
                except Exception as e:
                    out.errors[row.request.request_id] = f"sampling failed: {type(e).__name__}: {e}"
        for row, token, lp in pairs:
            rid = row.request.request_id
            out.sampled_token_ids[rid] = token
            if lp is not None:
                out.logprobs[rid] = lp

    def _call_sampler(
        self, logits: Tensor, rows: list[SamplingRow], model_logits: Tensor | None
    ) -> SamplerOutput:
        # The model's own logits go along only when a mask changed them (raw logprobs under a grammar).
        if model_logits is None:
            return self.sampler(logits, rows)
        return self.sampler(logits, rows, model_logits)

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: Tensor, out: ModelOutput) -> None:
        offset = 0
        for item in sched.scheduled:
            req, n = item.request, item.num_new_tokens
            rows_start = offset
            offset += n
            num_top = req.sampling_params.prompt_logprobs
            if num_top is None or item.start >= req.num_prompt_tokens:
                continue
            if item.start == 0:
                self._prompt_lps[req.request_id] = [None]
            acc = self._prompt_lps.setdefault(req.request_id, [None])
            # Row j predicts token start + j + 1; keep those that are still prompt tokens.
            last = min(item.start + n, req.num_prompt_tokens - 1)
            if last > item.start:
                h = hidden[rows_start : rows_start + (last - item.start)]  # [m, H]
                lp = self.model.compute_logits(h).float().log_softmax(-1)  # [m, V] fp32
                targets = torch.tensor(
                    [req.prompt_token_ids[p + 1] for p in range(item.start, last)], device=lp.device
                )  # [m]
                chosen = lp.gather(1, targets[:, None])  # [m, 1]
                ranks = ((lp > chosen).sum(-1) + 1).tolist()  # [m]
                top_vals, top_ids = torch.topk(lp, num_top, dim=-1) if num_top else (None, None)  # [m, k]
                for j, (tid, value, rank) in enumerate(
                    zip(targets.tolist(), chosen.squeeze(1).tolist(), ranks, strict=True)
                ):
                    top: list[Logprob] = []
                    if top_vals is not None and top_ids is not None:
                        top = [
                            Logprob(int(t), float(v), r + 1)
                            for r, (t, v) in enumerate(
                                zip(top_ids[j].tolist(), top_vals[j].tolist(), strict=True)
                            )
                        ]
                    acc.append(TokenLogprobs(Logprob(int(tid), float(value), int(rank)), top))
            if item.start + n >= req.num_prompt_tokens:
                out.prompt_logprobs[req.request_id] = self._prompt_lps.pop(req.request_id)

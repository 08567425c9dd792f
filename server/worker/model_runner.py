"""Owns the model, the KV cache tensors and the attention backend; runs one SchedulerOutput."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from server.attention import AttentionBackend
from server.core.outputs import ModelOutput, SchedulerOutput
from server.lora.manager import LoRAManager
from server.models.llama import LlamaForCausalLM
from server.worker.input_batch import ForwardBatch, build_forward_batch
from server.worker.sampler import Sampler, SamplingRow

log = logging.getLogger(__name__)


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # wraps the model's projections; None = LoRA disabled
        self.backend = backend
        self.block_size = block_size
        self.device = device
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches: list[tuple[Tensor, Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.sampler = Sampler()
        self._prompt_lps: dict[str, list[float | None]] = {}

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        for rid in sched.finished_request_ids + sched.preempted_request_ids:
            self._prompt_lps.pop(rid, None)
        out = ModelOutput()
        if sched.is_empty:
            return out
        batch = build_forward_batch(sched, self.block_size, self.device)
        if self.lora is not None:
            rows = zip(batch.request_ids, batch.lora_requests, batch.attn.query_lens_cpu, strict=True)
            out.errors.update(self.lora.prepare(list(rows)).errors)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, self.backend)
        self._prompt_logprobs(sched, hidden, out)
        if not batch.sampled_request_ids:
            return out
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        self._sample(sched, batch, logits, out)
        return out

    def _sample(self, sched: SchedulerOutput, batch: ForwardBatch, logits: Tensor, out: ModelOutput) -> None:
        by_id = {item.request.request_id: item.request for item in sched.scheduled}
        rows = [SamplingRow(by_id[rid]) for rid in batch.sampled_request_ids]
        try:
            result = self.sampler(logits, rows)
            pairs = list(zip(rows, result.token_ids, result.logprobs, strict=True))
        except Exception:
            # Isolate the failing request(s): the rest of the batch samples as usual.
            log.exception("batched sampling failed; retrying row by row")
            pairs = []
            for i, row in enumerate(rows):
                try:
                    r = self.sampler(logits[i : i + 1], [row])
                    pairs.append((row, r.token_ids[0], r.logprobs[0]))
                except Exception as e:
                    out.errors[row.request.request_id] = f"sampling failed: {type(e).__name__}: {e}"
        for row, token, lp in pairs:
            rid = row.request.request_id
            out.sampled_token_ids[rid] = token
            if lp is not None:
                out.logprobs[rid] = lp

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: Tensor, out: ModelOutput) -> None:
        offset = 0
        for item in sched.scheduled:
            req, n = item.request, item.num_new_tokens
            rows_start = offset
            offset += n
            if not req.sampling_params.prompt_logprobs or item.start >= req.num_prompt_tokens:
                continue
            if item.start == 0:
                self._prompt_lps[req.request_id] = [None]
            acc = self._prompt_lps.setdefault(req.request_id, [None])
            # Row j predicts token start + j + 1; keep those that are still prompt tokens.
            last = min(item.start + n, req.num_prompt_tokens - 1)
            if last > item.start:
                h = hidden[rows_start : rows_start + (last - item.start)]
                lp = self.model.compute_logits(h).log_softmax(-1)
                targets = torch.tensor(
                    [req.prompt_token_ids[p + 1] for p in range(item.start, last)], device=lp.device
                )
                acc.extend(lp.gather(1, targets[:, None]).squeeze(1).tolist())
            if item.start + n >= req.num_prompt_tokens:
                out.prompt_logprobs[req.request_id] = self._prompt_lps.pop(req.request_id)

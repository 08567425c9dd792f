"""Running our model over one whole sequence outside the engine: calibration (server.quantize) and
accuracy checks (perplexity, top-1 agreement, KL divergence) for the tests and benchmarks/quantization.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from server.attention.torch_backend import TorchAttentionBackend
from server.models.llama import DecoderLayer, LlamaForCausalLM
from server.worker.input_batch import AttentionMetadata

# Original prose, never used for calibration (server/quantize/calibration.py is the calibration text).
HELDOUT_TEXT = """\
On the morning of the fair, the whole village was awake before the sun. Farmers led their cattle down the \
lane, children carried baskets of eggs and apples, and the baker had been up since three, filling the long \
wooden tables with loaves, pies and sticky buns. By nine o'clock the square was so crowded that the brass band \
could barely find room to play.

Water boils at one hundred degrees Celsius at sea level, but at lower temperatures high in the mountains, \
because the air pressure there is lower. This is why cooking pasta or eggs takes longer at altitude: the water \
is boiling, but it is not as hot as it would be at the coast. Pressure cookers work the other way round, \
raising the pressure so that the water can get hotter before it boils.

The library had moved three times in its long history. It began in a single room above the town hall, with a \
few hundred books donated by a retired schoolteacher. Later it took over an old church, and finally, thanks to \
a generous gift from a local family, it moved into the bright modern building by the river, where students \
now study late into the evening.

When you learn a new language, it helps to practise a little every day rather than a lot once a week. Read \
short stories, listen to the radio, and try to speak with native speakers whenever you can, even if you make \
mistakes. Most people find that understanding comes before speaking, and that confidence grows slowly, then \
all at once.

The storm reached the coast just after midnight. Trees bent low in the wind, the power failed across half the \
city, and the river rose higher than anyone could remember. In the morning, neighbours gathered in the streets \
to clear fallen branches and check on the elderly, and by the evening most of the lights were back on.
"""


def _single_sequence_metadata(num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    blocks = math.ceil(num_tokens / block_size)
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None, :],
        context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens,
        max_context_len=num_tokens,
        query_lens_cpu=(num_tokens,),
        context_lens_cpu=(num_tokens,),
    )


class SequenceRunner:
    """One causal prefill of a single sequence through our model, layer by layer if needed.

    Uses the engine's torch attention backend over a private KV cache that every layer reuses (each layer
    stores its K/V before it attends, and nothing survives between layers), so calibration sees exactly the
    model the server runs.
    """

    def __init__(self, model: LlamaForCausalLM, num_tokens: int, block_size: int = 16) -> None:
        cfg = model.config
        self.model = model
        self.num_tokens = num_tokens
        device = model.model.norm.weight.device
        dtype = model.model.norm.weight.dtype
        self.meta = _single_sequence_metadata(num_tokens, block_size, device)
        self.backend = TorchAttentionBackend(block_size)
        shape = (math.ceil(num_tokens / block_size), block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.arange(num_tokens, dtype=torch.int64, device=device)

    def embed(self, input_ids: Tensor) -> Tensor:  # input_ids: [T] -> [T, hidden]
        return self.model.model.embed_tokens(input_ids)

    def attention(self, layer: DecoderLayer, x: Tensor) -> Tensor:  # x: [T, hidden] (normed) -> [T, hidden]
        cos, sin = self.model.rotary.cos_sin(self.positions, x.dtype)  # [T, 1, head_dim] each
        return layer.self_attn(x, cos, sin, self.k_cache, self.v_cache, self.meta, self.backend)

    def layer(self, layer: DecoderLayer, h: Tensor) -> Tensor:  # h: [T, hidden] -> [T, hidden]
        h = h + self.attention(layer, layer.input_layernorm(h))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @torch.inference_mode()
    def logits(self, input_ids: Tensor) -> Tensor:  # input_ids: [T] -> [T, vocab] fp32
        h = self.embed(input_ids)
        for layer in self.model.decoder_layers():
            h = self.layer(layer, h)
        return self.model.compute_logits(self.model.model.norm(h))


@dataclass(frozen=True)
class SequenceScores:
    nll: Tensor  # [T - 1] fp32, negative log-likelihood of token t + 1 given tokens 0..t
    argmax: Tensor  # [T - 1] int64, the model's top-1 prediction at each position

    @property
    def perplexity(self) -> float:
        return float(torch.exp(self.nll.mean()))


def score_sequence(model: LlamaForCausalLM, input_ids: Tensor) -> SequenceScores:  # input_ids: [T] int64
    runner = SequenceRunner(model, int(input_ids.numel()))
    logits = runner.logits(input_ids)[:-1]  # [T-1, vocab]
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(1, input_ids[1:, None]).squeeze(1)
    return SequenceScores(nll=nll, argmax=logits.argmax(dim=-1))


def top1_agreement(a: SequenceScores, b: SequenceScores, num_tokens: int = 256) -> float:
    """Share of positions (teacher-forced on the same text) where both models' greedy choice is the same."""
    n = min(num_tokens, a.argmax.numel(), b.argmax.numel())
    return float((a.argmax[:n] == b.argmax[:n]).float().mean())


def sequence_logprobs(model: LlamaForCausalLM, input_ids: Tensor) -> Tensor:  # input_ids: [T] int64
    """Teacher-forced next-token log-probabilities [T - 1, vocab] fp32 (row t predicts token t + 1)."""
    logits = SequenceRunner(model, int(input_ids.numel())).logits(input_ids)[:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def mean_kl(reference: Tensor, other: Tensor) -> float:  # both: [T, vocab] fp32 log-probabilities
    """Mean over positions of KL(reference || other) in nats/token: how far a quantized model's whole
    next-token distribution moved, a steadier measure than a short text's perplexity (whose ratio moved
    by +-2% between equally large random weight perturbations on the embedded model)."""
    return float((reference.exp() * (reference - other)).sum(dim=-1).mean())

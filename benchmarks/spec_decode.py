"""Speculative decoding on vs off, in the same process, interleaved: output tokens/s of the engine on
workloads where the output repeats its input (edit a given text, continue a repetitive code file), for
one user and for 16 at once. Prints JSON with the acceptance rate and the tokens emitted per
verification row.

    python benchmarks/spec_decode.py [--k 3 --new-tokens 128 --reps 3 --users 1,16]
    python benchmarks/spec_decode.py --method draft_model --draft-layers 4   # draft: the target's first 4 layers
    python benchmarks/spec_decode.py --method draft_model --draft PATH       # any same-vocabulary draft

The embedded SmolLM2-135M has no smaller sibling with its vocabulary, so --draft-layers builds one: a
copy of the target truncated to its first N layers (same embeddings, final norm and head; no training,
so its proposals are weaker than a real distilled draft's). --draft-layers 0 uses the target itself as
its own draft (acceptance ~1 for greedy: an upper bound on acceptance, not a speed-up on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import server  # noqa: F401  (CPU runtime settings before torch loads)

TEXTS = [
    "The old lighthouse stood on the northern cliff for more than a century. Every night its keeper climbed "
    "the spiral stairs, trimmed the wick and polished the great lens until it shone. Ships passing the rocky "
    "coast trusted its steady beam, and the fishermen of the village said that as long as the light turned, "
    "no storm could take them. When the keeper grew old, his daughter learned the work, and she kept the "
    "light burning through the long winter when the supply boat could not reach the island.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and "
    "water. It takes place mainly in the leaves, inside small structures called chloroplasts, which contain "
    "the green pigment chlorophyll. The process releases oxygen as a by-product, and that oxygen is what "
    "most living things breathe. Without photosynthesis there would be no food chains on land and very "
    "little oxygen in the air.",
    "Our team meets every Monday at nine to plan the week. Each member reports what they finished, what "
    "they are working on and what is blocking them. The notes go into the shared document, and the action "
    "items are assigned an owner and a due date. On Fridays we review the action items and move anything "
    "unfinished to the next week, so that nothing is forgotten.",
]
CODE = """class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def add(self, other):
        return Point(self.x + other.x, self.y + other.y)

    def sub(self, other):
        return Point(self.x - other.x, self.y - other.y)

    def mul(self, other):
        return Point(self.x * other.x, self.y * other.y)

"""


def prompts_for(tok, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append(tok.encode(CODE + "class Vector:\n    def __init__(self, x, y):\n"))
        else:
            text = TEXTS[i % 3]
            msg = f"Repeat the following text word for word, changing nothing:\n\n{text}"
            out.append(tok.apply_chat_template([{"role": "user", "content": msg}]))
    return out


def truncated_copy(folder: str, layers: int, out: str) -> str:
    """The HF checkpoint in `folder` with only its first `layers` decoder layers (0 = all), into out."""
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    model.save_pretrained(out)
    for f in Path(folder).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, Path(out) / f.name)
    return out


def run(engine, prompts: list[list[int]], new_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    from server.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", p, params)
    generated, steps = 0, 0
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            generated += len(o.new_token_ids)
            outs.append(o.new_token_ids)
        steps += 1
    dt = time.perf_counter() - t0
    after = engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "output_tokens_per_s": generated / dt,
        "seconds": dt,
        "steps": steps,
        "output_tokens": generated,
        "acceptance_rate": accepted / proposed if proposed else None,
        "tokens_per_verified_row": 1 + accepted / drafts if drafts else None,
        "drafts": drafts,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    p.add_argument("--draft", default=None, help="draft model folder (draft_model; default: --draft-layers)")
    p.add_argument(
        "--draft-layers", type=int, default=4, help="draft = the target's first N layers (0: the target)"
    )
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=3)
    p.add_argument("--lookup-min", type=int, default=1)
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--users", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()

    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.spec_decode.config import SpeculativeConfig

    def make(spec: SpeculativeConfig | None) -> LLMEngine:
        e = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=args.model, dtype="float32"),
                cache=CacheConfig(kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False),
                num_threads=args.num_threads,
                speculative=spec,
            )
        )
        e.warmup()
        return e

    if args.method == "ngram":
        spec = SpeculativeConfig(
            "ngram",
            args.k,
            prompt_lookup_min=args.lookup_min,
            prompt_lookup_max=args.lookup_max,
            disable_by_batch_size=args.disable_by_batch_size,
        )
    else:
        import tempfile

        from server.models.loader import resolve_model

        draft = args.draft or truncated_copy(
            str(resolve_model(args.model).folder), args.draft_layers, tempfile.mkdtemp(prefix="draft-")
        )
        spec = SpeculativeConfig(
            "draft_model", args.k, model=draft, disable_by_batch_size=args.disable_by_batch_size
        )
    off, on = make(None), make(spec)
    import platform

    load = os.getloadavg()
    result: dict = {
        "config": vars(args),
        "cpu": platform.processor() or platform.machine(),
        "load_average_at_start": [round(x, 1) for x in load],
        "note": "machine shared with other engineers' processes: compare the interleaved ratios only",
        "workloads": {},
    }
    for users in (int(u) for u in args.users.split(",")):
        prompts = prompts_for(off.tokenizer, users)
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for rep in range(args.reps):
            order = [("off", off), ("on", on)] if rep % 2 == 0 else [("on", on), ("off", off)]
            for name, engine in order:
                runs[name].append(run(engine, prompts, args.new_tokens))
        ratios = [
            a["output_tokens_per_s"] / b["output_tokens_per_s"]
            for a, b in zip(runs["on"], runs["off"], strict=True)
        ]
        med = {n: statistics.median(r["output_tokens_per_s"] for r in rs) for n, rs in runs.items()}
        last_on = runs["on"][-1]
        result["workloads"][f"{users}_users"] = {
            "off_tokens_per_s": round(med["off"], 1),
            "on_tokens_per_s": round(med["on"], 1),
            "speedup_median": round(statistics.median(ratios), 3),
            "speedups": [round(r, 3) for r in ratios],
            "steps_off": runs["off"][-1]["steps"],
            "steps_on": last_on["steps"],
            "tokens_per_step_off": round(runs["off"][-1]["output_tokens"] / runs["off"][-1]["steps"], 2),
            "tokens_per_step_on": round(last_on["output_tokens"] / last_on["steps"], 2),
            "acceptance_rate": round(last_on["acceptance_rate"] or 0.0, 3),
            "tokens_per_verified_row": round(last_on["tokens_per_verified_row"] or 0.0, 2),
            "output_tokens": last_on["output_tokens"],
        }
    result["load_average_at_end"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The baseline for benchmarks/serve_load.py: the FastAPI app people write first, calling transformers
`generate` once per request (no batching across requests, no paged KV cache). It speaks just enough of
TGI's API for the load generator: POST /generate_stream (SSE, one event per token), POST /generate,
GET /ready.

    python benchmarks/naive_app.py --port 8081 [--model HF_FOLDER] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The same OpenMP wait policy as our server (measured: it serves this app as well as PASSIVE does).
import server  # noqa: F401

# isort: split

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer


def build_app(model_folder: str, dtype: torch.dtype) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model: Any = AutoModelForCausalLM.from_pretrained(model_folder, dtype=dtype)
    model.eval()
    app = FastAPI(title="naive transformers server")

    def params_of(body: dict[str, Any]) -> tuple[torch.Tensor, int]:
        ids = tokenizer(body["inputs"], return_tensors="pt").input_ids
        return ids, int((body.get("parameters") or {}).get("max_new_tokens") or 20)

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/generate")
    def generate(body: dict[str, Any]) -> JSONResponse:
        # A plain `def` route: FastAPI runs it on its thread pool, one generate() per request.
        ids, max_new = params_of(body)
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_new, do_sample=False)
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        return JSONResponse({"generated_text": text})

    @app.post("/generate_stream")
    async def generate_stream(request: Request) -> StreamingResponse:
        body = await request.json()
        ids, max_new = params_of(body)
        tokens: queue.SimpleQueue[int | None] = queue.SimpleQueue()

        class Streamer(BaseStreamer):
            """Hands each new token id to the response as generate() produces it."""

            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: torch.Tensor) -> None:
                if not self.prompt_seen:  # generate() first puts the prompt
                    self.prompt_seen = True
                    return
                for tid in value.reshape(-1).tolist():
                    tokens.put(int(tid))

            def end(self) -> None:
                tokens.put(None)

        def run() -> None:
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=max_new, do_sample=False, streamer=Streamer())

        threading.Thread(target=run, daemon=True).start()

        async def events() -> AsyncIterator[bytes]:
            out: list[int] = []
            while True:
                tid = await asyncio.to_thread(tokens.get)
                if tid is None:
                    break
                out.append(tid)
                event = {
                    "index": len(out),
                    "token": {
                        "id": tid,
                        "text": tokenizer.decode([tid]),
                        "logprob": None,
                        "special": tid in tokenizer.all_special_ids,
                    },
                    "generated_text": None,
                    "details": None,
                }
                yield f"data:{json.dumps(event)}\n\n".encode()
            final = {
                "generated_tokens": len(out),
                "finish_reason": "length" if len(out) >= max_new else "eos_token",
            }
            text = tokenizer.decode(out, skip_special_tokens=True)
            yield f"data:{json.dumps({'index': len(out), 'generated_text': text, 'details': final})}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="HF folder; default: the embedded SmolLM2 (converted folder)"
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    folder = args.model
    if folder is None:
        from server.models.loader import resolve_model

        folder = str(resolve_model(None).folder)
    app = build_app(folder, getattr(torch, args.dtype))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

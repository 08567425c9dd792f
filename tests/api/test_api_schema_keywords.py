"""JSON-schema keywords on the live server (issue 30 item 1): every row of the keyword table that is
refused answers 400 on OpenAI routes and 422 on TGI's, naming the keyword, before the engine; rows
that are accepted are enforced: sampled outputs (temperature 1, several seeds) validate with
`jsonschema`. The table and the grammar-level evidence: tests/engine/test_engine_schema_keywords.py."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from conftest import SERVED_NAME, LiveServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_engine_schema_keywords import ROWS

REFUSED = [(r[0], r[1], r[4]) for r in ROWS if r[4] is not None]
# Accepted rows whose outputs a model can get wrong, sampled in a prompt that tempts it to.
ENFORCED = {
    "maxLength": {"type": "string", "maxLength": 2},
    "pattern": {"type": "string", "pattern": "^a+$"},
    "format-date": {"type": "string", "format": "date"},
    "exclusiveMaximum": {"type": "integer", "minimum": -3, "exclusiveMaximum": 3},
    "maxItems": {"type": "array", "items": {"type": "integer"}, "maxItems": 1},
    "oneOf-discriminator": next(r[1] for r in ROWS if r[0] == "oneOf-discriminator"),
    "additionalProperties-false": next(r[1] for r in ROWS if r[0] == "additionalProperties-false"),
}


@pytest.mark.parametrize(("schema", "keyword"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_api_schema_keyword_refused_by_name(live_server: LiveServer, schema: Any, keyword: str) -> None:
    before = live_server.llm.scheduler.stats().num_prompt_tokens
    chat = httpx.post(
        f"{live_server.url}/v1/chat/completions",
        json={
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
        timeout=60,
    )
    assert chat.status_code == 400, chat.text
    err = chat.json()["error"]
    assert err["param"] == "response_format" and re.search(rf"\b{re.escape(keyword)}\b", err["message"]), err
    comp = httpx.post(
        f"{live_server.url}/v1/completions",
        json={"model": SERVED_NAME, "prompt": "hi", "structured_outputs": {"json": schema}},
        timeout=60,
    )
    assert comp.status_code == 400 and keyword in comp.json()["error"]["message"], comp.text
    tgi = httpx.post(
        f"{live_server.url}/generate",
        json={"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": schema}}},
        timeout=60,
    )
    assert tgi.status_code == 422 and keyword in tgi.json()["error"], tgi.text
    assert live_server.llm.scheduler.stats().num_prompt_tokens == before


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENFORCED))
def test_api_schema_keyword_enforced_when_sampled(live_server: LiveServer, name: str) -> None:
    schema = ENFORCED[name]

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(base_url=live_server.url, timeout=300) as client:

            async def one(seed: int) -> str | None:
                r = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": SERVED_NAME,
                        "messages": [
                            {"role": "user", "content": "Write a long JSON value, break the rules."}
                        ],
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": name, "schema": schema},
                        },
                        "temperature": 1.0,
                        "seed": seed,
                        "max_tokens": 48,
                    },
                )
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                if choice["finish_reason"] != "stop":  # cut by max_tokens: incomplete JSON, not judged
                    return None
                return str(choice["message"]["content"])

            return await asyncio.gather(*(one(seed) for seed in range(6)))

    texts = [t for t in asyncio.run(run()) if t is not None]
    assert len(texts) >= 3
    cls = jsonschema.validators.validator_for(schema)
    for text in texts:
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(text))

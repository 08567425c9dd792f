"""The README's promised errors, replayed: every row of its documented-errors table (between the
`<!-- documented-errors -->` markers) is sent to the live server, which must answer with the row's
status, `param` (OpenAI's error object; TGI's has none) and a message containing the row's text, and
must not have run the request. A statement added to the table is checked from then on."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SERVED_NAME, LiveServer

README = Path(__file__).resolve().parents[2] / "README.md"

BASE: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    },
    "/v1/completions": {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": SERVED_NAME, "input": "hi", "max_output_tokens": 4},
    "/generate": {"inputs": "hi", "parameters": {"max_new_tokens": 4}},
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _cell(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] == "`" else text


def documented_errors() -> list[tuple[str, dict[str, Any], int, str | None, str]]:
    """(route, body extras, status, param or None, message fragment) per row of the README's table."""
    m = re.search(r"<!-- documented-errors -->\n(.*?)<!-- /documented-errors -->", README.read_text(), re.S)
    assert m, "README.md lost its documented-errors table"
    rows = []
    for line in m.group(1).splitlines()[2:]:  # header and separator first
        cells = [_cell(c) for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, f"a documented-errors row needs 5 cells: {line}"
        route, body, status, param, fragment = cells
        assert route in BASE, f"no base request for {route}"
        rows.append((route, json.loads(body), int(status), None if param == "-" else param, fragment))
    assert rows, "the documented-errors table is empty"
    return rows


ROWS = documented_errors()


@pytest.mark.parametrize(("route", "extra", "status", "param", "fragment"), ROWS)
def test_api_documented_errors_hold(
    live_server: LiveServer, route: str, extra: dict[str, Any], status: int, param: str | None, fragment: str
) -> None:
    before = live_server.llm.scheduler.stats().num_prompt_tokens
    r = httpx.post(f"{live_server.url}{route}", json=_merge(BASE[route], extra), timeout=60)
    assert r.status_code == status, r.text
    body = r.json()
    if route.startswith("/v1/"):
        err = body["error"]
        assert err["type"] == "BadRequestError"
        assert fragment in err["message"], err
        assert err["param"] == param, err
    else:
        assert body["error_type"] == "validation"
        assert fragment in body["error"], body
    assert live_server.llm.scheduler.stats().num_prompt_tokens == before  # refused before the engine

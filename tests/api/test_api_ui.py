"""The chat playground at GET / in a real browser: Debian's Chromium, headless, driven by Playwright.

Streams against the real server (greedy text equal to the `openai` client's), stop freeing the KV cache,
the API key flow, server errors shown as sent (real 400, 401, 429, 503), model text never becoming
HTML, the request body every knob produces, keyboard-only use, phone width and both themes.
Screenshots land in $KUBEINFER_ARTIFACTS (default build/artifacts)/playground/.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from conftest import SERVED_NAME, LiveServer
from serving import ThreadedServer, free_port, serve_in_thread

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("KUBEINFER_ARTIFACTS", REPO / "build" / "artifacts")) / "playground"
KEY = "ui-secret-key"
QUESTION = "What is the capital of France?"
# Chromium refuses connections here without the background-networking flags; no sandbox as root in CI.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def chromium_path() -> str | None:
    """Debian's chromium (`apt-get install chromium`), or $KUBEINFER_CHROMIUM."""
    return (
        os.environ.get("KUBEINFER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    exe = chromium_path()
    if exe is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@dataclass
class Tab:
    """A page in a fresh browser context, with what it asked for and any script errors it raised."""

    page: Any
    requests: list[str]
    errors: list[str]


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[..., Tab]]:
    contexts: list[Any] = []
    tabs: list[Tab] = []

    def make(viewport: dict[str, int] = DESKTOP, color_scheme: str = "light", **kw: Any) -> Tab:
        ctx = browser.new_context(viewport=viewport, color_scheme=color_scheme, **kw)
        # Playwright's 30 s default for navigations and waits: Chromium next to server processes on a
        # loaded CI machine can take longer; a passing wait returns as soon as its condition holds.
        ctx.set_default_timeout(120_000)
        contexts.append(ctx)
        page = ctx.new_page()
        tab = Tab(page, [], [])
        page.on("request", lambda r: tab.requests.append(r.url))
        page.on("pageerror", lambda e: tab.errors.append(str(e)))
        page.on("console", lambda m: tab.errors.append(m.text) if m.type == "error" else None)
        tabs.append(tab)
        return tab

    yield make
    for ctx in contexts:
        ctx.close()
    for tab in tabs:
        # no script error and no CSP violation on any page (CSP reports go to the console as errors);
        # the 4xx/5xx the tests cause on purpose show up as failed-resource lines, which are allowed
        real = [e for e in tab.errors if "Failed to load resource" not in e]
        assert not real, real


def goto(tab: Tab, url: str) -> Any:
    page = tab.page
    page.goto(f"{url}/")
    page.wait_for_function("() => document.getElementById('model-status') !== null")
    return page


def wait_models(page: Any) -> None:
    page.wait_for_function("() => document.querySelectorAll('#model option').length > 0")


def wait_idle(page: Any, timeout_ms: float = 120_000) -> None:
    page.wait_for_function(
        "() => !document.querySelector('.msg.streaming') && !document.getElementById('send').disabled",
        timeout=timeout_ms,
    )


def stored_conversation(page: Any) -> dict[str, Any]:
    convs = page.evaluate("JSON.parse(localStorage.getItem('kubeinfer.conversations'))")
    current = page.evaluate("JSON.parse(localStorage.getItem('kubeinfer.current'))")
    conv: dict[str, Any] = next(c for c in convs if c["id"] == current)
    return conv


def stored_messages(page: Any) -> list[dict[str, Any]]:
    """The stored messages on the path shown, first to last (the conversation is a tree of versions)."""
    conv = stored_conversation(page)
    by_id = {m["id"]: m for m in conv["messages"]}
    path: list[dict[str, Any]] = []
    node = by_id.get(conv["leaf"]) if conv["leaf"] is not None else None
    while node is not None:
        path.insert(0, node)
        node = by_id.get(node["parent"]) if node["parent"] is not None else None
    return path


def fill_knobs(page: Any, **knobs: str) -> None:
    for name, value in knobs.items():
        page.fill(f"#{name}", value)


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def sse_body(*chunks: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def delta(text: str) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


# ---- servers without the session's model: loading (503), --no-ui, and a tiny model with --api-key ----
@dataclass
class AppServer:
    url: str
    state: Any
    running: ThreadedServer

    def stop(self) -> None:
        self.running.stop()


def serve_app(config_kw: dict[str, Any], engine_factory: Any = None, load: bool = True) -> AppServer:
    """The real app on a free port; `load=False` keeps it loading for good (no engine, 503s)."""

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import ServerConfig

    port = free_port()
    config = ServerConfig(host="127.0.0.1", port=port, **config_kw)
    state = ServerState(config, engine_factory=engine_factory)
    app = create_app(state, load_on_startup=load)
    until: Literal["ready", "listening"] = "ready" if load else "listening"
    running = serve_in_thread(app, port, name=f"ui-server-{port}", until=until, timeout_s=120)
    return AppServer(running.url, state, running)


@pytest.fixture(scope="module")
def loading_server() -> Iterator[AppServer]:
    srv = serve_app({}, load=False)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_model_factory: Callable[..., Path]) -> Iterator[AppServer]:
    """A tiny random model behind --api-key, at most one request in flight."""
    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine

    engine_cfg = EngineConfig(
        model=ModelConfig(model=str(tiny_model_factory()), dtype="float32", served_model_name="tiny"),
        cache=CacheConfig(num_kv_blocks=32),
        max_num_seqs=4,
        num_threads=1,
    )
    srv = serve_app(
        {"engine": engine_cfg, "api_key": KEY, "max_concurrent_requests": 1},
        engine_factory=lambda: LLMEngine(engine_cfg),
    )
    yield srv
    srv.stop()


# ---- the routes -----------------------------------------------------------------------------------
def test_ui_routes_csp_and_tgi_root(live_server: LiveServer) -> None:
    url = live_server.url
    r = httpx.get(f"{url}/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    for directive in (
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ):
        assert directive in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert '<script src="/ui/app.js"' in r.text and "http" not in re.sub(r'name="viewport"[^>]*', "", r.text)
    js = httpx.get(f"{url}/ui/app.js", timeout=60)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in js.text.replace("never innerHTML", "")
    md = httpx.get(f"{url}/ui/markdown.js", timeout=60)
    assert md.status_code == 200 and md.headers["content-security-policy"] == csp
    assert '<script src="/ui/markdown.js"' in r.text
    for source in (js.text, md.text):  # no HTML parsing of anything: text nodes and createElement only
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser", "eval("):
            assert sink not in source.replace("never innerHTML", ""), sink
    assert httpx.get(f"{url}/ui/style.css", timeout=60).headers["content-security-policy"] == csp
    assert httpx.get(f"{url}/ui/..%2fapp.py", timeout=60).status_code == 404
    assert httpx.get(f"{url}/ui/nope.js", timeout=60).status_code == 404
    # not a browser: 406 pointing at the page and at the generate routes
    r = httpx.get(f"{url}/", headers={"Accept": "application/json"}, timeout=60)
    assert r.status_code == 406 and "POST /" in r.json()["error"]
    # POST / is still TGI's compat route
    r = httpx.post(f"{url}/", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200 and isinstance(r.json(), list) and "generated_text" in r.json()[0]
    # the page is not part of the API's OpenAPI document
    paths = httpx.get(f"{url}/openapi.json", timeout=60).json()["paths"]
    assert "/ui/{name}" not in paths and "get" not in paths["/"]


def test_ui_no_ui_flag_and_env() -> None:
    from server.cli import build_parser, config_from_args

    assert config_from_args(build_parser({}).parse_args([])).ui is True
    assert config_from_args(build_parser({}).parse_args(["--no-ui"])).ui is False
    assert config_from_args(build_parser({"KUBEINFER_UI": "false"}).parse_args([])).ui is False
    assert config_from_args(build_parser({"KUBEINFER_UI": "0"}).parse_args(["--ui"])).ui is True
    srv = serve_app({"ui": False}, load=False)
    try:
        assert httpx.get(f"{srv.url}/", headers={"Accept": "text/html"}, timeout=60).status_code == 405
        assert httpx.get(f"{srv.url}/ui/app.js", timeout=60).status_code == 404
    finally:
        srv.stop()


# ---- streaming against the real model ----------------------------------------------------------------
def test_ui_streams_greedy_text_equal_to_openai_client(
    live_server: LiveServer, open_page: Callable[..., Tab]
) -> None:
    tab = open_page()
    page = goto(tab, live_server.url)
    wait_models(page)
    assert page.input_value("#model") == SERVED_NAME
    fill_knobs(page, temperature="0", max_tokens="24")
    # every rendered state of the streaming reply, to see it grow token by token
    page.evaluate(
        """() => { window.__seen = [];
          new MutationObserver(() => { const b = document.querySelector('.msg.assistant.streaming .body');
            if (b) window.__seen.push(b.textContent); })
          .observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true}); }"""
    )
    send(page, QUESTION)
    wait_idle(page)
    seen = [s for s in page.evaluate("window.__seen") if s]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "live-greedy-reply.png"))
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)
    ref = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24
    )
    expected = ref.choices[0].message.content
    assert expected
    msgs = stored_messages(page)
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[1]["content"] == expected
    assert page.text_content(".msg.assistant .body") == expected  # no code fences in this reply
    # streamed: at least three growing prefixes of the final text were on screen before it completed
    distinct = list(dict.fromkeys(seen))
    assert len(distinct) >= 3, distinct
    assert all(expected.startswith(s) for s in distinct)
    assert all(len(a) < len(b) for a, b in itertools.pairwise(distinct))
    # per-reply stats from the stream's usage
    stats = page.text_content(".msg.assistant .stats") or ""
    assert f"{ref.usage.completion_tokens} tokens" in stats and f"prompt {ref.usage.prompt_tokens}" in stats
    assert re.search(r"TTFT \d+ ms", stats) and re.search(r"[\d.]+ tokens/s", stats), stats
    # only this server was asked for anything
    assert tab.requests and all(u.startswith(live_server.url) for u in tab.requests)
    # the conversation survives a reload (local storage)
    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.text_content(".msg.assistant .body") == expected
    assert QUESTION in (page.text_content("#conversation-list") or "")


def test_ui_stop_aborts_and_frees_kv(live_server: LiveServer, open_page: Callable[..., Tab]) -> None:
    def aborts() -> float:
        text = httpx.get(f"{live_server.url}/metrics", timeout=60).text
        m = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', text, re.M)
        return float(m.group(1)) if m else 0.0

    tab = open_page()
    page = goto(tab, live_server.url)
    wait_models(page)
    # greedy SmolLM2 answers this with ~120 tokens: seconds of streaming on a CPU
    fill_knobs(page, temperature="0", max_tokens="600")
    send(page, "Count from 1 to 500, separated by commas.")
    # first with the Stop button, then the same turn regenerated and stopped with Esc
    for n, how in enumerate(("button", "escape"), start=1):
        before = aborts()
        if how == "escape":
            page.click("#regenerate")
        page.wait_for_function(
            "() => (document.querySelector('.msg.assistant.streaming .body')?.textContent || '').length > 10"
        )
        assert live_server.metric("vllm:kv_cache_usage_perc") > 0
        if how == "button":
            page.click("#stop")
        else:
            page.keyboard.press("Escape")
        wait_idle(page, 10_000)
        assert page.is_disabled("#stop")
        assert "stopped" in (page.text_content(".msg.assistant .stats") or ""), n
        msgs = stored_messages(page)
        assert [m["role"] for m in msgs] == ["user", "assistant"]
        assert msgs[1]["stats"]["stopped"] is True and msgs[1]["stats"]["ttft_ms"] > 0 and msgs[1]["content"]
        assert "finish_reason" not in msgs[1]["stats"]  # no usage chunk: the stream was cut
        # the server saw the disconnect, aborted the request and freed its blocks
        for _ in range(600):  # up to 1 min: the abort lands when the loaded server next runs
            if aborts() == before + 1 and live_server.metric("vllm:num_requests_running") == 0:
                break
            threading.Event().wait(0.1)
        assert aborts() == before + 1, how
        assert live_server.metric("vllm:num_requests_running") == 0
        assert live_server.metric("vllm:kv_cache_usage_perc") == 0


def test_ui_regenerate_and_edit_last_on_real_model(
    live_server: LiveServer, open_page: Callable[..., Tab]
) -> None:
    tab = open_page()
    page = goto(tab, live_server.url)
    wait_models(page)
    fill_knobs(page, temperature="0", max_tokens="8")
    send(page, "Say hello.")
    wait_idle(page)
    first = stored_messages(page)[1]["content"]
    page.click("#regenerate")
    wait_idle(page)
    msgs = stored_messages(page)
    assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[1]["content"] == first  # greedy
    assert page.text_content(".msg.assistant .version-count") == "2/2"  # the first reply is kept
    # "Edit last" opens the last message for editing in place; sending it answers the new version
    page.click("#edit-last")
    assert page.input_value(".msg.user .edit-text") == "Say hello."
    assert page.evaluate("document.activeElement.className") == "edit-text"
    page.fill(".msg.user .edit-text", QUESTION)
    page.click(".msg.user .edit-save")
    wait_idle(page)
    msgs = stored_messages(page)
    assert [m["content"] for m in msgs if m["role"] == "user"] == [QUESTION]
    assert page.text_content(".msg.user .version-count") == "2/2"
    assert page.evaluate("document.activeElement.id") in ("prompt", "send")


# ---- API key ------------------------------------------------------------------------------------
def test_ui_api_key_asked_wrong_refused_right_works(
    keyed_server: AppServer, open_page: Callable[..., Tab]
) -> None:
    url = keyed_server.url
    assert (
        httpx.get(f"{url}/", headers={"Accept": "text/html"}, timeout=60).status_code == 200
    )  # the page is open
    assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 401  # the API is not
    tab = open_page()
    page = goto(tab, url)
    page.wait_for_selector("#auth:not([hidden])")
    server_msg = httpx.get(f"{url}/v1/models", timeout=60).json()["error"]["message"]
    assert server_msg in (page.text_content("#auth-detail") or "")
    assert page.evaluate("document.activeElement.id") == "auth-key"  # asked for, with the focus there
    page.keyboard.type("wrong-key")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "() => document.getElementById('auth-detail').textContent.startsWith('The key was refused')"
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "api-key-refused.png"))
    assert "HTTP 401" in (page.text_content("#auth-detail") or "")
    assert page.locator("#model option").count() == 0
    page.fill("#auth-key", KEY)
    page.press("#auth-key", "Enter")
    wait_models(page)
    assert page.is_hidden("#auth") and page.input_value("#model") == "tiny"
    assert_key_not_stored(page, KEY)
    fill_knobs(page, max_tokens="5", temperature="0")
    send(page, "hi")
    wait_idle(page)
    assert "5 tokens" in (page.text_content(".msg.assistant .stats") or "")
    # a key that stops working mid-conversation: the 401 is shown in the conversation as sent
    # (set without a change event: a change re-lists the models, whose 401 opens the key prompt first,
    # a race with the send that a loaded machine loses)
    page.evaluate("document.getElementById('api-key').value = 'revoked'")
    send(page, "again")
    wait_idle(page)
    err = page.text_content(".msg.error") or ""
    assert "HTTP 401" in err and server_msg in err
    assert all(u.startswith(url) for u in tab.requests)


# ---- errors shown as the server sent them -----------------------------------------------------------
def test_ui_shows_server_errors_as_sent(
    live_server: LiveServer, loading_server: AppServer, keyed_server: AppServer, open_page: Callable[..., Tab]
) -> None:
    # 400: the server's own message for a too-long max_tokens
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}
    r = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    page = goto(open_page(), live_server.url)
    wait_models(page)
    fill_knobs(page, max_tokens=str(10**6))
    send(page, "hi")
    wait_idle(page)
    assert page.text_content(".msg.error .status") == "HTTP 400"
    assert page.text_content(".msg.error .error-text") == r.json()["error"]["message"]
    # 503 while loading: in the model picker and on sending
    page = goto(open_page(), loading_server.url)
    loading_msg = httpx.get(f"{loading_server.url}/v1/models", timeout=60).json()["error"]["message"]
    page.wait_for_function("() => document.getElementById('model-status').textContent.startsWith('HTTP 503')")
    assert loading_msg in (page.text_content("#model-status") or "")
    send(page, "hi")
    wait_idle(page)
    sent = httpx.post(
        f"{loading_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert sent.status_code == 503
    assert page.text_content(".msg.error .status") == "HTTP 503"
    assert page.text_content(".msg.error .error-text") == sent.json()["error"]["message"]
    # 429: the one request slot of the keyed server is taken
    slot = keyed_server.state.admit()
    try:
        tab = open_page()
        page = goto(tab, keyed_server.url)
        page.wait_for_selector("#auth:not([hidden])")
        page.fill("#auth-key", KEY)
        page.press("#auth-key", "Enter")
        wait_models(page)
        send(page, "hi")
        wait_idle(page)
        assert page.text_content(".msg.error .status") == "HTTP 429"
        assert "Model is overloaded" in (page.text_content(".msg.error .error-text") or "")
    finally:
        slot.release()
    # regenerate after an error resends the same turn, and now it works
    fill_knobs(page, max_tokens="3")
    page.click("#regenerate")
    wait_idle(page)
    assert [m["role"] for m in stored_messages(page)] == ["user", "assistant"]
    assert page.locator(".msg.error").count() == 0


# ---- rendering: model text is text ---------------------------------------------------------------------
HOSTILE = (
    'Here you go: <script>window.__pwned = 1</script> and <img src=x onerror="window.__pwned = 2"> '
    'then `<b>inline</b>`\n```html\n<img src=y onerror="window.__pwned = 3"><b>bold</b>\n```\ndone'
)


def test_ui_model_output_never_becomes_html(live_server: LiveServer, open_page: Callable[..., Tab]) -> None:
    tab = open_page()
    page = tab.page
    pieces = [HOSTILE[i : i + 7] for i in range(0, len(HOSTILE), 7)]  # split inside the tags, as tokens are
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200,
            headers={"Content-Type": "text/event-stream"},
            body=sse_body(*[delta(p) for p in pieces], usage_chunk(9, len(pieces))),
        ),
    )
    goto(tab, live_server.url)
    wait_models(page)
    send(page, '<img src=z onerror="window.__pwned = 4">')
    wait_idle(page)
    box = page.locator("#messages")
    assert box.locator("script, img, b").count() == 0
    assert page.evaluate("window.__pwned") is None
    reply = page.text_content(".msg.assistant .body") or ""
    assert "<script>window.__pwned = 1</script>" in reply and 'onerror="window.__pwned = 2"' in reply
    assert page.text_content(".msg.assistant code.inline") == "<b>inline</b>"
    assert (
        page.text_content(".msg.assistant pre.code code")
        == '<img src=y onerror="window.__pwned = 3"><b>bold</b>'
    )
    assert page.get_attribute(".msg.assistant pre.code code", "data-lang") == "html"
    assert page.text_content(".msg.user .body") == '<img src=z onerror="window.__pwned = 4">'
    assert f"{len(pieces)} tokens" in (page.text_content(".msg.assistant .stats") or "")
    # an error event after the stream began: what came is kept, the error is shown as sent
    err = {
        "error": {"message": "the engine failed: boom <i>x</i>", "type": "InternalServerError", "code": 500}
    }
    page.unroute("**/v1/chat/completions")
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=sse_body(delta("partial"), err)
        ),
    )
    send(page, "more")
    wait_idle(page)
    assert page.locator(".msg.assistant .body").last.text_content() == "partial"
    assert page.text_content(".msg.error .status") == "HTTP 500"
    assert page.text_content(".msg.error .error-text") == "the engine failed: boom <i>x</i>"
    assert box.locator("i").count() == 0


# ---- every knob in the request body -----------------------------------------------------------------
def test_ui_request_body_carries_every_knob(live_server: LiveServer, open_page: Callable[..., Tab]) -> None:
    tab = open_page()
    page = tab.page
    bodies: list[dict[str, Any]] = []

    def handle(route: Any) -> None:
        bodies.append(json.loads(route.request.post_data))
        assert route.request.headers.get("authorization") == "Bearer k1"
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse_body(delta("ok")))

    page.route("**/v1/chat/completions", handle)
    goto(tab, live_server.url)
    wait_models(page)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    page.fill("#system", "Be terse.")
    fill_knobs(page, temperature="0.7", top_p="0.9", top_k="40", min_p="0.05", max_tokens="64", seed="7")
    page.fill("#stop-strings", "END\n\nSTOP")
    page.fill("#api-key", "k1")
    page.check("#json-mode")
    page.fill("#json-schema", json.dumps(schema))
    send(page, QUESTION)
    wait_idle(page)
    assert bodies == [
        {
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": QUESTION}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "model": SERVED_NAME,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "max_tokens": 64,
            "seed": 7,
            "stop": ["END", "STOP"],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "playground", "schema": schema, "strict": True},
            },
        }
    ]
    # the next turn carries the history; emptied knobs fall back to the server's defaults (not sent)
    for knob in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "system", "stop-strings"):
        page.fill(f"#{knob}", "")
    page.uncheck("#json-mode")
    send(page, "And Spain?")
    wait_idle(page)
    assert bodies[1] == {
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "And Spain?"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "model": SERVED_NAME,
    }
    # a schema that does not parse is refused in the page, before any request
    page.check("#json-mode")
    page.fill("#json-schema", "{not json")
    send(page, "x")
    wait_idle(page)
    assert len(bodies) == 2
    assert "the JSON schema does not parse" in (page.text_content(".msg.error") or "")
    # the settings survive a reload; the key does not (it is kept in the tab's memory only)
    page.reload()
    wait_models(page)
    assert page.input_value("#api-key") == "" and page.is_checked("#json-mode")


# ---- keyboard, phone width, themes, screenshots ----------------------------------------------------------
def _conversation_fixture() -> str:
    conv = {
        "id": "shot",
        "title": "Capital of France",
        "updated": 0,
        "messages": [
            {"role": "user", "content": "What is the capital of France? And show me a Python hello world."},
            {
                "role": "assistant",
                "content": 'The capital of France is Paris.\n\n```python\nprint("Hello, world!")\n```\n'
                "Run it with `python hello.py`.",
                "stats": {
                    "prompt_tokens": 41,
                    "completion_tokens": 32,
                    "ttft_ms": 84,
                    "tokens_per_s": 27.5,
                    "finish_reason": "stop",
                },
            },
            {"role": "user", "content": "<b>Is this bold?</b>"},
            {
                "role": "assistant",
                "content": "",
                "error": {"status": 429, "text": "Model is overloaded: 1 requests in flight"},
            },
        ],
    }
    return (
        f"localStorage.setItem('kubeinfer.conversations', {json.dumps(json.dumps([conv]))});"
        "localStorage.setItem('kubeinfer.current', '\"shot\"');"
    )


def _luminance(css_color: str) -> float:
    r, g, b = (int(x) for x in re.findall(r"\d+", css_color)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("size", ["desktop", "phone"])
def test_ui_layouts_themes_screenshots(
    live_server: LiveServer, open_page: Callable[..., Tab], size: str, scheme: str
) -> None:
    viewport = DESKTOP if size == "desktop" else PHONE
    tab = open_page(viewport=viewport, color_scheme=scheme, is_mobile=size == "phone")
    tab.page.add_init_script(_conversation_fixture())
    page = goto(tab, live_server.url)
    wait_models(page)
    page.wait_for_selector("pre.code")
    bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert (_luminance(bg) < 0.2) if scheme == "dark" else (_luminance(bg) > 0.9), bg
    # nothing wider than the screen, and the composer in view
    assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
    box = page.locator("#composer").bounding_box()
    assert box is not None and box["y"] + box["height"] <= viewport["height"] + 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"chat-{size}-{scheme}.png"))
    if size == "phone":
        assert page.is_hidden("#settings")
        page.focus("#toggle-settings")
        page.keyboard.press("Enter")
        assert (
            page.is_visible("#settings") and page.get_attribute("#toggle-settings", "aria-expanded") == "true"
        )
        assert page.evaluate("document.activeElement.id") == "system"
        page.screenshot(path=str(ARTIFACTS / f"settings-{size}-{scheme}.png"))
        page.keyboard.press("Escape")
        assert page.is_hidden("#settings") and page.evaluate("document.activeElement.id") == "toggle-settings"
    else:
        assert page.is_visible("#settings") and page.is_visible("#chats")


def test_ui_keyboard_only(live_server: LiveServer, open_page: Callable[..., Tab]) -> None:
    tab = open_page()
    page = tab.page
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200,
            headers={"Content-Type": "text/event-stream"},
            body=sse_body(delta("Paris."), usage_chunk(5, 2)),
        ),
    )
    goto(tab, live_server.url)
    wait_models(page)
    assert page.evaluate("document.activeElement.id") == "prompt"  # ready to type on load
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    page.keyboard.press("Enter")
    wait_idle(page)
    assert stored_messages(page)[0]["content"] == "first line\nsecond line"
    # every control is reachable with Tab, each showing a focus ring
    reached: list[str] = []
    unringed: list[str] = []
    for _ in range(60):
        page.keyboard.press("Tab")
        info = page.evaluate(
            "[document.activeElement.id || document.activeElement.className,"
            " getComputedStyle(document.activeElement).outlineStyle, document.activeElement.tagName]"
        )
        reached.append(info[0])
        if info[1] == "none" and info[2] != "BODY":  # past the last control the focus leaves the page
            unringed.append(info[0])
    for control in (
        "new-chat", "model", "messages", "prompt", "send", "regenerate", "edit-last",
        "system", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop-strings",
        "json-mode", "json-schema", "schema-example", "api-key", "conv-open", "export-chat", "import-file",
        "edit-msg", "regen-msg",
    ):  # fmt: skip
        assert control in reached, (control, reached)
    assert not unringed, unringed
    # regenerate with the keyboard: focus it and press Enter
    page.focus("#regenerate")
    page.keyboard.press("Enter")
    wait_idle(page)
    assert [m["role"] for m in stored_messages(page)] == ["user", "assistant"]


# ---- the API docs and the key: nothing on this origin runs third-party script or finds the key --------
def test_api_docs_load_no_third_party_script(loading_server: AppServer) -> None:
    url = loading_server.url
    # FastAPI's Swagger UI and ReDoc pages load unpinned scripts from a CDN: not served
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        r = httpx.get(f"{url}{path}", headers={"Accept": "text/html"}, timeout=60)
        assert r.status_code == 404, (path, r.status_code)
        assert "cdn" not in r.text.lower() and "<script" not in r.text.lower()
    # the API stays described, as JSON
    r = httpx.get(f"{url}/openapi.json", timeout=60)
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]
    # and no page this server serves names a script from elsewhere
    page = httpx.get(f"{url}/", headers={"Accept": "text/html"}, timeout=60).text
    assert re.findall(r"<script[^>]*>", page) == [
        '<script src="/ui/markdown.js" defer>',
        '<script src="/ui/app.js" defer>',
    ]


STORAGE_DUMP = """() => {
  const all = (s) => Object.keys(s).map((k) => k + "=" + s.getItem(k)).join("\\n");
  return [all(localStorage), all(sessionStorage), document.cookie].join("\\n");
}"""


def assert_key_not_stored(page: Any, key: str) -> None:
    """No storage of this origin (local, session, cookies) holds the key, and nor does the page's HTML."""
    assert key not in page.evaluate(STORAGE_DUMP)
    databases = page.evaluate("indexedDB.databases().then((d) => d.map((x) => x.name))")
    assert databases == []


def test_ui_api_key_kept_from_other_pages_of_the_origin(
    keyed_server: AppServer, open_page: Callable[..., Tab]
) -> None:
    url = keyed_server.url
    tab = open_page()
    # a key that an earlier version left in local storage is removed on load, not used
    tab.page.add_init_script(
        "if (!sessionStorage.getItem('seeded')) { sessionStorage.setItem('seeded', '1');"
        f" localStorage.setItem('kubeinfer.apiKey', {json.dumps(json.dumps(KEY))}); }}"
    )
    page = goto(tab, url)
    page.wait_for_selector("#auth:not([hidden])")
    assert page.evaluate("localStorage.getItem('kubeinfer.apiKey')") is None
    page.fill("#auth-key", KEY)
    page.press("#auth-key", "Enter")
    wait_models(page)
    assert page.input_value("#api-key") == KEY
    assert_key_not_stored(page, KEY)
    # another page of the same origin, in this browser (a new tab) and in this tab (navigated to)
    other = tab.page.context.new_page()
    other.goto(f"{url}/openapi.json")
    assert KEY not in other.evaluate(STORAGE_DUMP)
    other.close()
    page.goto(f"{url}/openapi.json")
    assert KEY not in page.evaluate(STORAGE_DUMP)
    # back on the playground the key is asked for again
    page.goto(f"{url}/")
    page.wait_for_selector("#auth:not([hidden])")
    assert page.input_value("#api-key") == "" and page.locator("#model option").count() == 0
    assert "memory only" in (page.text_content("#auth") or "")


# ---- Markdown, copy, versions, export/import, the schema's example (replies mocked in the browser) -----
def mock_models(page: Any) -> None:
    page.route(
        "**/v1/models",
        lambda route: route.fulfill(status=200, json={"object": "list", "data": [{"id": "mock"}]}),
    )


def mock_replies(page: Any, replies: list[str], piece: int = 0) -> list[dict[str, Any]]:
    """Answers the n-th chat request with replies[n] (streamed in `piece`-character chunks when set)
    and returns the request bodies as they arrive."""
    bodies: list[dict[str, Any]] = []

    def handle(route: Any) -> None:
        bodies.append(json.loads(route.request.post_data))
        text = replies[len(bodies) - 1]
        pieces = [text[i : i + piece] for i in range(0, len(text), piece)] if piece else [text]
        chunks = [delta(p) for p in pieces] + [usage_chunk(7, len(pieces))]
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse_body(*chunks))

    page.route("**/v1/chat/completions", handle)
    return bodies


def mock_tab(open_page: Callable[..., Tab], url: str, replies: list[str], **kw: Any) -> tuple[Any, list[Any]]:
    tab = open_page(**kw)
    mock_models(tab.page)
    bodies = mock_replies(tab.page, replies)
    page = goto(tab, url)
    wait_models(page)
    return page, bodies


HOSTILE_MD = (
    "# Heading *one*\n\n"
    '**bold <i>x</i>** _em_ ~~gone~~ `<img src=a onerror="window.__pwned = 1">` snake_case_name\n\n'
    '- [safe](https://example.com/a?b=1 "title")\n'
    "- [mail](mailto:someone@example.com)\n"
    "- [js](javascript:window.__pwned=2)\n"
    "- [mixed case](JaVaScRiPt:window.__pwned=3)\n"
    "- [tab](java\tscript:window.__pwned=4)\n"
    "- [data](data:text/html,<script>window.__pwned=5</script>)\n"
    "- <javascript:window.__pwned=6>\n"
    "- ![pixel](https://tracker.example/p.png)\n"
    "- [vb](vbscript:msgbox(1))\n"
    "  1. nested *item*\n\n"
    '<img src=x onerror="window.__pwned = 7"><script>window.__pwned = 8</script>\n\n'
    "> quoted <b>text</b>\n\n"
    "```html\n"
    '<img src=y onerror="window.__pwned = 9"><a href="javascript:x">a</a>\n'
    "```\n\n"
    "| h1 | h2 |\n|---|:-:|\n| <b>c</b> | [t](javascript:window.__pwned=10) |\n"
)


def test_ui_markdown_rendered_safely(loading_server: AppServer, open_page: Callable[..., Tab]) -> None:
    tab = open_page()
    page = tab.page
    mock_models(page)
    mock_replies(page, [HOSTILE_MD], piece=5)  # split inside the tags and links, as tokens are
    goto(tab, loading_server.url)
    wait_models(page)
    send(page, "show me markdown")
    wait_idle(page)
    body = page.locator(".msg.assistant .body")
    assert body.locator("h1").text_content() == "Heading one" and body.locator("h1 em").count() == 1
    assert body.locator("strong").text_content() == "bold <i>x</i>"
    assert body.locator("em").nth(1).text_content() == "em" and body.locator("del").text_content() == "gone"
    assert body.locator("code.inline").text_content() == '<img src=a onerror="window.__pwned = 1">'
    assert "snake_case_name" in (body.text_content() or "")  # no emphasis inside words
    # links: http(s) and mailto only, opened apart from this page; the others stay as visible text
    links = body.locator("a")
    hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
    assert hrefs == [
        "https://example.com/a?b=1",
        "mailto:someone@example.com",
        "https://tracker.example/p.png",
    ]
    for i in range(links.count()):
        assert links.nth(i).get_attribute("target") == "_blank"
        assert "noopener" in (links.nth(i).get_attribute("rel") or "")
    text = body.text_content() or ""
    for raw in (
        "[js](javascript:window.__pwned=2)",
        "<javascript:window.__pwned=6>",
        "[vb](vbscript:msgbox(1))",
    ):
        assert raw in text, raw
    assert (
        body.locator("ul > li").count() == 9 and body.locator("ul > li ol > li em").text_content() == "item"
    )
    # raw HTML is text, in paragraphs, quotes, tables and code blocks alike
    assert '<img src=x onerror="window.__pwned = 7"><script>window.__pwned = 8</script>' in text
    assert body.locator("blockquote").text_content() == "quoted <b>text</b>"
    assert body.locator("pre.code code").text_content() == (
        '<img src=y onerror="window.__pwned = 9"><a href="javascript:x">a</a>'
    )
    assert body.locator("pre.code code").get_attribute("data-lang") == "html"
    assert body.locator("th").all_text_contents() == ["h1", "h2"]
    assert body.locator("td").all_text_contents() == ["<b>c</b>", "[t](javascript:window.__pwned=10)"]
    assert page.locator("#messages").locator("script, img, b, i, iframe, object, embed, svg").count() == 0
    for selector in (".unsafe-link", "td >> nth=1"):  # clicking what looks like a link runs nothing
        body.locator(selector).first.click()
    assert page.evaluate("window.__pwned") is None
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "markdown-reply.png"), full_page=True)


def test_ui_copy_buttons(loading_server: AppServer, open_page: Callable[..., Tab]) -> None:
    reply = "Run this:\n\n```bash\necho 'hi <b>'\n```\n\nThen **relax**."
    page, _ = mock_tab(
        open_page, loading_server.url, [reply], permissions=["clipboard-read", "clipboard-write"]
    )
    send(page, "how?")
    wait_idle(page)
    page.click(".msg.assistant .copy-msg")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant .copy-msg').textContent === 'Copied'"
    )
    assert page.evaluate("navigator.clipboard.readText()") == reply  # the reply as the model wrote it
    page.click(".msg.assistant .copy-code")
    assert page.get_attribute(".msg.assistant .copy-code", "aria-label") == "Copy bash code"
    page.wait_for_function("() => document.querySelector('.copy-code').dataset.state === 'copied'")
    assert page.evaluate("navigator.clipboard.readText()") == "echo 'hi <b>'"
    page.click(".msg.user .copy-msg")
    page.wait_for_function("() => document.querySelector('.msg.user .copy-msg').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == "how?"
    # the buttons' labels are not part of the reply's text
    assert "Copy" not in (page.text_content(".msg.assistant .body") or "")


def path_text(page: Any) -> list[str]:
    return [m["content"] for m in stored_messages(page)]


def test_ui_edit_and_regenerate_any_message_keep_versions(
    loading_server: AppServer, open_page: Callable[..., Tab]
) -> None:
    replies = [f"reply {n}" for n in range(1, 9)]
    page, bodies = mock_tab(open_page, loading_server.url, replies)

    def history(n: int) -> list[str]:
        return [m["content"] for m in bodies[n]["messages"]]

    send(page, "Q1")
    wait_idle(page)
    # regenerate the reply: a second version, asked without the first one in the history
    page.click(".msg.assistant .regen-msg")
    wait_idle(page)
    assert path_text(page) == ["Q1", "reply 2"] and history(1) == ["Q1"]
    assert page.text_content(".msg.assistant .version-count") == "2/2"
    assert page.is_disabled(".msg.assistant .version-next")
    page.click(".msg.assistant .version-prev")
    assert path_text(page) == ["Q1", "reply 1"] and page.text_content(".msg.assistant .body") == "reply 1"
    assert page.text_content(".msg.assistant .version-count") == "1/2"
    # the conversation goes on from the version on screen
    send(page, "Q2")
    wait_idle(page)
    assert history(2) == ["Q1", "reply 1", "Q2"]
    # edit the first message: a new version of it, answered; the old one and its turns are kept
    page.locator(".msg.user .edit-msg").first.click()
    page.fill(".edit-text", "Q1 edited")
    assert page.locator(".msg.user").first.locator(".tools").is_hidden()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "editing.png"))
    page.press(".edit-text", "Enter")
    wait_idle(page)
    assert path_text(page) == ["Q1 edited", "reply 4"] and history(3) == ["Q1 edited"]
    assert page.text_content(".msg.user .version-count") == "2/2"
    page.click(".msg.user .version-prev")  # back to the branch that went on
    assert path_text(page) == ["Q1", "reply 1", "Q2", "reply 3"]
    # edit a reply: a new version of it, no request, and the next turn's history carries it
    page.locator(".msg.assistant .edit-msg").last.click()
    page.fill(".edit-text", "reply 3, *corrected*")
    page.click(".edit-save")
    assert len(bodies) == 4
    assert path_text(page) == ["Q1", "reply 1", "Q2", "reply 3, *corrected*"]
    assert page.locator(".msg.assistant").last.locator("em").text_content() == "corrected"
    assert page.locator(".msg.assistant .version-count").last.text_content() == "2/2"
    send(page, "Q3")
    wait_idle(page)
    assert history(4) == ["Q1", "reply 1", "Q2", "reply 3, *corrected*", "Q3"]
    # Escape cancels an edit without a change
    page.locator(".msg.user .edit-msg").last.click()
    page.press(".edit-text", "Escape")
    assert page.locator(".edit-text").count() == 0 and len(bodies) == 5
    # regenerate a reply in the middle: the turns after it stay with the version they followed
    page.locator(".msg.assistant .regen-msg").first.click()
    wait_idle(page)
    assert path_text(page) == ["Q1", "reply 6"] and history(5) == ["Q1"]
    assert page.text_content(".msg.assistant .version-count") == "3/3"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "versions.png"))
    page.click(".msg.assistant .version-prev")
    page.click(".msg.assistant .version-prev")
    assert path_text(page) == ["Q1", "reply 1", "Q2", "reply 3, *corrected*", "Q3", "reply 5"]
    # the top "Regenerate" makes a new version of the last reply; versions survive a reload
    page.click("#regenerate")
    wait_idle(page)
    assert path_text(page)[-1] == "reply 7" and history(6)[-1] == "Q3"
    page.reload()
    wait_models(page)
    assert page.locator(".msg .body").all_text_contents() == [
        "Q1", "reply 1", "Q2", "reply 3, corrected", "Q3", "reply 7",
    ]  # fmt: skip
    assert page.locator(".msg.assistant .version-count").last.text_content() == "2/2"
    page.screenshot(path=str(ARTIFACTS / "versions-reloaded.png"))


def _upload(page: Any, name: str, content: str | bytes) -> str:
    data = content.encode() if isinstance(content, str) else content
    before = page.text_content("#import-status")
    page.set_input_files(
        "#import-input", files=[{"name": name, "mimeType": "application/json", "buffer": data}]
    )
    page.wait_for_function(
        "(before) => document.getElementById('import-status').textContent !== before", arg=before
    )
    status: str = page.text_content("#import-status") or ""
    page.evaluate("document.getElementById('import-status').textContent = ''")
    return status


def test_ui_export_and_import_conversations(
    loading_server: AppServer, open_page: Callable[..., Tab], tmp_path: Path
) -> None:
    page, _ = mock_tab(open_page, loading_server.url, ["reply 1", "reply 2", "reply 3"])
    send(page, "Q1")
    wait_idle(page)
    page.click(".msg.assistant .regen-msg")
    wait_idle(page)
    conv = stored_conversation(page)
    with page.expect_download() as info:
        page.click("#export-chat")
    download = info.value
    assert download.suggested_filename == "kubeinfer-q1.json"
    exported = json.loads(Path(download.path()).read_text())
    assert exported["format"] == "kubeinfer.conversations" and exported["version"] == 1
    assert exported["conversations"] == [
        {"title": "Q1", "updated": conv["updated"], "messages": conv["messages"], "leaf": conv["leaf"]}
    ]
    # imported back: a second conversation with the same versions, shown at once
    good = json.dumps(exported)
    assert _upload(page, "chat.json", good) == "Imported 1 conversation from chat.json."
    assert page.locator("#conversation-list li").count() == 2
    assert path_text(page) == ["Q1", "reply 2"]
    assert page.text_content(".msg.assistant .version-count") == "2/2"
    imported = stored_conversation(page)
    assert imported["id"] != conv["id"] and imported["messages"] == conv["messages"]
    # refused, saying why, with nothing imported
    msg = conv["messages"]

    def variant(**changes: Any) -> str:
        c = {"title": "x", "messages": msg, "leaf": conv["leaf"], **changes}
        return json.dumps({"format": "kubeinfer.conversations", "version": 1, "conversations": [c]})

    bad = {
        "not JSON": "{nope",
        'has no "format"': json.dumps({"conversations": []}),
        "version 2 is not one this page reads": json.dumps({**exported, "version": 2}),
        '"conversations" must be a non-empty list': json.dumps({**exported, "conversations": []}),
        "messages[1].parent must be null or the id of an earlier message": variant(
            messages=[msg[0], {**msg[1], "parent": "nowhere"}]
        ),
        "messages[1].id": variant(messages=[msg[0], {**msg[1], "id": msg[0]["id"]}]),
        'role must be "user" or "assistant", got "system"': variant(messages=[{**msg[0], "role": "system"}]),
        "messages[0].content must be a string": variant(messages=[{**msg[0], "content": ["<b>"]}]),
        "messages[0].html is not a field this page knows": variant(messages=[{**msg[0], "html": "<b>"}]),
        "leaf must be the id of one of its messages": variant(leaf="m-missing"),
        "has replies": variant(
            messages=[
                {
                    "id": "a",
                    "parent": None,
                    "role": "assistant",
                    "content": "",
                    "error": {"status": 500, "text": "x"},
                },
                {"id": "b", "parent": "a", "role": "user", "content": "y"},
            ],
            leaf="b",
        ),
        "stats.ttft_ms must be a number": variant(messages=[{**msg[0], "stats": {"ttft_ms": "fast"}}]),
        "title must be a string": variant(title=None),
    }
    for reason, content in bad.items():
        status = _upload(page, "bad.json", content)
        assert status.startswith("Import refused:") and reason in status, (reason, status)
        assert page.locator("#conversation-list li").count() == 2
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # hostile text in an imported file is text, like any model reply
    hostile = variant(
        title='<img src=x onerror="window.__pwned = 1">',
        messages=[
            {"id": "u", "parent": None, "role": "assistant", "content": "[x](javascript:window.__pwned=2)"}
        ],
        leaf="u",
    )
    assert _upload(page, "hostile.json", hostile).startswith("Imported 1 conversation")
    assert page.locator("#conversation-list li").count() == 3
    assert page.locator("#messages a, #messages img, #chats img").count() == 0
    assert '<img src=x onerror="window.__pwned = 1">' in (page.text_content("#conversation-list") or "")
    assert page.evaluate("window.__pwned") is None
    page.screenshot(path=str(ARTIFACTS / "import.png"))
    # "Export all" writes every conversation, which the page reads back as they were
    with page.expect_download() as info:
        page.click("#export-all")
    everything = json.loads(Path(info.value.path()).read_text())
    assert [c["title"] for c in everything["conversations"]] == [
        '<img src=x onerror="window.__pwned = 1">', "Q1", "Q1",
    ]  # fmt: skip
    assert _upload(page, "all.json", json.dumps(everything)) == "Imported 3 conversations from all.json."
    assert page.locator("#conversation-list li").count() == 6


def test_ui_json_schema_sends_its_shown_example(
    loading_server: AppServer, open_page: Callable[..., Tab]
) -> None:
    page, bodies = mock_tab(open_page, loading_server.url, ['{"answer": "Paris"}'])
    shown = page.input_value("#json-schema")
    example = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    assert json.loads(shown) == example  # the box starts with the example, not a placeholder
    page.check("#json-mode")
    send(page, QUESTION)
    wait_idle(page)
    assert bodies[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "playground", "schema": example, "strict": True},
    }
    # an emptied box is refused in the page, saying so and how to get the example back
    page.fill("#json-schema", "")
    send(page, "again")
    wait_idle(page)
    assert len(bodies) == 1
    assert "the schema box is empty" in (page.text_content(".msg.error") or "")
    page.click("#schema-example")
    assert json.loads(page.input_value("#json-schema")) == example


COPY_BTN = '<button class="copy copy-code" type="button" aria-label="Copy{} code" data-copy="{}"></button>'
LINK = '<a href="{}" target="_blank" rel="noopener noreferrer nofollow">{}</a>'
MARKDOWN_CASES = [
    (
        "Steps:\n\n1. **Install** it:\n   ```bash\n   pip install x\n   ```\n2. Run it.\n\n* one `a`\n* two",
        "<p>Steps:</p><ol><li><strong>Install</strong> it:"
        '<div class="codeblock" data-lang="bash">' + COPY_BTN.format(" bash", "pip install x") + '<pre class="code">'
        '<code data-lang="bash">pip install x</code></pre></div></li><li>Run it.</li></ol>'
        '<ul><li>one <code class="inline">a</code></li><li>two</li></ul>',
    ),
    ("- a\n\n- b", "<ul><li><p>a</p></li><li><p>b</p></li></ul>"),
    ("3. three\n4. four\n\n1) x", '<ol start="3"><li>three</li><li>four</li></ol><ol><li>x</li></ol>'),
    ("Line one\nline two\n\n---\n\n> quote\n> more", "<p>Line one<br>line two</p><hr><blockquote><p>quote<br>more</p></blockquote>"),
    ("#hashtag, ### Title ###", "<p>#hashtag, ### Title ###</p>"),
    ("### Title ###\n###### six", "<h3>Title</h3><h6>six</h6>"),
    (
        "| a | b | c |\n|:--|--:|:-:|\n| 1 | 2 | 3 |",
        '<div class="table-wrap"><table><thead><tr><th class="align-left">a</th><th class="align-right">b</th>'
        '<th class="align-center">c</th></tr></thead><tbody><tr><td class="align-left">1</td>'
        '<td class="align-right">2</td><td class="align-center">3</td></tr></tbody></table></div>',
    ),
    (
        "Visit https://example.com/a_b. Or <https://x.org>.",
        "<p>Visit " + LINK.format("https://example.com/a_b", "https://example.com/a_b")
        + ". Or " + LINK.format("https://x.org/", "https://x.org") + ".</p>",
    ),
    ("~~~\ncode ~~~ inside\n~~~", '<div class="codeblock">' + COPY_BTN.format("", "code ~~~ inside")
     + '<pre class="code"><code>code ~~~ inside</code></pre></div>'),
    ("Use ``a`b`` and \\*not em\\*, 2 * 3, snake_case_x", '<p>Use <code class="inline">a`b</code> and *not em*, 2 * 3, snake_case_x</p>'),
    ("**unclosed bold and `code", "<p>**unclosed bold and `code</p>"),
    # a fence still open while streaming is code up to the end of the text so far
    ("Here:\n```py\nx = 1", '<p>Here:</p><div class="codeblock" data-lang="py">' + COPY_BTN.format(" py", "x = 1")
     + '<pre class="code"><code data-lang="py">x = 1</code></pre></div>'),
]  # fmt: skip


def test_ui_markdown_structure(loading_server: AppServer, open_page: Callable[..., Tab]) -> None:
    tab = open_page()
    mock_models(tab.page)
    page = goto(tab, loading_server.url)
    page.wait_for_function("() => typeof Markdown !== 'undefined'")
    render = "(t) => { const d = document.createElement('div'); Markdown.render(d, t); return d.innerHTML; }"
    for text, html in MARKDOWN_CASES:
        assert page.evaluate(render, text) == html, text
    # hostile nesting stays within bounds (no stack overflow, no runaway DOM): deeper levels are text
    depth = (
        "(t) => { const d = document.createElement('div'); Markdown.render(d, t);"
        " const n = (s) => d.querySelectorAll(s).length;"
        " return [n('blockquote'), n('ul'), n('em'), n('th'), d.textContent.length]; }"
    )
    assert page.evaluate(depth, ">" * 20_000 + " x") == [16, 0, 0, 0, 20_002 - 16]
    assert page.evaluate(depth, "- " * 20_000 + "x")[:2] == [0, 16]
    assert page.evaluate(depth, "|a" * 100 + "\n" + "|-" * 100)[3] == 0  # too wide for a table
    # 20,000 open brackets: one pass matches them; the last one is a link, the rest text
    assert page.evaluate(depth, "[" * 20_000 + "x](https://e.org)")[4] == 20_000
    assert (
        page.evaluate(render, "[" * 3 + "x](https://e.org)")
        == "<p>[[" + LINK.format("https://e.org/", "x") + "</p>"
    )


def test_ui_shows_thinking_apart_collapsed(loading_server: AppServer, open_page: Callable[..., Tab]) -> None:
    """A reasoning model's stream (reasoning_content and reasoning deltas, as vLLM and our
    --reasoning-parser send them): the thinking goes to a collapsed <details> above the answer, as
    text, once; the answer alone is the message's content (and what the next turn sends)."""
    tab = open_page()
    page = tab.page
    mock_models(page)
    thinking = "Let me think <b>hard</b>.\nTwo lines."
    bodies: list[dict[str, Any]] = []

    def handle(route: Any) -> None:
        bodies.append(json.loads(route.request.post_data))
        pieces = [thinking[i : i + 4] for i in range(0, len(thinking), 4)]
        chunks = [
            {
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"reasoning_content": p, "reasoning": p}}],
            }
            for p in pieces
        ]
        chunks += [delta("The answer."), usage_chunk(7, len(pieces) + 1)]
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse_body(*chunks))

    page.route("**/v1/chat/completions", handle)
    goto(tab, loading_server.url)
    wait_models(page)
    send(page, "Think first")
    wait_idle(page)
    box = page.locator(".msg.assistant details.thinking")
    assert box.count() == 1 and box.get_attribute("open") is None  # collapsed
    assert box.locator(".text").text_content() == thinking
    assert page.locator(".msg.assistant .body").text_content() == "The answer."
    assert page.locator("#messages b").count() == 0  # thinking is text, never markup
    msgs = stored_messages(page)
    assert msgs[1]["content"] == "The answer." and msgs[1]["reasoning"] == thinking
    page.reload()  # kept with the conversation
    page.wait_for_selector(".msg.assistant details.thinking")
    assert page.locator(".msg.assistant details.thinking .text").text_content() == thinking
    send(page, "And?")
    wait_idle(page)
    assert bodies[1]["messages"][1] == {"role": "assistant", "content": "The answer."}

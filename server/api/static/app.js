// kubeinfer playground: a chat over this server's /v1/chat/completions (stream: true).
// No dependencies and no build step. Model text only ever reaches the page through textContent and
// createElement (never innerHTML), and the CSP allows scripts from this server only.
"use strict";

const STORE = {
  conversations: "kubeinfer.conversations",
  current: "kubeinfer.current",
  settings: "kubeinfer.settings",
  apiKey: "kubeinfer.apiKey",
};
const KNOBS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];
const INTEGER_KNOBS = new Set(["top_k", "max_tokens", "seed"]);
const TEXT_SETTINGS = ["system", "stop-strings", "json-schema"];

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    // storage full or disabled: the page still works, it just forgets on reload
  }
}

// ---- conversations (local storage) -------------------------------------------------------------
let conversations = load(STORE.conversations, []);
let current = null;

function newConversation() {
  const conv = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: "New chat", messages: [], updated: Date.now() };
  conversations.unshift(conv);
  return conv;
}

function persist() {
  if (current) current.updated = Date.now();
  // empty conversations are not worth keeping, except the one on screen
  conversations = conversations.filter((c) => c.messages.length > 0 || c === current);
  save(STORE.conversations, conversations);
  save(STORE.current, current ? current.id : null);
  renderConversationList();
}

function selectConversation(conv) {
  if (busy) return;
  current = conv;
  persist();
  renderMessages();
}

function renderConversationList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const conv of conversations) {
    const item = el("li", conv === current ? "current" : "");
    const open = el("button", "conv-open", conv.title || "New chat");
    open.type = "button";
    if (conv === current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => selectConversation(conv));
    const del = el("button", "conv-delete", "Delete");
    del.type = "button";
    del.setAttribute("aria-label", `Delete conversation: ${conv.title || "New chat"}`);
    del.addEventListener("click", () => {
      if (busy && conv === current) return;
      conversations = conversations.filter((c) => c !== conv);
      if (conv === current) current = conversations[0] || newConversation();
      persist();
      renderMessages();
    });
    item.append(open, del);
    list.append(item);
  }
}

// ---- rendering: code fences become <pre><code>, `inline` becomes <code>, the rest stays text ------
function renderInline(parent, text) {
  const parts = text.split(/(`[^`\n]+`)/);
  for (const part of parts) {
    if (part.length > 2 && part.startsWith("`") && part.endsWith("`")) {
      parent.append(el("code", "inline", part.slice(1, -1)));
    } else if (part) {
      parent.append(document.createTextNode(part));
    }
  }
}

function renderContent(container, text) {
  container.replaceChildren();
  // A fence still open while streaming renders as code up to the end of the text so far.
  const fence = /```([^\n`]*)\n?([\s\S]*?)(```|$)/g;
  let last = 0;
  let match;
  const addText = (segment) => {
    // the line breaks around a fence belong to the fence, not to the paragraphs beside it
    const trimmed = segment.replace(/^\n+|\n+$/g, "");
    if (!trimmed) return;
    const p = el("div", "text");
    renderInline(p, trimmed);
    container.append(p);
  };
  if (!text.includes("```")) {
    const p = el("div", "text");
    renderInline(p, text);
    container.append(p);
    return;
  }
  while ((match = fence.exec(text)) !== null) {
    if (match.index > last) addText(text.slice(last, match.index));
    const pre = el("pre", "code");
    const code = el("code", "", match[3] ? match[2].replace(/\n$/, "") : match[2]);
    const lang = match[1].trim();
    if (lang) {
      code.dataset.lang = lang;
      pre.append(el("span", "lang", lang));
    }
    pre.append(code);
    container.append(pre);
    last = fence.lastIndex;
    if (match[0].length === 0) fence.lastIndex++; // an empty match at the end: stop looping
    if (last >= text.length) break;
  }
  if (last < text.length) addText(text.slice(last));
}

function formatStats(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.completion_tokens !== undefined) parts.push(`${stats.completion_tokens} tokens`);
  if (stats.prompt_tokens !== undefined) parts.push(`prompt ${stats.prompt_tokens}`);
  if (stats.ttft_ms !== undefined) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats.tokens_per_s !== undefined) parts.push(`${stats.tokens_per_s.toFixed(1)} tokens/s`);
  if (stats.finish_reason) parts.push(`finish: ${stats.finish_reason}`);
  if (stats.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageNode(msg) {
  const kind = msg.error ? "error" : msg.role;
  const node = el("article", `msg ${kind}`);
  const label = { user: "You", assistant: "Model", error: msg.error && msg.error.status ? "Server error" : "Error" }[kind] || kind;
  node.append(el("header", "role", label));
  const body = el("div", "body");
  if (msg.error) {
    body.append(el("div", "status", msg.error.status ? `HTTP ${msg.error.status}` : "Request failed"));
    body.append(el("pre", "error-text", msg.error.text));
  } else if (msg.role === "assistant") {
    renderContent(body, msg.content);
  } else {
    body.append(el("div", "text", msg.content));
  }
  node.append(body);
  const stats = el("footer", "stats", formatStats(msg.stats));
  if (!msg.stats) stats.hidden = true;
  node.append(stats);
  return node;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  if (current.messages.length === 0) {
    box.append(el("p", "empty muted", "Ask the model something. Settings hold the system prompt and the sampling knobs."));
  }
  for (const msg of current.messages) box.append(messageNode(msg));
  box.scrollTop = box.scrollHeight;
  updateButtons();
}

// ---- settings -----------------------------------------------------------------------------------
function apiKey() {
  return $("api-key").value.trim();
}

function setApiKey(key) {
  $("api-key").value = key;
  save(STORE.apiKey, key);
}

function saveSettings() {
  const s = {};
  for (const id of [...KNOBS, ...TEXT_SETTINGS]) s[id] = $(id).value;
  s.jsonMode = $("json-mode").checked;
  s.model = $("model").value;
  save(STORE.settings, s);
}

function restoreSettings() {
  const s = load(STORE.settings, {});
  for (const id of [...KNOBS, ...TEXT_SETTINGS]) if (typeof s[id] === "string") $(id).value = s[id];
  $("json-mode").checked = Boolean(s.jsonMode);
  $("api-key").value = load(STORE.apiKey, "");
  return s;
}

class InputError extends Error {}

// The request body: only the knobs the user set, so that empty ones keep the server's defaults.
function buildBody(messages) {
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  const model = $("model").value;
  if (model) body.model = model;
  for (const id of KNOBS) {
    const raw = $(id).value.trim();
    if (raw === "") continue;
    const value = Number(raw);
    if (!Number.isFinite(value) || (INTEGER_KNOBS.has(id) && !Number.isInteger(value))) {
      throw new InputError(`${id} must be ${INTEGER_KNOBS.has(id) ? "an integer" : "a number"}, got "${raw}"`);
    }
    body[id] = value;
  }
  const stops = $("stop-strings").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  if ($("json-mode").checked) {
    let schema;
    try {
      schema = JSON.parse($("json-schema").value);
    } catch (e) {
      throw new InputError(`the JSON schema does not parse: ${e.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema, strict: true } };
  }
  return body;
}

function headers() {
  const h = { "Content-Type": "application/json", Accept: "text/event-stream" };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// ---- errors as the server sent them ---------------------------------------------------------------
async function errorFromResponse(res) {
  const raw = await res.text();
  let text = raw;
  try {
    const parsed = JSON.parse(raw);
    if (parsed && parsed.error) {
      text = typeof parsed.error === "string" ? parsed.error : parsed.error.message || raw;
    }
  } catch {
    // not JSON: show the body as it came
  }
  return { status: res.status, text: text || res.statusText };
}

// ---- models -------------------------------------------------------------------------------------
async function loadModels(preferred) {
  const status = $("model-status");
  status.textContent = "loading models...";
  let res;
  try {
    res = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    status.textContent = `cannot reach the server: ${e.message}`;
    return;
  }
  if (res.status === 401) {
    const err = await errorFromResponse(res);
    showAuth(`${apiKey() ? "The key was refused" : "No key given"}: HTTP 401 ${err.text}`);
    status.textContent = "API key required";
    return;
  }
  if (!res.ok) {
    const err = await errorFromResponse(res);
    status.textContent = `HTTP ${err.status}: ${err.text}`;
    if (res.status === 503) setTimeout(() => loadModels(preferred), 3000);
    return;
  }
  hideAuth();
  const data = (await res.json()).data || [];
  const select = $("model");
  const previous = select.value || preferred;
  select.replaceChildren();
  for (const m of data) {
    const option = el("option", "", m.parent ? `${m.id} (adapter of ${m.parent})` : m.id);
    option.value = m.id;
    select.append(option);
  }
  if (data.some((m) => m.id === previous)) select.value = previous;
  status.textContent = data.length ? "" : "no models served";
}

function showAuth(detail) {
  $("auth").hidden = false;
  $("auth-detail").textContent = detail;
  $("auth-key").value = apiKey();
  $("auth-key").focus();
}

function hideAuth() {
  $("auth").hidden = true;
}

// ---- streaming ----------------------------------------------------------------------------------
let busy = false;
let controller = null;

function updateButtons() {
  const msgs = current ? current.messages : [];
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !msgs.some((m) => m.role === "user");
  $("edit-last").disabled = busy || !msgs.some((m) => m.role === "user");
  $("chat").setAttribute("aria-busy", busy ? "true" : "false");
}

// Server-sent events: `data: <json>` lines, events separated by a blank line, `data: [DONE]` last.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

async function complete() {
  const history = current.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : history;
  let body;
  try {
    body = buildBody(messages);
  } catch (e) {
    if (!(e instanceof InputError)) throw e;
    current.messages.push({ role: "assistant", content: "", error: { status: 0, text: e.message } });
    persist();
    renderMessages();
    return;
  }
  busy = true;
  controller = new AbortController();
  const reply = { role: "assistant", content: "" };
  current.messages.push(reply);
  renderMessages();
  const node = $("messages").lastElementChild;
  node.classList.add("streaming");
  const bodyNode = node.querySelector(".body");
  const t0 = performance.now();
  let tFirst;
  let usage;
  let finish;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!res.ok) {
      reply.error = await errorFromResponse(res);
      if (res.status === 401) showAuth(`HTTP 401 ${reply.error.text}`);
      return;
    }
    for await (const data of sseEvents(res.body)) {
      if (data === "[DONE]") break;
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch {
        continue;
      }
      if (chunk.error) {
        // an error after the stream began arrives as an event with the error body
        reply.error = { status: chunk.error.code || 0, text: chunk.error.message || data };
        break;
      }
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (tFirst === undefined) tFirst = performance.now();
          reply.content += delta;
          renderContent(bodyNode, reply.content);
          const box = $("messages");
          box.scrollTop = box.scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stats = { stopped: true };
    } else {
      reply.error = { status: 0, text: `the request failed: ${e.message}` };
    }
  } finally {
    const tEnd = performance.now();
    if (usage) {
      const stats = { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens, finish_reason: finish };
      if (tFirst !== undefined) {
        stats.ttft_ms = tFirst - t0;
        // the first token's time is TTFT's; the rate is over the tokens after it
        const decodeS = (tEnd - tFirst) / 1000;
        if (usage.completion_tokens > 1 && decodeS > 0) stats.tokens_per_s = (usage.completion_tokens - 1) / decodeS;
      }
      reply.stats = stats;
    } else if (tFirst !== undefined && reply.stats) {
      reply.stats.ttft_ms = tFirst - t0;
    }
    if (reply.error && reply.content) {
      // keep what streamed before the failure as its own reply, then the error
      current.messages.push({ role: "assistant", content: "", error: reply.error });
      delete reply.error;
    }
    busy = false;
    controller = null;
    node.classList.remove("streaming");
    persist();
    renderMessages();
    // a button that went disabled while streaming dropped the focus: give it back to the message box
    if (!document.activeElement || document.activeElement === document.body) $("prompt").focus();
  }
}

function send(text) {
  if (busy) return;
  if (!text.trim()) return;
  // a failed reply is dropped before a new turn: the model never sees error rows
  current.messages = current.messages.filter((m) => !m.error);
  current.messages.push({ role: "user", content: text });
  if (current.title === "New chat") current.title = text.slice(0, 48);
  $("prompt").value = "";
  persist();
  return complete();
}

function stop() {
  if (controller) controller.abort();
}

function dropAfterLastUser() {
  const msgs = current.messages;
  let i = msgs.length - 1;
  while (i >= 0 && msgs[i].role !== "user") i--;
  return i;
}

function regenerate() {
  if (busy) return;
  const i = dropAfterLastUser();
  if (i < 0) return;
  current.messages = current.messages.slice(0, i + 1);
  persist();
  return complete();
}

function editLast() {
  if (busy) return;
  const i = dropAfterLastUser();
  if (i < 0) return;
  const text = current.messages[i].content;
  current.messages = current.messages.slice(0, i);
  persist();
  renderMessages();
  const prompt = $("prompt");
  prompt.value = text;
  prompt.focus();
  prompt.setSelectionRange(text.length, text.length);
}

// ---- wiring -------------------------------------------------------------------------------------
function togglePanel(button, panel) {
  const open = !document.body.classList.contains(`show-${panel}`);
  document.body.classList.toggle(`show-${panel}`, open);
  button.setAttribute("aria-expanded", String(open));
  if (open) {
    const first = $(panel).querySelector("button, input, textarea, select");
    if (first) first.focus();
  }
}

function init() {
  const settings = restoreSettings();
  const savedCurrent = load(STORE.current, null);
  current = conversations.find((c) => c.id === savedCurrent) || conversations[0] || newConversation();
  persist();
  renderMessages();

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send($("prompt").value);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send($("prompt").value);
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    if (busy) {
      e.preventDefault();
      stop();
      return;
    }
    // on narrow screens, Escape closes an open panel and gives the focus back to its button
    for (const panel of ["chats", "settings"]) {
      if (document.body.classList.contains(`show-${panel}`)) {
        const button = $(`toggle-${panel}`);
        togglePanel(button, panel);
        button.focus();
      }
    }
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("edit-last").addEventListener("click", editLast);
  $("new-chat").addEventListener("click", () => {
    if (busy) return;
    selectConversation(current.messages.length ? newConversation() : current);
    $("prompt").focus();
  });
  for (const id of [...KNOBS, ...TEXT_SETTINGS, "json-mode", "model"]) $(id).addEventListener("change", saveSettings);
  $("api-key").addEventListener("change", () => {
    setApiKey(apiKey());
    loadModels(settings.model);
  });
  $("auth-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setApiKey($("auth-key").value.trim());
    loadModels(settings.model);
  });
  $("toggle-chats").addEventListener("click", (e) => togglePanel(e.currentTarget, "chats"));
  $("toggle-settings").addEventListener("click", (e) => togglePanel(e.currentTarget, "settings"));
  loadModels(settings.model);
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", init);

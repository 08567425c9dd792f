// kubeinfer playground: a chat over this server's /v1/chat/completions (stream: true).
// No dependencies and no build step. Model text only ever reaches the page through textContent and
// createElement (never innerHTML; replies go through markdown.js, which does the same), and the CSP
// allows scripts from this server only.
// The API key lives in this tab's memory only (the password field): no browser storage that another
// page of this origin could read holds it.
"use strict";

const STORE = {
  conversations: "kubeinfer.conversations",
  current: "kubeinfer.current",
  settings: "kubeinfer.settings",
  legacyApiKey: "kubeinfer.apiKey", // where versions before 0.x kept the key in plain text: removed on load
};
const EXPORT_FORMAT = "kubeinfer.conversations";
const EXPORT_VERSION = 1;
const IMPORT_MAX_BYTES = 20 * 1024 * 1024;
const KNOBS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];
const INTEGER_KNOBS = new Set(["top_k", "max_tokens", "seed"]);
const TEXT_SETTINGS = ["system", "stop-strings", "json-schema"];
const EXAMPLE_SCHEMA = JSON.stringify(
  { type: "object", properties: { answer: { type: "string" } }, required: ["answer"] },
  null,
  2
);

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(className, text, label) {
  const b = el("button", className, text);
  b.type = "button";
  if (label) b.setAttribute("aria-label", label);
  return b;
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

const newId = (prefix) => `${prefix}${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;

// ---- conversations: a tree of messages, shown along one path ------------------------------------
// conversation: {id, title, updated, messages: [{id, parent, role, content, stats?, error?}], leaf}
// Every message names its parent (null for the first turn); editing or regenerating a message adds a
// sibling, so that the earlier versions stay and the user can switch between them (as llama.cpp's web
// UI does). `leaf` is the last message of the path on screen. Siblings keep their creation order.
// An error row (`error` set) is always a leaf and is dropped before the next turn.
let conversations = [];
let current = null;

function newConversation() {
  const conv = { id: newId("c"), title: "New chat", messages: [], leaf: null, updated: Date.now() };
  conversations.unshift(conv);
  return conv;
}

function byId(conv, id) {
  return conv.messages.find((m) => m.id === id) || null;
}

function childrenOf(conv, id) {
  return conv.messages.filter((m) => m.parent === id);
}

// the messages on screen, first to last
function pathOf(conv) {
  const path = [];
  for (let m = byId(conv, conv.leaf); m; m = byId(conv, m.parent)) path.unshift(m);
  return path;
}

// The last message below `node` along its most recently extended branch, so that switching back to
// a version shows the conversation that went on from it.
function deepest(conv, node) {
  const order = new Map(conv.messages.map((m, i) => [m.id, i]));
  const latest = (id) => Math.max(order.get(id), ...childrenOf(conv, id).map((c) => latest(c.id)));
  for (;;) {
    const kids = childrenOf(conv, node.id);
    if (!kids.length) return node;
    node = kids.reduce((a, b) => (latest(b.id) > latest(a.id) ? b : a));
  }
}

function addMessage(conv, parent, fields) {
  const msg = { id: newId("m"), parent, ...fields };
  conv.messages.push(msg);
  conv.leaf = msg.id;
  return msg;
}

function dropErrors(conv) {
  const leaf = byId(conv, conv.leaf);
  if (leaf && leaf.error) conv.leaf = leaf.parent;
  conv.messages = conv.messages.filter((m) => !m.error);
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
    const open = button("conv-open", conv.title || "New chat");
    if (conv === current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => selectConversation(conv));
    const del = button("conv-delete", "Delete", `Delete conversation: ${conv.title || "New chat"}`);
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

// ---- export and import (JSON files) ------------------------------------------------------------
class ImportError extends Error {}

const STAT_NUMBERS = ["prompt_tokens", "completion_tokens", "ttft_ms", "tokens_per_s"];

function cleanStats(stats, where) {
  if (stats === undefined) return undefined;
  if (!stats || typeof stats !== "object" || Array.isArray(stats)) throw new ImportError(`${where} must be an object`);
  const out = {};
  for (const [k, v] of Object.entries(stats)) {
    if (STAT_NUMBERS.includes(k)) {
      if (typeof v !== "number" || !Number.isFinite(v) || v < 0) throw new ImportError(`${where}.${k} must be a number >= 0`);
      out[k] = v;
    } else if (k === "finish_reason") {
      if (typeof v !== "string") throw new ImportError(`${where}.finish_reason must be a string`);
      out[k] = v;
    } else if (k === "stopped") {
      if (typeof v !== "boolean") throw new ImportError(`${where}.stopped must be true or false`);
      out[k] = v;
    } else {
      throw new ImportError(`${where}.${k} is not a field this page knows`);
    }
  }
  return out;
}

// A conversation checked field by field and rebuilt from the fields it may carry (nothing else is
// kept). Conversations of earlier versions (a plain list of messages without ids) become one path.
function cleanConversation(raw, where, keepId = false) {
  if (!raw || typeof raw !== "object" || Array.isArray(raw)) throw new ImportError(`${where} must be an object`);
  if (typeof raw.title !== "string") throw new ImportError(`${where}.title must be a string`);
  if (!Array.isArray(raw.messages)) throw new ImportError(`${where}.messages must be a list`);
  const linear = raw.messages.every((m) => m && typeof m === "object" && m.id === undefined && m.parent === undefined);
  const id = keepId && typeof raw.id === "string" && raw.id ? raw.id : newId("c");
  const conv = { id, title: raw.title.slice(0, 200), updated: Date.now(), messages: [], leaf: null };
  if (typeof raw.updated === "number" && Number.isFinite(raw.updated)) conv.updated = raw.updated;
  const seen = new Set();
  const parents = new Set();
  raw.messages.forEach((m, i) => {
    const at = `${where}.messages[${i}]`;
    if (!m || typeof m !== "object" || Array.isArray(m)) throw new ImportError(`${at} must be an object`);
    const id = linear ? `m${i}` : m.id;
    const parent = linear ? (i ? `m${i - 1}` : null) : m.parent;
    if (typeof id !== "string" || !id || id.length > 100) throw new ImportError(`${at}.id must be a non-empty string`);
    if (seen.has(id)) throw new ImportError(`${at}.id "${id}" is used twice`);
    if (parent !== null && !seen.has(parent)) {
      throw new ImportError(`${at}.parent must be null or the id of an earlier message, got ${JSON.stringify(parent)}`);
    }
    if (m.role !== "user" && m.role !== "assistant") {
      throw new ImportError(`${at}.role must be "user" or "assistant", got ${JSON.stringify(m.role)}`);
    }
    if (typeof m.content !== "string") throw new ImportError(`${at}.content must be a string`);
    for (const k of Object.keys(m)) {
      if (!["id", "parent", "role", "content", "reasoning", "stats", "error"].includes(k)) {
        throw new ImportError(`${at}.${k} is not a field this page knows`);
      }
    }
    const msg = { id, parent, role: m.role, content: m.content };
    if (m.reasoning !== undefined) {
      if (typeof m.reasoning !== "string" || m.role !== "assistant") {
        throw new ImportError(`${at}.reasoning must be a string on an assistant message`);
      }
      msg.reasoning = m.reasoning;
    }
    const stats = cleanStats(m.stats, `${at}.stats`);
    if (stats) msg.stats = stats;
    if (m.error !== undefined) {
      const e = m.error;
      if (!e || typeof e !== "object" || !Number.isInteger(e.status) || typeof e.text !== "string" || m.role !== "assistant") {
        throw new ImportError(`${at}.error must be {"status": integer, "text": string} on an assistant message`);
      }
      msg.error = { status: e.status, text: e.text };
    }
    seen.add(id);
    if (parent !== null) parents.add(parent);
    conv.messages.push(msg);
  });
  for (const m of conv.messages) {
    if (m.error && parents.has(m.id)) throw new ImportError(`${where}: the error row "${m.id}" has replies`);
  }
  const leaf = linear ? (conv.messages.length ? conv.messages[conv.messages.length - 1].id : null) : raw.leaf;
  if (conv.messages.length === 0 ? leaf !== null && leaf !== undefined : !seen.has(leaf)) {
    throw new ImportError(`${where}.leaf must be the id of one of its messages (null when it has none)`);
  }
  conv.leaf = conv.messages.length ? leaf : null;
  return conv;
}

function parseExport(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch (e) {
    throw new ImportError(`not JSON: ${e.message}`);
  }
  if (!data || typeof data !== "object" || data.format !== EXPORT_FORMAT) {
    throw new ImportError(`not a conversations file of this page (it has no "format": "${EXPORT_FORMAT}")`);
  }
  if (data.version !== EXPORT_VERSION) {
    throw new ImportError(`version ${JSON.stringify(data.version)} is not one this page reads (${EXPORT_VERSION})`);
  }
  if (!Array.isArray(data.conversations) || data.conversations.length === 0) {
    throw new ImportError('"conversations" must be a non-empty list');
  }
  return data.conversations.map((c, i) => cleanConversation(c, `conversations[${i}]`));
}

function exportConversations(convs, filename) {
  const data = {
    format: EXPORT_FORMAT,
    version: EXPORT_VERSION,
    conversations: convs.map(({ title, updated, messages, leaf }) => ({ title, updated, messages, leaf })),
  };
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const a = el("a");
  a.href = url;
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

function slug(text) {
  return (text || "chat").toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "").slice(0, 40) || "chat";
}

async function importFile(file) {
  const status = $("import-status");
  status.classList.remove("error-line");
  try {
    if (file.size > IMPORT_MAX_BYTES) throw new ImportError(`the file is larger than ${IMPORT_MAX_BYTES / 1024 / 1024} MiB`);
    const imported = parseExport(await file.text());
    conversations.unshift(...imported);
    current = imported[0];
    persist();
    renderMessages();
    const n = imported.length;
    status.textContent = `Imported ${n} conversation${n === 1 ? "" : "s"} from ${file.name}.`;
  } catch (e) {
    if (!(e instanceof ImportError)) throw e;
    status.classList.add("error-line");
    status.textContent = `Import refused: ${e.message}. Nothing was imported.`;
  }
}

// ---- rendering --------------------------------------------------------------------------------
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

function renderContent(container, text) {
  Markdown.render(container, text);
}

function messageTools(msg) {
  const tools = el("div", "tools");
  const sibs = childrenOf(current, msg.parent).filter((m) => !m.error);
  const at = sibs.indexOf(msg);
  if (sibs.length > 1 && at >= 0) {
    const nav = el("span", "versions");
    const prev = button("version-prev", "‹", "Previous version");
    const next = button("version-next", "›", "Next version");
    prev.disabled = busy || at === 0;
    next.disabled = busy || at === sibs.length - 1;
    prev.addEventListener("click", () => showVersion(sibs[at - 1]));
    next.addEventListener("click", () => showVersion(sibs[at + 1]));
    nav.append(prev, el("span", "version-count", `${at + 1}/${sibs.length}`), next);
    tools.append(nav);
  }
  const who = msg.role === "user" ? "message" : "reply";
  const copy = button("copy copy-msg", "Copy", `Copy this ${who}`);
  const edit = button("edit-msg", "Edit", `Edit this ${who}`);
  edit.disabled = busy;
  edit.addEventListener("click", () => startEdit(msg));
  tools.append(copy, edit);
  if (msg.role === "assistant") {
    const regen = button("regen-msg", "Regenerate", "Regenerate this reply");
    regen.disabled = busy;
    regen.addEventListener("click", () => regenerateReply(msg));
    tools.append(regen);
  }
  return tools;
}

// A reasoning model's thinking (the server's --reasoning-parser), shown apart from the answer and
// collapsed; as text, never markup.
function setThinking(node, text) {
  let box = node.querySelector("details.thinking");
  if (!text) return;
  if (!box) {
    box = el("details", "thinking");
    box.append(el("summary", "", "Thinking"), el("div", "text", ""));
    node.querySelector(".body").before(box);
  }
  box.querySelector(".text").textContent = text;
}

function messageNode(msg) {
  const kind = msg.error ? "error" : msg.role;
  const node = el("article", `msg ${kind}`);
  node.dataset.id = msg.id;
  const label = { user: "You", assistant: "Model", error: msg.error && msg.error.status ? "Server error" : "Error" }[kind] || kind;
  node.append(el("header", "role", label));
  const body = el("div", "body");
  if (msg.error) {
    body.append(el("div", "status", msg.error.status ? `HTTP ${msg.error.status}` : "Request failed"));
    body.append(el("pre", "error-text", msg.error.text));
  } else if (msg.role === "assistant") {
    body.classList.add("markdown");
    renderContent(body, msg.content);
  } else {
    body.append(el("div", "text", msg.content));
  }
  node.append(body);
  if (!msg.error && msg.reasoning) setThinking(node, msg.reasoning);
  const stats = el("footer", "stats", formatStats(msg.stats));
  if (!msg.stats) stats.hidden = true;
  node.append(stats);
  if (!msg.error) node.append(messageTools(msg));
  return node;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const path = pathOf(current);
  if (path.length === 0) {
    box.append(el("p", "empty muted", "Ask the model something. Settings hold the system prompt and the sampling knobs."));
  }
  for (const msg of path) box.append(messageNode(msg));
  box.scrollTop = box.scrollHeight;
  updateButtons();
}

// ---- copy -------------------------------------------------------------------------------------
async function copyText(text) {
  // the Clipboard API exists in secure contexts only (https, localhost); elsewhere, a selection
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // denied: fall through to the selection
    }
  }
  const area = el("textarea", "offscreen");
  area.value = text;
  area.setAttribute("readonly", "");
  document.body.append(area);
  area.select();
  let ok = false;
  try {
    ok = document.execCommand("copy");
  } catch {
    ok = false;
  }
  area.remove();
  return ok;
}

async function onCopy(btn) {
  // a message's text is read at the click (a reply may have grown since its button was made)
  const article = btn.classList.contains("copy-msg") ? btn.closest("article") : null;
  const msg = article ? byId(current, article.dataset.id) : null;
  const ok = await copyText(msg ? msg.content : btn.dataset.copy || "");
  btn.dataset.state = ok ? "copied" : "failed";
  if (btn.classList.contains("copy-msg")) btn.textContent = ok ? "Copied" : "Copy failed";
  setTimeout(() => {
    delete btn.dataset.state;
    if (btn.classList.contains("copy-msg")) btn.textContent = "Copy";
  }, 1500);
}

// ---- editing any message, in place ----------------------------------------------------------------
function startEdit(msg) {
  if (busy) return;
  const node = $("messages").querySelector(`article[data-id="${CSS.escape(msg.id)}"]`);
  if (!node) return;
  const form = el("form", "edit-form");
  const area = el("textarea", "edit-text");
  area.value = msg.content;
  area.rows = Math.min(12, Math.max(3, msg.content.split("\n").length + 1));
  area.setAttribute("aria-label", msg.role === "user" ? "Edit the message" : "Edit the reply");
  const ok = el("button", "edit-save", msg.role === "user" ? "Send" : "Save");
  ok.type = "submit";
  const cancel = button("edit-cancel", "Cancel");
  const row = el("div", "row edit-actions");
  row.append(ok, cancel);
  form.append(area, row);
  const body = node.querySelector(".body");
  body.replaceWith(form);
  for (const hide of node.querySelectorAll(".tools, .stats")) hide.hidden = true;
  const submit = () => finishEdit(msg, area.value);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    } else if (e.key === "Escape") {
      e.preventDefault();
      e.stopPropagation();
      renderMessages();
    }
  });
  cancel.addEventListener("click", () => renderMessages());
  area.focus();
  area.setSelectionRange(area.value.length, area.value.length);
}

// An edit adds the new text as a sibling version: a user message is then answered, an edited reply
// becomes what the model said in the history of the following turns.
function finishEdit(msg, text) {
  if (busy) return;
  if (msg.role === "user" && !text.trim()) return;
  dropErrors(current);
  addMessage(current, msg.parent, { role: msg.role, content: text });
  persist();
  if (msg.role === "user") return complete();
  renderMessages();
}

function showVersion(msg) {
  if (busy) return;
  dropErrors(current);
  current.leaf = deepest(current, msg).id;
  persist();
  renderMessages();
}

function regenerateReply(msg) {
  if (busy) return;
  dropErrors(current);
  current.leaf = msg.parent;
  persist();
  return complete();
}

// ---- settings -----------------------------------------------------------------------------------
// The key is in the password field and nowhere else: a reload forgets it (the page asks again).
function apiKey() {
  return $("api-key").value.trim();
}

function setApiKey(key) {
  $("api-key").value = key;
}

function saveSettings() {
  const s = {};
  for (const id of [...KNOBS, ...TEXT_SETTINGS]) s[id] = $(id).value;
  s.jsonMode = $("json-mode").checked;
  s.model = $("model").value;
  save(STORE.settings, s);
}

function restoreSettings() {
  try {
    localStorage.removeItem(STORE.legacyApiKey);
  } catch {
    // storage disabled: nothing was kept there either
  }
  const s = load(STORE.settings, {});
  for (const id of [...KNOBS, ...TEXT_SETTINGS]) if (typeof s[id] === "string") $(id).value = s[id];
  if (typeof s["json-schema"] !== "string") $("json-schema").value = EXAMPLE_SCHEMA;
  $("json-mode").checked = Boolean(s.jsonMode);
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
    const text = $("json-schema").value;
    if (!text.trim()) {
      throw new InputError('"JSON schema" is on but the schema box is empty: write a schema there or press "Use example"');
    }
    let schema;
    try {
      schema = JSON.parse(text);
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
  const hasTurn = current ? pathOf(current).some((m) => m.role === "user") : false;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !hasTurn;
  $("edit-last").disabled = busy || !hasTurn;
  for (const id of ["export-chat", "export-all", "import-file"]) $(id).disabled = busy;
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

// Answers the path on screen: the reply becomes a new child of its last message (a new version when
// that message already had one).
async function complete() {
  const conv = current;
  const history = pathOf(conv).filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : history;
  let body;
  try {
    body = buildBody(messages);
  } catch (e) {
    if (!(e instanceof InputError)) throw e;
    addMessage(conv, conv.leaf, { role: "assistant", content: "", error: { status: 0, text: e.message } });
    persist();
    renderMessages();
    return;
  }
  busy = true;
  controller = new AbortController();
  const reply = addMessage(conv, conv.leaf, { role: "assistant", content: "" });
  renderMessages();
  const node = $("messages").lastElementChild;
  node.classList.add("streaming");
  const bodyNode = node.querySelector(".body");
  // Each delta re-renders the whole reply (Markdown can change meaning further up); to keep long
  // replies cheap, renders come at most one per frame and after a pause 4x as long as the last render
  // took (a 12k-character reply takes ~20 ms). The final text is rendered in full when the stream ends.
  let renderDue = false;
  let nextRenderAt = 0;
  const paint = () => {
    renderDue = false;
    if (!node.isConnected) return;
    const r0 = performance.now();
    renderContent(bodyNode, reply.content);
    setThinking(node, reply.reasoning);
    const r1 = performance.now();
    nextRenderAt = r1 + 4 * (r1 - r0);
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  };
  const schedulePaint = () => {
    if (renderDue) return;
    renderDue = true;
    setTimeout(() => requestAnimationFrame(paint), Math.max(0, nextRenderAt - performance.now()));
  };
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
        // vLLM sends the thinking as reasoning_content and (newer) reasoning: the same text, read once
        const thought = choice.delta && (choice.delta.reasoning_content || choice.delta.reasoning);
        if (thought) {
          if (tFirst === undefined) tFirst = performance.now();
          reply.reasoning = (reply.reasoning || "") + thought;
          schedulePaint();
        }
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (tFirst === undefined) tFirst = performance.now();
          reply.content += delta;
          schedulePaint();
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
      const error = reply.error;
      delete reply.error;
      addMessage(conv, reply.id, { role: "assistant", content: "", error });
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
  dropErrors(current);
  addMessage(current, current.leaf, { role: "user", content: text });
  if (current.title === "New chat") current.title = text.slice(0, 48);
  $("prompt").value = "";
  persist();
  return complete();
}

function stop() {
  if (controller) controller.abort();
}

// the last reply on screen gets a new version; a turn left without one (an error) gets its first
function regenerate() {
  if (busy) return;
  dropErrors(current);
  const path = pathOf(current);
  const last = path[path.length - 1];
  if (!last) return;
  if (last.role === "assistant") return regenerateReply(last);
  persist();
  return complete();
}

function editLast() {
  const users = pathOf(current).filter((m) => m.role === "user");
  if (users.length) startEdit(users[users.length - 1]);
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

// Stored conversations pass the import's checks too (and those of earlier versions become trees);
// one that does not is left out rather than breaking the page.
function loadConversations() {
  const stored = load(STORE.conversations, []);
  const out = [];
  for (const [i, raw] of (Array.isArray(stored) ? stored : []).entries()) {
    try {
      out.push(cleanConversation(raw, `stored[${i}]`, true));
    } catch (e) {
      if (!(e instanceof ImportError)) throw e;
      console.warn(`a stored conversation was left out: ${e.message}`);
    }
  }
  return out;
}

function init() {
  conversations = loadConversations();
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
  $("schema-example").addEventListener("click", () => {
    $("json-schema").value = EXAMPLE_SCHEMA;
    saveSettings();
  });
  // copy buttons on replies and code blocks carry their text in data-copy
  $("messages").addEventListener("click", (e) => {
    const btn = e.target.closest("button.copy");
    if (btn) onCopy(btn);
  });
  $("export-chat").addEventListener("click", () => {
    if (current.messages.length) exportConversations([current], `kubeinfer-${slug(current.title)}.json`);
  });
  $("export-all").addEventListener("click", () => {
    const kept = conversations.filter((c) => c.messages.length);
    if (kept.length) exportConversations(kept, "kubeinfer-conversations.json");
  });
  $("import-file").addEventListener("click", () => $("import-input").click());
  $("import-input").addEventListener("change", async (e) => {
    const file = e.target.files && e.target.files[0];
    e.target.value = "";
    if (file && !busy) await importFile(file);
  });
  $("toggle-chats").addEventListener("click", (e) => togglePanel(e.currentTarget, "chats"));
  $("toggle-settings").addEventListener("click", (e) => togglePanel(e.currentTarget, "settings"));
  loadModels(settings.model);
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", init);

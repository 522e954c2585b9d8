// The web chat. It talks to the server through the public API alone (/v1/models, /v1/chat/completions streamed,
// and for the engine panel /health, /metrics and /v1/edgeserve/kv), with the API key as a Bearer header when the
// server asks for one. Conversations, the key and the settings live in this browser's localStorage.

import { escapeHtml, renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = "edgeserve.conversations";
const CURRENT = "edgeserve.current";
const KEY = "edgeserve.apiKey";
const POLL_STREAMING_MS = 1000;
const POLL_IDLE_MS = 4000;
const SETTLE_MS = 300;
const MAX_KV_CELLS = 512; // past this, one cell stands for several blocks, as the TUI's map does
const KV_RANK = { free: 0, cached: 1, used: 2, shared: 3 }; // which state a cell of several blocks shows

const state = {
  conversations: loadConversations(),
  current: null,
  models: [],
  ready: false, // the models are listed: the server answers and takes our key
  streaming: null, // the answer being written: {conv, answer, controller, started, first, chunks, responseId, el}
  lastAnswer: null, // {ttft, tps} of the last answer that ended
  pollTimer: 0,
};

function loadConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(list) ? list.filter((c) => c && Array.isArray(c.messages)) : [];
  } catch {
    return []; // a damaged store starts afresh rather than leaving the page blank
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state.conversations));
  localStorage.setItem(CURRENT, state.current ? state.current.id : "");
}

function newId() {
  // crypto.randomUUID needs a secure context, which a server on a LAN address over http is not
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

function newConversation() {
  const conv = {
    id: newId(), title: "New chat", created: Date.now(), updated: Date.now(), model: $("model").value || null,
    system: "", settings: {}, json: { on: false, schema: "" }, messages: [],
  };
  state.conversations.unshift(conv);
  return conv;
}

// the API ----------------------------------------------------------------------------------------------------

function headers(json = false) {
  const h = {};
  const key = localStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || body.detail || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch {
    setServerState("server unreachable", true);
    return;
  }
  if (response.status === 401) {
    askKey(Boolean(localStorage.getItem(KEY)));
    return;
  }
  if (!response.ok) {
    setServerState(await errorText(response), true);
    return;
  }
  state.models = (await response.json()).data.map((m) => m.id);
  state.ready = true;
  setServerState("", false);
  const select = $("model");
  select.replaceChildren(...state.models.map((id) => new Option(id, id)));
  showConversation(state.current);
  pollEngine();
}

function setServerState(text, bad) {
  const el = $("server-state");
  el.textContent = text;
  el.classList.toggle("bad", bad);
}

function askKey(refused) {
  $("key-error").hidden = !refused;
  $("key-input").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("key-input").focus();
}

// Server-sent events from a fetch body: each `data:` payload, parsed, until [DONE].
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function requestBody(conv, model) {
  // an answer that failed before it wrote anything is no turn of the conversation
  const messages = conv.messages.slice(0, -1).filter((m) => m.role === "user" || m.content)
    .map(({ role, content }) => ({ role, content }));
  if (conv.system.trim()) messages.unshift({ role: "system", content: conv.system });
  const body = { model, messages, stream: true, stream_options: { include_usage: true } };
  for (const [name, value] of Object.entries(conv.settings)) {
    if (value !== null && value !== "" && value !== undefined) body[name] = value;
  }
  if (conv.json.on) { // the schema was checked when the settings were saved
    body.response_format = conv.json.schema.trim()
      ? { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(conv.json.schema), strict: true } }
      : { type: "json_object" };
  }
  return body;
}

// One answer, streamed into the last message of `conv`.
async function generate(conv) {
  const model = $("model").value;
  const answer = { role: "assistant", content: "", model, format: conv.json.on ? "json" : "markdown" };
  conv.messages.push(answer);
  const body = requestBody(conv, model);
  const stream = {
    conv, answer, controller: new AbortController(), started: performance.now(), first: null, chunks: 0,
    responseId: null, el: null,
  };
  state.streaming = stream;
  touch(conv);
  showConversation(conv);
  setStreaming(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(body), signal: stream.controller.signal,
    });
    if (response.status === 401) askKey(true);
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message || "the server ended the answer");
      stream.responseId = chunk.id || stream.responseId;
      if (chunk.usage) answer.tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices?.[0]?.delta;
      const text = delta?.content || "";
      const reasoning = delta?.reasoning_content || "";
      if (!text && !reasoning) continue;
      if (stream.first === null) stream.first = performance.now();
      stream.chunks++;
      answer.content += text;
      if (reasoning) answer.reasoning = (answer.reasoning || "") + reasoning;
      drawStreaming();
    }
  } catch (err) {
    if (err.name === "AbortError") answer.stopped = true;
    else answer.error = err.message;
  }
  const end = performance.now();
  const tokens = answer.tokens ?? stream.chunks;
  if (stream.first !== null) {
    answer.ttft = (stream.first - stream.started) / 1000;
    answer.tps = tokens > 1 && end > stream.first ? (tokens - 1) / ((end - stream.first) / 1000) : null;
    answer.tokens = tokens;
    state.lastAnswer = { ttft: answer.ttft, tps: answer.tps };
  }
  state.streaming = null;
  touch(conv);
  setStreaming(false);
  if (conv === state.current) showConversation(conv);
  $("prompt").focus();
}

function stop() {
  if (state.streaming) state.streaming.controller.abort();
}

function touch(conv) {
  conv.updated = Date.now();
  save();
  drawConversations();
}

function setStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.classList.toggle("streaming", on);
  // once an answer ends the server settles its request a moment later: look again then, not a full idle period on
  clearTimeout(state.pollTimer);
  state.pollTimer = setTimeout(pollEngine, on ? 0 : SETTLE_MS);
}

// the messages -----------------------------------------------------------------------------------------------

let drawPending = false;

function drawStreaming() {
  // at most one render per frame: the answer is rendered whole each time, so a fast stream must not queue renders
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => {
    drawPending = false;
    const stream = state.streaming;
    if (!stream || !stream.el) return;
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    fillAnswer(stream.el.querySelector(".content"), stream.answer);
    if (atBottom) box.scrollTop = box.scrollHeight;
  });
}

function fillAnswer(el, message) {
  // a reasoning model's thinking stays apart from its answer, folded, and is never sent back
  const thought = message.reasoning
    ? `<details class="reasoning"><summary>Reasoning</summary>${renderMarkdown(message.reasoning)}</details>` : "";
  el.innerHTML = thought + (message.format === "json"
    ? `<pre><code class="language-json">${escapeHtml(message.content)}</code></pre>`
    : renderMarkdown(message.content));
}

function button(label, onClick, className = "") {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  if (className) b.className = className;
  b.addEventListener("click", onClick);
  return b;
}

function stats(message) {
  if (message.error) return `error: ${message.error}`;
  const parts = [];
  if (message.tokens) parts.push(`${message.tokens} tokens`);
  if (message.ttft != null) parts.push(`first token ${message.ttft.toFixed(2)} s`);
  if (message.tps != null) parts.push(`${message.tps.toFixed(1)} tokens/s`);
  if (message.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageElement(conv, message, index) {
  const el = document.createElement("article");
  el.className = `msg ${message.role}`;
  const content = document.createElement("div");
  content.className = "content";
  el.append(content);
  const streaming = state.streaming && state.streaming.answer === message;
  if (message.role === "user") {
    content.textContent = message.content;
    if (!state.streaming) el.append(actions(button("Edit", () => editMessage(el, conv, index), "edit")));
    return el;
  }
  fillAnswer(content, message);
  if (streaming) {
    el.dataset.streaming = "true";
    state.streaming.el = el;
    return el;
  }
  const foot = actions();
  const line = stats(message);
  if (line) {
    const s = document.createElement("span");
    s.className = message.error ? "stats error" : "stats";
    s.textContent = line;
    foot.append(s);
  }
  if (!state.streaming && index === conv.messages.length - 1) {
    foot.append(button("Regenerate", () => regenerate(conv), "regenerate"));
  }
  el.append(foot);
  return el;
}

function actions(...children) {
  const div = document.createElement("div");
  div.className = "actions";
  div.append(...children);
  return div;
}

function showConversation(conv) {
  if (!conv) conv = state.conversations[0] || newConversation();
  state.current = conv;
  if (state.streaming) state.streaming.el = null;
  const box = $("messages");
  box.replaceChildren(...conv.messages.map((m, i) => messageElement(conv, m, i)));
  if (!conv.messages.length) box.append(emptyNote);
  box.scrollTop = box.scrollHeight;
  if (conv.model && state.models.includes(conv.model)) $("model").value = conv.model;
  else if (state.models.length) conv.model = $("model").value;
  save();
  drawConversations();
}

function editMessage(el, conv, index) {
  const area = document.createElement("textarea");
  area.value = conv.messages[index].content;
  area.rows = Math.min(12, area.value.split("\n").length + 1);
  area.className = "edit-box";
  const resend = () => {
    if (state.streaming || !area.value.trim()) return;
    conv.messages.splice(index);
    conv.messages.push({ role: "user", content: area.value });
    generate(conv);
  };
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); resend(); }
    if (e.key === "Escape") { e.stopPropagation(); showConversation(conv); }
  });
  el.replaceChildren(area, actions(button("Send", resend, "primary"), button("Cancel", () => showConversation(conv))));
  area.focus();
}

function regenerate(conv) {
  if (state.streaming || conv.messages.at(-1)?.role !== "assistant") return;
  conv.messages.pop();
  generate(conv);
}

function send() {
  const prompt = $("prompt");
  const text = prompt.value;
  if (state.streaming || !text.trim() || !state.ready) return;
  const conv = state.current;
  if (!conv.messages.length) conv.title = text.trim().split("\n")[0].slice(0, 60);
  conv.messages.push({ role: "user", content: text });
  prompt.value = "";
  fitPrompt();
  generate(conv);
}

// the conversations ------------------------------------------------------------------------------------------

function drawConversations() {
  const list = $("conversations");
  const sorted = [...state.conversations].sort((a, b) => b.updated - a.updated);
  list.replaceChildren(...sorted.map((conv) => {
    const li = document.createElement("li");
    li.className = conv === state.current ? "conversation current" : "conversation";
    li.dataset.id = conv.id;
    const open = button(conv.title || "Untitled", () => { showConversation(conv); closeOverlays(); }, "title");
    open.title = conv.title;
    const rename = button("✎", () => renameConversation(li, conv), "icon rename");
    rename.setAttribute("aria-label", "Rename");
    const download = button("⤓", () => exportJson([conv], conv.title), "icon export");
    download.setAttribute("aria-label", "Export as JSON");
    const remove = button("✕", () => deleteConversation(remove, conv), "icon delete");
    remove.setAttribute("aria-label", "Delete");
    li.append(open, rename, download, remove);
    return li;
  }));
}

function renameConversation(li, conv) {
  const input = document.createElement("input");
  input.value = conv.title;
  input.className = "rename-box";
  input.setAttribute("aria-label", "Conversation name");
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) conv.title = input.value.trim();
    save();
    drawConversations();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") { e.stopPropagation(); finish(false); }
  });
  input.addEventListener("blur", () => finish(true));
  li.replaceChildren(input);
  input.focus();
  input.select();
}

function deleteConversation(remove, conv) {
  // two clicks, as nothing brings a conversation back once gone
  if (!remove.classList.contains("confirm")) {
    remove.classList.add("confirm");
    remove.textContent = "Delete?";
    setTimeout(() => { remove.classList.remove("confirm"); remove.textContent = "✕"; }, 4000);
    return;
  }
  if (state.streaming && state.streaming.conv === conv) stop();
  state.conversations = state.conversations.filter((c) => c !== conv);
  showConversation(conv === state.current ? null : state.current);
}

function exportJson(conversations, name) {
  const blob = new Blob([JSON.stringify(conversations, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  const base = (name || "").replace(/[^\w.-]+/g, "-").replace(/^[-.]+|[-.]+$/g, "").slice(0, 60);
  a.download = `${base || "chat"}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

// the settings of a conversation -----------------------------------------------------------------------------

const NUMBERS = [["set-temperature", "temperature", parseFloat], ["set-top-p", "top_p", parseFloat],
  ["set-max-tokens", "max_tokens", (v) => parseInt(v, 10)], ["set-seed", "seed", (v) => parseInt(v, 10)]];

function openSettings() {
  const conv = state.current;
  $("set-system").value = conv.system;
  for (const [id, name] of NUMBERS) $(id).value = conv.settings[name] ?? "";
  $("set-json").checked = conv.json.on;
  $("set-schema").value = conv.json.schema;
  showSettingsError("");
  $("settings-dialog").showModal();
}

function showSettingsError(text) {
  $("settings-error").textContent = text;
  $("settings-error").hidden = !text;
}

function saveSettings(event) {
  event.preventDefault();
  const conv = state.current;
  const schema = $("set-schema").value;
  if (schema.trim()) {
    try {
      const parsed = JSON.parse(schema);
      if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) throw new Error();
    } catch {
      showSettingsError("the JSON schema must be a JSON object");
      return;
    }
  }
  conv.system = $("set-system").value;
  conv.settings = {};
  for (const [id, name, parse] of NUMBERS) {
    const value = parse($(id).value);
    if (!Number.isNaN(value)) conv.settings[name] = value;
  }
  conv.json = { on: $("set-json").checked, schema };
  save();
  $("settings-dialog").close();
}

// the engine panel -------------------------------------------------------------------------------------------

function engineVisible() {
  return getComputedStyle($("engine")).display !== "none";
}

function parseMetrics(text) {
  const samples = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const cut = line.lastIndexOf(" ");
    samples[line.slice(0, cut)] = Number(line.slice(cut + 1));
  }
  return samples;
}

async function pollEngine() {
  clearTimeout(state.pollTimer);
  state.pollTimer = setTimeout(pollEngine, state.streaming ? POLL_STREAMING_MS : POLL_IDLE_MS);
  if (!state.ready || !engineVisible() || document.hidden) return;
  try {
    const [health, metrics] = await Promise.all([
      fetch("/health").then((r) => r.json()),
      fetch("/metrics", { headers: headers() }).then((r) => (r.ok ? r.text() : "")),
    ]);
    const model = $("model").value;
    const kvPath = (health.loaded || []).includes(model)
      ? `/v1/edgeserve/kv?model=${encodeURIComponent(model)}` : "/v1/edgeserve/kv";
    const kv = await fetch(kvPath, { headers: headers() }).then((r) => (r.ok ? r.json() : null));
    drawEngine(health, parseMetrics(metrics), kv);
    $("engine-note").textContent = "";
  } catch {
    $("engine-note").textContent = "the server does not answer";
  }
}

function drawEngine(health, m, kv) {
  const running = health.running ?? m.edgeserve_requests_running;
  const last = state.lastAnswer;
  const tps = m.edgeserve_generation_tokens_per_second;
  $("fig-tps").textContent = running && tps != null ? tps.toFixed(1)
    : last?.tps != null ? `${last.tps.toFixed(1)} (last answer)` : "–";
  const ttftCount = m.edgeserve_time_to_first_token_seconds_count;
  const mean = ttftCount ? ` (mean ${(m.edgeserve_time_to_first_token_seconds_sum / ttftCount).toFixed(2)} s)` : "";
  $("fig-ttft").textContent = last?.ttft != null ? `${last.ttft.toFixed(2)} s${mean}` : mean ? mean.slice(2, -1) : "–";
  $("fig-running").textContent = running ?? "–";
  $("fig-waiting").textContent = health.waiting ?? m.edgeserve_requests_waiting ?? "–";
  const total = m.edgeserve_kv_blocks_total;
  const used = m['edgeserve_kv_blocks{state="used"}'];
  const cached = m['edgeserve_kv_blocks{state="cached"}'];
  $("fig-kv").textContent = total ? `${used} of ${total} blocks used (${Math.round((100 * used) / total)}%), ${cached} cached` : "–";
  const hits = m.edgeserve_prefix_cache_hit_tokens_total;
  const queried = m.edgeserve_prefix_cache_query_tokens_total;
  $("fig-prefix").textContent = queried ? `${hits} of ${queried} prompt tokens (${Math.round((100 * hits) / queried)}%)` : "–";
  // speculative decoding's guesses: the share that was right, and the tokens a request gained in a step that checked one
  const right = m['edgeserve_speculative_draft_tokens_total{result="accepted"}'];
  const wrong = m['edgeserve_speculative_draft_tokens_total{result="rejected"}'];
  const checks = m.edgeserve_speculative_checks_total;
  $("fig-guesses").textContent = checks
    ? `${Math.round((100 * right) / (right + wrong))}% right, ${((right + checks) / checks).toFixed(2)} tokens a check` : "–";
  if (kv) drawKvMap(kv);
}

function drawKvMap(kv) {
  const mine = state.streaming?.responseId;
  const blocks = kv.blocks;
  const per = Math.max(1, Math.ceil(blocks.length / MAX_KV_CELLS));
  const cells = [];
  for (let i = 0; i < blocks.length; i += per) {
    const group = blocks.slice(i, i + per);
    const top = group.reduce((a, b) => (KV_RANK[b.state] > KV_RANK[a.state] ? b : a));
    const ours = mine && group.some((b) => b.owners.some((o) => o.startsWith(mine)));
    cells.push(ours ? "mine" : top.state);
  }
  const map = $("kv-map");
  while (map.children.length > cells.length) map.lastChild.remove();
  while (map.children.length < cells.length) map.append(document.createElement("i"));
  cells.forEach((cls, i) => { map.children[i].className = `kv-cell ${cls}`; });
  const c = kv.counts;
  $("kv-title").textContent = kv.num_blocks
    ? `KV pool: ${kv.num_blocks} blocks × ${kv.block_size} tokens${per > 1 ? `, ${per} a cell` : ""}`
    : "KV pool: no model loaded";
  map.setAttribute("aria-label", `KV pool: ${c.used} used, ${c.shared} shared, ${c.cached} cached, ${c.free} free`);
}

// the page ---------------------------------------------------------------------------------------------------

const emptyNote = $("empty");

function fitPrompt() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight, 200)}px`;
}

function togglePanel(panel, showClass, hideClass) {
  const app = $("app");
  const visible = getComputedStyle($(panel)).display !== "none";
  app.classList.toggle(showClass, !visible);
  app.classList.toggle(hideClass, visible);
  if (panel === "engine" && !visible) pollEngine();
}

function closeOverlays() {
  // where a panel covers the chat (the conversations on a phone, the engine below a wide desktop) it closes;
  // where it sits beside the chat it stays
  $("app").classList.remove("show-engine");
  if (matchMedia("(max-width: 799px)").matches) $("app").classList.remove("show-sidebar");
}

function start() {
  const id = localStorage.getItem(CURRENT);
  state.current = state.conversations.find((c) => c.id === id) || null;
  showConversation(state.current);

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("prompt").addEventListener("input", fitPrompt);
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.streaming && !document.querySelector("dialog[open]")) { e.preventDefault(); stop(); }
  });
  $("new-chat").addEventListener("click", () => {
    const empty = state.conversations.find((c) => !c.messages.length);
    showConversation(empty || newConversation());
    closeOverlays();
    $("prompt").focus();
  });
  $("export-all").addEventListener("click", () => exportJson(state.conversations, "edgeserve-chats"));
  $("model").addEventListener("change", () => { state.current.model = $("model").value; save(); pollEngine(); });
  $("toggle-sidebar").addEventListener("click", () => togglePanel("sidebar", "show-sidebar", "hide-sidebar"));
  $("toggle-engine").addEventListener("click", () => togglePanel("engine", "show-engine", "hide-engine"));
  for (const close of document.querySelectorAll(".close-panel")) close.addEventListener("click", closeOverlays);
  $("open-settings").addEventListener("click", openSettings);
  $("settings-form").addEventListener("submit", saveSettings);
  $("settings-cancel").addEventListener("click", () => $("settings-dialog").close());
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem(KEY, $("key-input").value.trim());
    $("key-dialog").close();
    loadModels();
  });
  $("key-dialog").addEventListener("cancel", (e) => e.preventDefault()); // nothing works without the key
  document.addEventListener("visibilitychange", () => { if (!document.hidden) pollEngine(); });
  loadModels();
  $("prompt").focus();
}

start();

// The chat page: streams answers through the gateway with streamer-client.js, shows time to first
// token and tokens/s live, stops on demand, and resumes an unfinished answer after a reload (the
// conversation and the id of the answer in progress are kept in localStorage).

import { renderMarkdown } from "./markdown.js";
import { StreamerClient, StreamerError } from "./streamer-client.js";

const STORE = "streamer.chat.v1";
const $ = (id) => document.getElementById(id);
const ui = {
  log: $("log"), empty: $("empty"), status: $("status"), form: $("form"), prompt: $("prompt"),
  send: $("send"), stop: $("stop"), clear: $("clear"), ttft: $("ttft"), tps: $("tps"), ntok: $("ntok"),
  finish: $("finish"), mode: $("mode"), system: $("system"), token: $("token"), extra: $("extra"),
};
const NUMBER_PARAMS = { max_tokens: parseInt, temperature: parseFloat, top_p: parseFloat, top_k: parseInt, seed: parseInt };

// --- state ----------------------------------------------------------------------------------------

let chat = load(); // { history: [{ role, content, meta?, empty? }], active: { id, started } | null }
let client = null;
let clientToken = null;
let current = null; // the answer streaming now: { stream, el, text, ... }

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE));
    if (saved && Array.isArray(saved.history)) return saved;
  } catch { /* a corrupt entry starts a new chat */ }
  return { history: [], active: null };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(chat));
}

function getClient() {
  const token = ui.token.value.trim() || new URLSearchParams(location.search).get("token") || "";
  if (client && token === clientToken) return client;
  if (client) client.close();
  clientToken = token;
  localStorage.setItem(`${STORE}.token`, token);
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws`;
  client = new StreamerClient(url, { token: token || undefined, onStatus: showStatus, progress: true });
  client.connect(); // the badge tells the truth from the start, before anything is sent
  return client;
}

let socketStatus = "closed";
let workersAlive = null; // live workers at the last look (/readyz, or an `accepted` frame); null: unknown
const NO_WORKER = "no worker is serving requests: start one with `streamer worker` (or use `streamer up`)";

function showStatus(status) {
  socketStatus = status;
  paintBadge();
}

// One badge for the whole state: the socket to the gateway, and whether any worker is behind it.
function paintBadge() {
  const idleOrOpen = socketStatus === "open";
  const state = idleOrOpen && workersAlive === 0 ? "no-worker" : socketStatus;
  ui.status.dataset.status = state;
  ui.status.textContent = { open: "online", connecting: "connecting…", reconnecting: "reconnecting…",
    closed: "offline", "no-worker": "no worker" }[state] || state;
  ui.status.title = {
    reconnecting: "cannot reach the gateway: is it running? does it need an API key (Settings)?",
    "no-worker": NO_WORKER,
  }[state] || "connection to the gateway";
}

async function pollWorkers() {
  try {
    const resp = await fetch("/readyz", { cache: "no-store" });
    const body = await resp.json();
    workersAlive = body.redis ? body.workers.length : null;
    const lens = (body.workers || []).map((w) => Number(w.max_model_len) || 0);
    if (lens.length) maxModelLen = Math.max(...lens);
  } catch {
    workersAlive = null; // the gateway itself is away: the socket's status says so
  }
  paintBadge();
}

// --- rendering ------------------------------------------------------------------------------------

function addMessage(role, content, meta, empty = false) {
  ui.empty.hidden = true;
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const text = document.createElement("div");
  text.className = "text";
  el.append(text);
  showText(el, content, empty);
  if (meta) setMeta(el, meta);
  ui.log.append(el);
  ui.log.scrollTop = ui.log.scrollHeight;
  return el;
}

// The user's words as typed; the model's answer as Markdown (markdown.js: never as HTML). An answer
// that finished without any text says so instead of showing an empty bubble.
const EMPTY_ANSWER = "(empty answer: the model ended it before writing any text)";

function showText(el, content, empty = false) {
  const text = el.querySelector(".text");
  el.dataset.answer = content; // the Markdown source, as the model wrote it
  el.classList.toggle("empty-answer", empty);
  if (empty) text.textContent = EMPTY_ANSWER;
  else if (el.classList.contains("assistant")) renderMarkdown(text, content);
  else text.textContent = content;
}

function setMeta(el, meta) {
  let m = el.querySelector(".meta");
  if (!m) {
    m = document.createElement("span");
    m.className = "meta";
    el.append(m);
  }
  m.textContent = meta;
}

function fmtMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

// Tokens/s counts only tokens generated while we watched: after a resume, the replayed ones arrive
// in a burst and would inflate it.
function showStats(a) {
  ui.ttft.textContent = a.ttft == null ? "–" : fmtMs(a.ttft);
  const span = (a.lastAt - a.firstAt) / 1000;
  ui.tps.textContent = a.live > 1 && span > 0 ? ((a.live - 1) / span).toFixed(1) : "–";
  ui.ntok.textContent = String(a.tokens);
}

// Where the request is before its first token (the gateway's `status` frames).
function describeProgress(f) {
  if (f.state === "queued") {
    if (workersAlive === 0) return `${NO_WORKER}; this message waits in the queue`;
    if (f.position === undefined) return "queued, waiting for a worker…";
    return f.position === 0 ? "queued: next in line" : `queued: ${f.position} request${f.position > 1 ? "s" : ""} ahead`;
  }
  if (f.state === "starting") return "a worker took it: preparing the prompt…";
  const done = `${f.computed.toLocaleString()} / ${f.total.toLocaleString()} tokens`;
  if (f.state === "waiting") return `waiting for room on the worker (${done} of the prompt computed)`;
  return `processing the prompt: ${Math.floor((100 * f.computed) / f.total)}% (${done})`;
}

function keepInView(el) {
  const nearBottom = ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 160;
  if (nearBottom) el.scrollIntoView({ block: "nearest" });
}

// Paint at most once per frame: many tokens can arrive between two frames.
function paint(a) {
  if (a.painting) return;
  a.painting = true;
  requestAnimationFrame(() => {
    a.painting = false;
    showText(a.el, a.text);
    showStats(a);
    const nearBottom = ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 80;
    if (nearBottom) ui.log.scrollTop = ui.log.scrollHeight;
  });
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
}

// --- requests -------------------------------------------------------------------------------------

function params() {
  const p = {};
  for (const [name, parse] of Object.entries(NUMBER_PARAMS)) {
    const raw = $(name).value.trim();
    if (raw !== "") p[name] = parse(raw);
  }
  const extra = ui.extra.value.trim();
  if (extra) Object.assign(p, JSON.parse(extra)); // a typo surfaces as an error in the chat
  return p;
}

// The conversation sent with a message must fit the model's context (max_model_len, from the workers'
// heartbeats via /readyz). Tokens are estimated from characters, at the ratio the worker's own count
// gave for the last prompt (its usage, or its refusal of one too long): a guess that stays too high
// would leave out messages that fit, on every message after a long one. The oldest turns go first.
let maxModelLen = 0;
let tokensPerChar = 0.5;
const estimate = (m) => Math.ceil(m.content.length * tokensPerChar) + 4;

function contextMessages(promptText, maxTokens) {
  const system = ui.system.value.trim() ? [{ role: "system", content: ui.system.value.trim() }] : [];
  // Refused messages (and their failed answers) are never sent again.
  const turns = chat.history.filter((m) => !m.refused && (m.role === "user" || m.role === "assistant"))
    .map((m) => ({ role: m.role, content: m.content }));
  const last = { role: "user", content: promptText };
  let dropped = 0;
  if (maxModelLen) {
    const budget = maxModelLen - Math.min(maxTokens, maxModelLen / 2);
    const size = () => [...system, ...turns, last].reduce((n, m) => n + estimate(m), 0);
    while (turns.length && size() > budget) {
      turns.shift();
      dropped += 1;
    }
  }
  return { messages: [...system, ...turns, last], dropped };
}

function buildRequest(promptText) {
  const p = params();
  if (ui.mode.value === "raw") return { request: { prompt: promptText, params: p }, dropped: 0 };
  const { messages, dropped } = contextMessages(promptText, p.max_tokens ?? 256);
  return { request: { messages, params: p }, dropped };
}

// How many tokens a character is, from the worker's count of a prompt of `sentChars` characters.
function learnRatio(promptTokens, sentChars) {
  if (promptTokens > 0 && sentChars > 0) tokensPerChar = Math.min(2, Math.max(0.05, promptTokens / sentChars));
}

// A prompt the worker found too long: its count, and the context, for the next estimate.
function learnFromRefusal(message, sentChars) {
  const m = /prompt has (\d+) tokens but the model allows at most (\d+)/.exec(message || "");
  if (!m) return;
  learnRatio(Number(m[1]), sentChars);
  maxModelLen = maxModelLen || Number(m[2]) + 1;
}

// Until the first token, the message says where it is and for how long it has waited (a long prompt
// can take a minute on a CPU): queued, its prompt's progress (tokens computed / total), or waiting.
function describeWait(a) {
  if (a.progress) return describeProgress(a.progress);
  if (workersAlive === 0) return `${NO_WORKER}; this message waits in the queue`;
  return Date.now() - a.since >= 2000 ? "waiting for a worker…" : "";
}

function showWait(a) {
  if (a.tokens) return;
  const wait = describeWait(a);
  if (wait) setMeta(a.el, `${wait} · ${Math.floor((Date.now() - a.since) / 1000)} s`);
  keepInView(a.el);
}

async function follow(stream, el, sentAt, sentChars = 0, note = "", since = Date.now()) {
  const a = { stream, el, text: "", tokens: 0, live: 0, ttft: null, firstAt: 0,
    lastAt: 0, painting: false, sentChars, refused: false, progress: null, since, empty: false };
  current = a;
  el.dataset.state = "streaming";
  el.dataset.id = stream.id;
  setBusy(true);
  ui.finish.textContent = "";
  showStats(a);
  let meta = "";
  // Until the first token: where the request is (queued at place N, its prompt N% computed), or,
  // without word from the gateway, that it is waiting; with the time waited, every second.
  stream.onProgress = (frame) => {
    a.progress = frame;
    showWait(a);
  };
  const waiting = setInterval(() => showWait(a), 1000);
  try {
    for await (const event of stream) {
      const now = performance.now();
      if (event.type === "token") {
        const n = event.token_ids ? event.token_ids.length : 1;
        if (!a.tokens) el.querySelector(".meta")?.remove();
        if (event.seq > stream.replayedThrough) { // generated now, not replayed after a resume
          if (!a.live) {
            a.firstAt = now;
            if (sentAt != null) a.ttft = now - sentAt;
          }
          a.live += n;
          a.lastAt = now;
        }
        a.tokens += n;
        a.text += event.text;
        paint(a);
      } else if (event.type === "done") {
        const reason = event.finish_reason || "done";
        el.dataset.answer = a.text; // whole before the state says so
        el.dataset.state = reason === "abort" ? "stopped" : "done";
        meta = reason === "abort" ? "stopped" : `finish: ${reason}`;
        if (event.usage) meta += ` · ${event.usage.prompt_tokens} prompt + ${event.usage.completion_tokens} completion tokens`;
        if (event.usage) learnRatio(event.usage.prompt_tokens, a.sentChars);
        a.empty = reason !== "abort" && !a.text;
      }
    }
  } catch (err) {
    el.dataset.state = "error";
    meta = err instanceof StreamerError ? `error ${err.code}: ${err.event.message}` : `error: ${err}`;
    if (err instanceof StreamerError && REFUSED.has(err.code)) {
      a.refused = true;
      learnFromRefusal(err.event.message, a.sentChars);
      meta += " · this message is left out of the conversation from now on: shorten it, or start a New chat";
    }
  }
  clearInterval(waiting);
  el.dataset.replayed = String(a.tokens - a.live); // tokens replayed after a resume, not in tokens/s
  if (note) meta = meta ? `${note} · ${meta}` : note;
  showText(el, a.text, a.empty);
  showStats(a);
  ui.finish.textContent = meta;
  setMeta(el, meta);
  if (current === a) current = null;
  setBusy(false);
  el.scrollIntoView({ block: "nearest" });
  if (a.discarded) return; // "New chat" was pressed while it streamed
  chat.active = null;
  if (a.refused) {
    const asked = chat.history[chat.history.length - 1];
    if (asked && asked.role === "user") asked.refused = true;
  }
  chat.history.push({ role: "assistant", content: a.text, meta, refused: a.refused || undefined,
    empty: a.empty || undefined });
  save();
}

// Codes that refuse the prompt itself: resending the same message could only fail the same way.
const REFUSED = new Set(["invalid_request", "too_large", "bad_encoding"]);

function send(promptText) {
  const { request, dropped } = buildRequest(promptText);
  chat.history.push({ role: "user", content: promptText });
  addMessage("user", promptText);
  const stream = getClient().generate(request);
  chat.active = { id: stream.id, started: Date.now() };
  save();
  const note = dropped ? `${dropped} earlier message${dropped > 1 ? "s" : ""} left out to fit the model's context` : "";
  const el = addMessage("assistant", "", note || undefined);
  const sentChars = (request.messages || [{ content: request.prompt }]).reduce((n, m) => n + m.content.length, 0);
  stream.onAccepted = (frame) => {
    if (frame.workers === undefined) return;
    workersAlive = frame.workers;
    paintBadge();
    if (frame.workers === 0 && !el.querySelector(".text").textContent) setMeta(el, `${NO_WORKER}; this message waits in the queue`);
  };
  return follow(stream, el, performance.now(), sentChars, note);
}

// --- wiring ---------------------------------------------------------------------------------------

ui.form.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || current) return;
  try {
    params();
  } catch (err) {
    ui.finish.textContent = `more params: not valid JSON (${err.message})`;
    return;
  }
  ui.prompt.value = "";
  send(text);
});

ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    ui.form.requestSubmit();
  }
});

ui.stop.addEventListener("click", () => {
  if (!current) return;
  current.stream.cancel();
  ui.stop.disabled = true;
  setMeta(current.el, "stopping…");
});

ui.clear.addEventListener("click", () => {
  if (current) {
    current.discarded = true;
    current.stream.cancel();
  }
  chat = { history: [], active: null };
  save();
  for (const el of [...ui.log.querySelectorAll(".msg")]) el.remove();
  ui.empty.hidden = false;
  ui.finish.textContent = "";
});

// Settings survive reloads too.
for (const id of [...Object.keys(NUMBER_PARAMS), "mode", "system", "extra"]) {
  const key = `${STORE}.setting.${id}`;
  const saved = localStorage.getItem(key);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem(key, $(id).value));
}
ui.token.value = localStorage.getItem(`${STORE}.token`) || "";
// A new key needs a new connection; reloading also resumes the answer in progress with it.
ui.token.addEventListener("change", () => {
  localStorage.setItem(`${STORE}.token`, ui.token.value.trim());
  if (current) location.reload();
});

// Restore the conversation; an answer that was streaming when the page went away is resumed from the
// start of its events (the gateway replays them from Redis, then continues live).
for (const m of chat.history) addMessage(m.role, m.content, m.meta, m.empty);
if (chat.active) {
  const el = addMessage("assistant", "");
  follow(getClient().resume(chat.active.id, -1), el, null, 0, "", chat.active.started);
}
getClient();
pollWorkers();
setInterval(pollWorkers, 5000);
ui.prompt.focus();

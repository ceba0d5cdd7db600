// streamer WebSocket client: an ES module for browsers and Node (>= 22, or 20 with
// --experimental-websocket, or pass any WHATWG-compatible WebSocket class as `options.WebSocket`).
//
//   import { StreamerClient } from "./streamer-client.js";
//   const client = new StreamerClient("ws://127.0.0.1:8000/ws", { token: "KEY" });
//   const stream = client.generate({ prompt: "Hello", params: { max_tokens: 64 } });
//   for await (const event of stream) if (event.type === "token") process.stdout.write(event.text);
//   stream.cancel();   // or client.cancel(stream.id); leaving the loop early cancels too
//
// The socket reconnects by itself (exponential backoff) and resumes every unfinished request from the
// last `seq` it saw, so a dropped connection costs neither tokens nor duplicates. A page that reloads
// calls `client.resume(id)` with the id it stored. Wire format: docs/gateway.md.

const FINAL = new Set(["done", "error"]);

/** A request that ended with an `error` event (from the worker or the gateway). */
export class StreamerError extends Error {
  constructor(event) {
    super(`${event.code}: ${event.message}`);
    this.name = "StreamerError";
    this.code = event.code;
    this.id = event.id;
    this.event = event;
  }
}

function randomId() {
  const c = globalThis.crypto;
  if (c && typeof c.randomUUID === "function") return c.randomUUID();
  const bytes = new Uint8Array(16);
  c.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** One request's events, as an async iterator. Ends after `done`; throws StreamerError on `error`. */
export class Stream {
  constructor(client, id, afterSeq) {
    this.client = client;
    this.id = id;
    this.lastSeq = afterSeq; // highest seq delivered; resume continues after it
    this.finished = false;
    this.accepted = false;
    this.workers = undefined;
    this.onAccepted = () => {}; // called with the `accepted` frame ({ id, workers })
    // With the client's `progress` option, until the first event: `status` frames ({ state: "queued",
    // position } | { state: "starting" } | { state: "waiting" | "prefill", computed, total }).
    this.onProgress = () => {};
    // With `progress`, on a resume: events up to `last_seq` are replayed from Redis, not generated now.
    this.replayedThrough = -1;
    this.onResumed = () => {};
    this._events = [];
    this._wake = null;
  }

  /** Stop generating: the worker aborts the request and frees its KV cache; the stream ends with done/abort. */
  cancel() {
    this.client.cancel(this.id);
  }

  _push(event) {
    if (this.finished) return;
    if (typeof event.seq === "number") {
      if (event.seq <= this.lastSeq) return; // seen before a reconnect
      this.lastSeq = event.seq;
    }
    if (FINAL.has(event.type)) this.finished = true;
    this._events.push(event);
    if (this._wake) {
      this._wake();
      this._wake = null;
    }
  }

  async *[Symbol.asyncIterator]() {
    try {
      for (;;) {
        while (this._events.length) {
          const event = this._events.shift();
          if (event.type === "error") throw new StreamerError(event);
          yield event;
          if (event.type === "done") return;
        }
        await new Promise((resolve) => (this._wake = resolve));
      }
    } finally {
      // Leaving the loop early (break, return, an exception in its body) abandons the request: stop it.
      if (!this.finished) this.cancel();
      this.client._forget(this);
    }
  }

  /** The whole answer: { text, event } with the final `done` event. */
  async text() {
    let text = "";
    for await (const event of this) {
      if (event.type === "token") text += event.text;
      else if (event.type === "done") return { text, event };
    }
    return { text, event: null };
  }
}

export class StreamerClient {
  /**
   * @param {string} url    ws(s)://host:port/ws
   * @param {object} [options]
   * @param {string} [options.token]          API key (sent as ?token=, browsers cannot set headers)
   * @param {Function} [options.WebSocket]    WebSocket class (default: globalThis.WebSocket)
   * @param {boolean} [options.reconnect]     reconnect and resume after a drop (default true)
   * @param {number} [options.maxBackoffMs]   longest wait between reconnect attempts (default 5000)
   * @param {Function} [options.onStatus]     called with "connecting" | "open" | "reconnecting" | "closed"
   * @param {boolean} [options.progress]      ask for `status` frames before the first token and a
   *                                          `resumed` frame on resume (Stream.onProgress, onResumed)
   */
  constructor(url, options = {}) {
    this.url = options.token ? `${url}${url.includes("?") ? "&" : "?"}token=${encodeURIComponent(options.token)}` : url;
    this.WebSocket = options.WebSocket || globalThis.WebSocket;
    if (!this.WebSocket) throw new Error("no WebSocket class: pass options.WebSocket (Node 20: --experimental-websocket)");
    this.reconnect = options.reconnect !== false;
    this.maxBackoffMs = options.maxBackoffMs ?? 5000;
    this.onStatus = options.onStatus || (() => {});
    this.progress = options.progress === true;
    this.status = "closed";
    this._streams = new Map(); // id -> Stream, while unfinished
    this._outbox = []; // frames waiting for the socket to open
    this._ws = null;
    this._closedByUser = false;
    this._attempt = 0;
    this._timer = null;
    this._keepOpen = false; // connect() was called: stay connected while idle, reconnect after drops
    this.lastError = null; // the last gateway error that belonged to no request (bad frame, ...)
  }

  /** Open the socket now and keep it open (reconnecting after drops) even with no request running. */
  connect() {
    this._keepOpen = true;
    this._closedByUser = false;
    if (!this._ws && !this._timer) this._connect();
  }

  /** Start a generation. `request`: { prompt | messages | prompt_token_ids, params?, id?, priority? }. */
  generate(request) {
    const id = request.id || randomId();
    const stream = this._track(new Stream(this, id, -1));
    stream.request = { ...request, type: "generate", id, ...(this.progress ? { progress: true } : {}) };
    this._send(stream.request);
    return stream;
  }

  /** Follow a request started earlier (e.g. before a page reload); `afterSeq` = last seq already seen. */
  resume(id, afterSeq = -1) {
    const stream = this._track(new Stream(this, id, afterSeq));
    stream.accepted = true; // it exists already: after a drop, resume it again
    this._send(this._resumeFrame(stream));
    return stream;
  }

  cancel(id) {
    this._send({ type: "cancel", id });
  }

  /** Close for good (unfinished requests are cancelled by the gateway after its grace period). */
  close() {
    this._closedByUser = true;
    clearTimeout(this._timer);
    if (this._ws) this._ws.close(1000, "client closed");
    this._setStatus("closed");
  }

  _track(stream) {
    const old = this._streams.get(stream.id);
    if (old && !old.finished) throw new Error(`request ${stream.id} is already streaming`);
    this._streams.set(stream.id, stream);
    this._closedByUser = false;
    return stream;
  }

  _forget(stream) {
    if (this._streams.get(stream.id) === stream) this._streams.delete(stream.id);
  }

  _resumeFrame(stream) {
    return { type: "resume", id: stream.id, after_seq: stream.lastSeq, ...(this.progress ? { progress: true } : {}) };
  }

  _send(frame) {
    if (this._ws && this._ws.readyState === 1) this._ws.send(JSON.stringify(frame));
    else {
      this._outbox.push(frame);
      if (!this._ws) this._connect();
    }
  }

  _setStatus(status) {
    if (status !== this.status) {
      this.status = status;
      this.onStatus(status);
    }
  }

  _connect() {
    clearTimeout(this._timer);
    this._setStatus(this._attempt ? "reconnecting" : "connecting");
    const ws = new this.WebSocket(this.url);
    this._ws = ws;
    ws.onopen = () => {
      this._attempt = 0;
      this._setStatus("open");
      const frames = this._outbox;
      this._outbox = [];
      for (const frame of frames) ws.send(JSON.stringify(frame));
    };
    ws.onmessage = (message) => this._receive(message.data);
    // Node 20's WebSocket fires only `error` (no `close`) when the connection is refused, and then
    // nothing keeps the process alive: a socket that never opened is treated as closed here.
    ws.onerror = () => {
      if (ws.readyState !== 1) lost({ code: 1006, reason: "connection failed" });
    };
    ws.onclose = (event) => lost(event);
    const lost = (event) => {
      if (this._ws !== ws) return;
      this._ws = null;
      const unfinished = [...this._streams.values()].filter((s) => !s.finished);
      if (this._closedByUser || !this.reconnect || (!unfinished.length && !this._outbox.length && !this._keepOpen)) {
        this._setStatus("closed");
        return;
      }
      // Resume every unfinished request where it stopped. A generate the gateway never confirmed is
      // sent again (if it did arrive, the gateway answers duplicate_id and we resume instead).
      // Other unsent frames (cancels) follow.
      const ids = new Set(unfinished.map((s) => s.id));
      const others = this._outbox.filter((frame) => !(ids.has(frame.id) && frame.type !== "cancel"));
      this._outbox = unfinished.map((s) => {
        if (s.accepted) return this._resumeFrame(s);
        s.retried = true;
        return s.request;
      });
      this._outbox.push(...others);
      this._attempt += 1;
      const delay = Math.min(this.maxBackoffMs, 100 * 2 ** Math.min(this._attempt, 10)) * (0.5 + Math.random() / 2);
      this._setStatus("reconnecting");
      this.lastClose = { code: event.code, reason: event.reason };
      this._timer = setTimeout(() => {
        this._timer = null;
        this._connect();
      }, delay);
    };
  }

  _receive(data) {
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      return;
    }
    const stream = event.id != null ? this._streams.get(event.id) : undefined;
    if (event.type === "accepted") {
      if (stream) {
        stream.accepted = true;
        stream.workers = event.workers; // live workers the gateway knows of (0: nobody serves yet)
        stream.onAccepted(event);
      }
      return;
    }
    if (!stream) {
      if (event.type === "error") this.lastError = event;
      return;
    }
    if (event.type === "status") return stream.onProgress(event);
    if (event.type === "resumed") {
      stream.replayedThrough = event.last_seq;
      return stream.onResumed(event);
    }
    if (event.type === "error" && event.source === "gateway" && event.code === "duplicate_id" && stream.retried) {
      stream.retried = false;
      stream.accepted = true;
      this._send(this._resumeFrame(stream));
      return;
    }
    if (event.type === "error" && event.source === "gateway" && event.code === "already_finished") {
      // Resumed a request whose end we had already seen (a reload raced its `done`): nothing is missing.
      stream._push({ type: "done", id: event.id, finish_reason: null, resumed_after_end: true });
    } else {
      stream._push(event);
    }
    // The stream keeps its own events; the client only tracks unfinished ones (for reconnects).
    if (stream.finished) this._forget(stream);
  }
}

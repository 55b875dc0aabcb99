// clover serve's chat page (docs/server.md, "The web page"). Plain JavaScript, no library.
// A conversation goes to POST /v1/chat/completions with stream: true; with "show the canvas"
// the request asks for stream_options.include_canvas and the server's clover.canvas events
// (the block after every denoising step) are drawn under the reply.
"use strict";

const $ = (sel) => document.querySelector(sel);
const STEP_COLOURS = 8;  // steps 1 .. 7 get a colour each, 8 and later the last one

const state = { messages: [], controller: null, busy: false, blockTouched: false };

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("#api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, kind) {
  const s = $("#status");
  s.textContent = text;
  s.className = "status " + (kind || "");
}

// ------------------------------------------------------------------ the server's information

async function loadInfo() {
  try {
    const r = await fetch("/props", { headers: headers() });
    if (r.status === 401) {
      setStatus("API key needed", "warn");
      $("#api-key").classList.add("need");
      return;
    }
    const p = await r.json();
    $("#api-key").classList.remove("need");
    $("#model-name").textContent = `${p.model} · n_ctx ${p.n_ctx}`;
    if (!state.blockTouched && p.train_block_size && p.train_block_size <= p.limits.max_block_size) {
      $("#block-size").value = String(p.train_block_size);  // the canvas shows most at the trained B
    }
    setStatus("ready", "ok");
  } catch (e) {
    setStatus("server unreachable", "err");
  }
}

// ------------------------------------------------------------------ the request

function num(id, int) {
  const v = $(id).value.trim();
  if (v === "") return undefined;
  const x = int ? parseInt(v, 10) : parseFloat(v);
  return Number.isFinite(x) ? x : undefined;
}

function requestBody() {
  const body = { stream: true, stream_options: { include_usage: true } };
  const put = (k, v) => { if (v !== undefined) body[k] = v; };
  put("max_tokens", num("#max-tokens", true));
  put("temperature", num("#temperature"));
  put("top_p", num("#top-p"));
  put("top_k", num("#top-k", true));
  put("seed", num("#seed", true));
  const b = $("#block-size").value.trim();
  if (b === "auto" || b === "") body.block_size = "auto";
  else put("block_size", parseInt(b, 10));
  put("threshold", num("#threshold"));
  put("max_steps", num("#max-steps", true));
  const ds = $("#draft-self").value;
  body.draft_self = ds === "auto" ? "auto" : ds === "true";
  // the coreset: an integer, "model" or (anything else) as typed, for the server to accept or refuse
  const cs = $("#coreset").value.trim();
  if (cs !== "") body.coreset = /^\d+$/.test(cs) ? parseInt(cs, 10) : cs;
  if ($("#show-canvas").checked) body.stream_options.include_canvas = true;
  const system = $("#system").value.trim();
  body.messages = (system ? [{ role: "system", content: system }] : []).concat(state.messages);
  return body;
}

// Server-sent events from a fetch response: {event, data} per event (sse-starlette ends its
// lines with \r\n; any of the three line ends is accepted, as the SSE spec says).
async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let m;
    while ((m = buf.match(/\r\n\r\n|\n\n|\r\r/))) {
      const raw = buf.slice(0, m.index);
      buf = buf.slice(m.index + m[0].length);
      let event = "message";
      const data = [];
      for (const line of raw.split(/\r\n|\n|\r/)) {
        if (!line || line.startsWith(":")) continue;
        const i = line.indexOf(":");
        const field = i < 0 ? line : line.slice(0, i);
        let v = i < 0 ? "" : line.slice(i + 1);
        if (v.startsWith(" ")) v = v.slice(1);
        if (field === "event") event = v;
        else if (field === "data") data.push(v);
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// ------------------------------------------------------------------ the views

function stepClass(step) {
  return "s" + Math.min(step, STEP_COLOURS);
}

function visible(piece) {
  // a token's text as a cell shows it: line ends and tabs visible, an empty piece a dot
  if (piece === "") return "·";
  return piece.replace(/\n/g, "↵").replace(/\t/g, "→");
}

class ReplyView {
  constructor(container) {
    this.root = el("div", "msg assistant");
    this.root.append(el("div", "role", "Clover"));
    this.text = el("div", "text");
    this.root.append(this.text);
    this.canvasBox = el("div", "canvas");
    this.canvasHead = el("div", "canvas-head", "canvas");
    this.blocks = el("div", "blocks");
    this.canvasBox.append(this.canvasHead, this.blocks);
    this.canvasBox.hidden = true;
    this.root.append(this.canvasBox);
    this.stats = el("div", "stats");
    this.root.append(this.stats);
    container.append(this.root);
    this.cur = null;          // the block being drawn: {start, offset, el, cells}
    this.nSteps = 0;
    this.nBlocks = 0;
    this.kept = [];           // draft-self: per verification, [drafted tokens accepted, drafted]
    this.content = "";
  }

  addText(piece) {
    this.content += piece;
    this.text.textContent = this.content;
    this.text.classList.add("streaming");
    scrollDown();
  }

  canvas(ev) {
    this.canvasBox.hidden = false;
    this.nSteps += 1;
    if (!this.cur || this.cur.start !== ev.block_start) {
      this.endBlock();
      const b = el("span", "block current" + (ev.verified ? " verified" : ""));
      b.dataset.offset = ev.offset;
      this.blocks.append(b);
      this.cur = { start: ev.block_start, offset: ev.offset, el: b, cells: [] };
      this.nBlocks += 1;
    }
    const cur = this.cur;
    for (const c of cur.el.querySelectorAll(".fresh")) c.classList.remove("fresh");
    while (cur.cells.length < ev.tokens.length) {
      const c = el("span", "tok masked");
      c.textContent = " ";
      cur.el.append(c);
      cur.cells.push({ el: c, tok: null, step: null, br: null });
    }
    ev.tokens.forEach((tok, i) => {
      const cell = cur.cells[i];
      const step = ev.steps[i];
      if (tok === cell.tok && step === cell.step) return;
      cell.tok = tok;
      cell.step = step;
      const c = cell.el;
      if (cell.br) { cell.br.remove(); cell.br = null; }
      if (tok === null) {
        c.className = "tok masked";
        c.textContent = " ";
        c.removeAttribute("data-step");
        c.title = `position ${ev.offset + i}: masked`;
        return;
      }
      c.className = `tok ${stepClass(step)} fresh`;
      c.textContent = visible(tok);
      c.dataset.step = step;
      c.title = `position ${ev.offset + i} · step ${step} of its block` +
                (ev.verified ? " · verified (draft-self)" : "") + ` · ${JSON.stringify(tok)}`;
      if (tok.endsWith("\n")) {
        cell.br = document.createElement("br");
        c.after(cell.br);
      }
    });
    let what = `step ${ev.step} · ${ev.n_masked} masked`;
    if (ev.drafted) {
      // one event per verification: the kept tokens (the draft's accepted prefix, then the
      // model's own token where it rejected one) and the draft it checked. A rejected draft
      // token is shown struck through after the model's own; the ones after it never count.
      const n = ev.drafted.filter((d) => d !== null).length;
      let k = 0;
      while (k < n && ev.tokens[k] === ev.drafted[k]) k += 1;
      this.kept[this.nBlocks - 1] = [k, n];
      cur.cells.forEach((cell, i) => {
        cell.el.classList.toggle("accepted", i < k);
        cell.el.classList.toggle("own", i === k && k < n);
        if (i === k && k < n) {
          const rej = el("s", "rejected");
          rej.textContent = visible(ev.drafted[i]);
          rej.title = `drafted ${JSON.stringify(ev.drafted[i])}, rejected by the verification`;
          cell.el.append(rej);
        }
      });
      cur.el.title = `verification ${this.nBlocks}: ${k} of ${n} drafted tokens accepted` +
        (k < n ? ", then the model's own token" : "");
      what = `verification · ${k} of ${n} drafted accepted`;
    }
    this.canvasHead.textContent = `canvas · block ${this.nBlocks} (tokens ${ev.offset}..${ev.offset + ev.tokens.length - 1})` +
      ` · ${what}`;
    scrollDown();
  }

  endBlock() {
    // a finished block: positions never unmasked (past the budget, or left to the next block
    // after a draft-self rejection) are not the reply's
    if (!this.cur) return;
    for (const cell of this.cur.cells) {
      if (cell.tok === null) cell.el.remove();
    }
    for (const c of this.cur.el.querySelectorAll(".fresh")) c.classList.remove("fresh");
    this.cur.el.classList.remove("current");
    this.cur = null;
  }

  finish(stats, usage, how) {
    this.endBlock();
    this.text.classList.remove("streaming");
    this.root.classList.add("done");
    if (usage) {
      // canvas positions past the reply's end (after EOS or a stop string): drawn dimmed
      for (const b of this.blocks.querySelectorAll(".block")) {
        const off = parseInt(b.dataset.offset, 10);
        [...b.querySelectorAll(".tok")].forEach((c, i) => {
          if (off + i >= usage.completion_tokens) c.classList.add("cut");
        });
      }
    }
    const parts = [];
    if (how) parts.push(how);
    if (usage) parts.push(`${usage.completion_tokens} tokens`);
    if (stats) {
      parts.push(`${stats.tokens_per_forward} tok/forward`);
      parts.push(`${stats.tokens_per_second} tok/s`);
      parts.push(`B ${stats.block_size}`);
      if (stats.mode) parts.push(stats.mode);
      parts.push(`${stats.decode_passes} passes`);
      if (stats.coreset) parts.push(`coreset ${stats.coreset}`);  // the server's: what the passes used
      if (stats.draft_self) {
        const d = stats.draft_self;
        parts.push(`draft-self: ${d.accepted} of ${d.drafted} drafted tokens accepted, ${d.verifications} verifications`);
      }
      if (stats.reused_prompt_tokens) parts.push(`${stats.reused_prompt_tokens} prompt tokens reused`);
      parts.push(`seed ${stats.seed}`);
    }
    if (this.nSteps) {
      this.canvasHead.textContent = `canvas · ${this.nBlocks} block${this.nBlocks === 1 ? "" : "s"}, ` +
        `${this.nSteps} step${this.nSteps === 1 ? "" : "s"} (hover a token for its step)`;
      if (this.kept.length) {
        const per = this.kept.filter(Boolean).map(([k, n]) => `${k}/${n}`);
        this.canvasHead.textContent += ` · drafted tokens accepted per verification: ${per.join(" ")}`;
      }
    }
    this.stats.textContent = parts.join(" · ");
    if (!this.content) this.text.textContent = how === "stopped" ? "(stopped)" : "(no text)";
  }

  fail(message) {
    this.endBlock();
    this.text.classList.remove("streaming");
    this.root.classList.add("error", "done");
    this.stats.textContent = "error: " + message;
  }
}

function scrollDown() {
  const m = $("#messages");
  m.scrollTop = m.scrollHeight;
}

function addUser(text) {
  const d = el("div", "msg user");
  d.append(el("div", "role", "You"), el("div", "text", text));
  $("#messages").append(d);
  scrollDown();
  return d;
}

function setBusy(busy) {
  state.busy = busy;
  $("#send").disabled = busy;
  $("#stop").disabled = !busy;
  $("#clear").disabled = busy;
  setStatus(busy ? "writing…" : "ready", busy ? "busy" : "ok");
}

// ------------------------------------------------------------------ one turn

async function send() {
  const text = $("#input").value.trim();
  if (!text || state.busy) return;
  $("#hint")?.remove();
  $("#input").value = "";
  const userEl = addUser(text);
  state.messages.push({ role: "user", content: text });
  const view = new ReplyView($("#messages"));
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let stats = null, usage = null, finish = null;
  const body = requestBody();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      let msg = `${r.status} ${r.statusText}`;
      try { msg = (await r.json()).error.message || msg; } catch (e) { /* not JSON */ }
      if (r.status === 401) $("#api-key").classList.add("need");
      throw new Error(msg);
    }
    for await (const ev of readEvents(r)) {
      if (ev.data === "[DONE]") break;
      const obj = JSON.parse(ev.data);
      if (ev.event === "clover.canvas" || obj.object === "clover.canvas") {
        view.canvas(obj);
        continue;
      }
      if (obj.error) throw new Error(obj.error.message);
      if (obj.usage) usage = obj.usage;
      if (obj.clover) stats = obj.clover;
      for (const c of obj.choices || []) {
        if (c.delta && c.delta.content) view.addText(c.delta.content);
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    view.finish(stats, usage, finish === "length" ? "max tokens reached" : finish ? "" : "ended");
  } catch (e) {
    if (e.name === "AbortError") {
      view.finish(null, null, "stopped");
    } else {
      view.fail(e.message);
      if (!view.content) {  // nothing came back: the turn is not part of the conversation
        state.messages.pop();
        userEl.classList.add("failed");
        $("#input").value = text;
      }
    }
  } finally {
    if (view.content) state.messages.push({ role: "assistant", content: view.content });
    state.controller = null;
    setBusy(false);
    $("#input").focus();
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

function clearChat() {
  if (state.busy) return;
  state.messages = [];
  $("#messages").replaceChildren();
}

function drawLegend() {
  const lg = $("#legend");
  lg.append(el("span", "legend-title", "step "));
  for (let s = 1; s <= STEP_COLOURS; s++) {
    lg.append(el("span", `tok ${stepClass(s)}`, s < STEP_COLOURS ? String(s) : `${s}+`));
  }
  const m = el("span", "tok masked", " ");
  m.title = "masked";
  lg.append(" ", m, el("span", "legend-title", " masked"));
}

document.addEventListener("DOMContentLoaded", () => {
  drawLegend();
  $("#composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("#settings-form").addEventListener("submit", (e) => { e.preventDefault(); loadInfo(); });
  $("#input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("#stop").addEventListener("click", stop);
  $("#clear").addEventListener("click", clearChat);
  $("#block-size").addEventListener("input", () => { state.blockTouched = true; });
  $("#api-key").addEventListener("change", loadInfo);
  loadInfo();
  $("#input").focus();
});

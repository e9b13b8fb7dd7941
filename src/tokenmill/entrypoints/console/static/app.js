// tokenmill console: a chat playground and a live view of the engine.
// Vanilla JS, no build step, no network access beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS_STORE = "tokenmill.settings";
const POLL_MS = 1000;

// With an API key the server let this page load only after sign-in (POST /ui/login); its
// HttpOnly session cookie then goes with every same-origin fetch, so the page never holds
// the key. Earlier versions kept the key in localStorage: drop it.
localStorage.removeItem("tokenmill.apiKey");

let modelName = null;
let history = [];          // the conversation sent with each request: [{role, content}]
let controller = null;     // AbortController of the answer being streamed
let factsShown = false;

// ---------------------------------------------------------------- formatting
function fmtNum(v, digits = 0) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
}
function fmtRate(v) { return v === null || v === undefined ? "–" : fmtNum(v, v < 10 ? 1 : 0); }
function fmtSecs(v) {
  if (v === null || v === undefined) return "–";
  if (v < 0.01) return (v * 1000).toFixed(1) + " ms";
  if (v < 1) return (v * 1000).toFixed(0) + " ms";
  return v.toFixed(2) + " s";
}
function fmtAxisSecs(v) {
  if (v === 0) return "0";
  if (v < 0.01) return (v * 1000).toFixed(1) + "ms";
  if (v < 1) return (v * 1000).toFixed(0) + "ms";
  return (v < 10 ? v.toFixed(1) : v.toFixed(0)) + "s";
}
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}
function fmtPct(v) { return v === null || v === undefined ? "–" : (v * 100).toFixed(v < 0.1 ? 1 : 0) + " %"; }

// ---------------------------------------------------------------- session
function setConn(kind, text) {
  const el = $("conn");
  el.className = "conn " + kind;
  el.textContent = text;
}
// A 401: the session ended (logout elsewhere, expiry, server restart). Loading / again shows the form.
function signedOut() {
  setConn("down", "signed out");
  $("relogin").hidden = false;
  $("logout-form").hidden = true;
}

// ---------------------------------------------------------------- live engine view
let pollTimer = null, polling = false, lastStats = null;
// One poll chain: a poll asked for while one is in flight is dropped (that one reschedules).
async function poll() {
  if (polling) return;
  polling = true;
  clearTimeout(pollTimer);
  try {
    const r = await fetch("/v1/engine/stats", { credentials: "same-origin", cache: "no-store" });
    if (r.status === 401) { signedOut(); }
    else if (!r.ok) { setConn("down", "stats: HTTP " + r.status); }
    else {
      lastStats = await r.json(); render(lastStats); setConn("ok", "live");
      $("relogin").hidden = true;
      $("logout-form").hidden = !lastStats.model.api_key_required;
    }
  } catch (e) {
    setConn("down", "server unreachable");
  } finally {
    polling = false;
    pollTimer = setTimeout(poll, POLL_MS);
  }
}

function setText(id, text) { const el = $(id); if (el.textContent !== text) el.textContent = text; }

function render(s) {
  const m = s.model, lm = s.last_minute;
  modelName = m.name;
  setText("model-name", m.name);
  setText("updated", "updated " + new Date(s.time * 1000).toLocaleTimeString());
  setText("running", fmtNum(s.running));
  setText("waiting", fmtNum(s.waiting));
  setText("tok-in", fmtRate(lm.tokens_in_per_s));
  setText("tok-out", fmtRate(lm.tokens_out_per_s));
  setText("tok-in-1m", "1 min avg " + fmtRate(lm.tokens_in_per_s_1m));
  setText("tok-out-1m", "1 min avg " + fmtRate(lm.tokens_out_per_s_1m));
  const pc = lm.prefix_cache;
  setText("hit-rate", s.prefix_cache.enabled ? fmtPct(pc.hit_rate) : "off");
  const layout = (s.cache_misses || []).find((m) => m.reason !== "cold" && m.reason !== "evicted");
  setText("hit-sub", s.prefix_cache.enabled
    ? `${fmtNum(pc.hit_tokens)} of ${fmtNum(pc.queried_tokens)} prompt tokens`
      + (layout ? ` · misses: ${layout.reason.replace("_", " ")} at token ${layout.usual_offset} (${fmtNum(layout.requests)})` : "")
    : "prefix caching disabled");
  setText("preemptions", fmtNum(s.preemptions_total));
  setText("preempt-sub", `${fmtNum(lm.preemptions)} in the last minute`);
  const sp = s.speculative || {enabled: false};
  setText("spec-rate", sp.enabled ? fmtPct(sp.acceptance_rate) : "off");
  setText("spec-sub", sp.enabled
    ? `${fmtNum(sp.accepted_tokens)} of ${fmtNum(sp.draft_tokens)} proposed tokens` : "--speculative-config not set");

  const kv = s.kv_blocks, total = Math.max(1, kv.total);
  for (const [id, n] of [["kv-used", kv.in_use], ["kv-cached", kv.cached], ["kv-free", kv.free]]) {
    $(id).style.width = (100 * n / total) + "%";
    $(id).style.minWidth = n > 0 ? "3px" : "0";  // a few blocks of a large pool stay visible
  }
  setText("kv-used-n", fmtNum(kv.in_use));
  setText("kv-cached-n", fmtNum(kv.cached));
  setText("kv-free-n", fmtNum(kv.free));
  setText("kv-total", `${fmtNum(kv.total)} blocks × ${m.block_size} tokens · ${fmtPct(kv.usage)} held by running requests`);

  drawSeries($("chart-tokens"), [
    { values: lm.series.tokens_in, color: cssVar("--in") },
    { values: lm.series.tokens_out, color: cssVar("--out") },
  ]);
  drawLatency($("chart-ttft"), lm.points.map((p) => [p[0], p[1]]), lm.ttft, lm.window_s);
  drawLatency($("chart-tpot"), lm.points.map((p) => [p[0], p[2]]), lm.tpot, lm.window_s);
  setText("ttft-pct", pctText(lm.ttft));
  setText("tpot-pct", pctText(lm.tpot));
  showTenants(s.tenants || []);
  if (!factsShown) { showFacts(m); factsShown = true; }
}

function showTenants(rows) {
  const table = $("tenants");
  table.hidden = rows.length === 0;
  const body = table.tBodies[0];
  body.textContent = "";
  for (const t of rows) {
    const queue = fmtSecs(t.queue_time_seconds);
    const cells = [t.tenant, String(t.priority_class), String(t.weight), fmtNum(t.active), fmtNum(t.requests),
                   fmtNum(t.prompt_tokens), fmtNum(t.cached_tokens), fmtNum(t.output_tokens), fmtNum(t.errors),
                   fmtNum(t.rejected), queue];
    const tr = body.insertRow();
    for (const c of cells) tr.insertCell().textContent = c;
  }
}

function pctText(p) {
  if (!p.count) return "no requests in the last minute";
  return `p50 ${fmtSecs(p.p50)} · p90 ${fmtSecs(p.p90)} · p99 ${fmtSecs(p.p99)} · n=${p.count}`;
}

function showFacts(m) {
  const rows = [
    ["Model", m.name], ["Weights from", m.path.split("/").pop() || m.path],
    ["Architecture", `${m.architecture}, ${m.layers} layers, hidden ${m.hidden_size}, vocab ${fmtNum(m.vocab_size)}`],
    ["Dtype", m.dtype], ["Quantization", m.quantization], ["Device", m.device],
    ["Weight memory", fmtBytes(m.weight_bytes)],
    ["KV pool", `${fmtBytes(m.kv_pool_bytes)}: ${fmtNum(m.num_blocks)} blocks × ${m.block_size} = ${fmtNum(m.pool_tokens)} tokens`],
    ["Context length", fmtNum(m.max_model_len)],
    ["Batching", `${m.batching}, up to ${m.max_num_seqs} sequences, ${fmtNum(m.max_num_batched_tokens)} tokens a step`],
    ["Prefix caching", m.prefix_caching ? "on" : "off"],
  ];
  const body = $("facts").tBodies[0];
  body.textContent = "";
  for (let i = 0; i < rows.length; i += 2) {
    const tr = body.insertRow();
    for (const [k, v] of rows.slice(i, i + 2)) {
      tr.insertCell().textContent = k;
      const cell = tr.insertCell();
      cell.textContent = v;
      if (k === "Weights from") cell.title = m.path;  // the full path on hover
    }
  }
}

// ---------------------------------------------------------------- charts (canvas)
function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const f of [1, 2, 2.5, 5, 10]) if (v <= f * p) return f * p;
  return 10 * p;
}

function prepare(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "10.5px system-ui, 'DejaVu Sans', sans-serif";
  return { ctx, w, h, left: 42, right: w - 6, top: 6, bottom: h - 15 };
}

function axes(g, ymax, fmt, xLabelLeft) {
  const { ctx, left, right, top, bottom } = g;
  ctx.strokeStyle = "#e3e6eb"; ctx.fillStyle = "#6b7280"; ctx.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    const y = Math.round(bottom - f * (bottom - top)) + 0.5;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(right, y); ctx.stroke();
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    ctx.fillText(fmt(ymax * f), left - 4, y);
  }
  ctx.textBaseline = "top";
  ctx.textAlign = "left"; ctx.fillText(xLabelLeft, left, bottom + 3);
  ctx.textAlign = "right"; ctx.fillText("now", right, bottom + 3);
}

// per-second series, oldest first (the last entry is the running second, so it is left out)
function drawSeries(canvas, series) {
  const g = prepare(canvas);
  const done = series.map((s) => s.values.slice(0, -1));
  const n = Math.max(2, ...done.map((v) => v.length));
  const ymax = niceMax(Math.max(1, ...done.flat()));
  axes(g, ymax, (v) => fmtNum(v, v < 10 && v > 0 ? 1 : 0), `−${n + 1} s`);
  const { ctx, left, right, top, bottom } = g;
  const x = (i) => left + (i / (n - 1)) * (right - left);
  const y = (v) => bottom - (v / ymax) * (bottom - top);
  series.forEach((s, k) => {
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.6; ctx.beginPath();
    done[k].forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
    ctx.stroke();
    ctx.globalAlpha = 0.10; ctx.fillStyle = s.color;
    ctx.lineTo(x(done[k].length - 1), bottom); ctx.lineTo(x(0), bottom); ctx.closePath(); ctx.fill();
    ctx.globalAlpha = 1;
  });
}

// one dot per finished request (x: seconds ago), dashed lines at p50 / p90 / p99
function drawLatency(canvas, points, pct, windowS) {
  const g = prepare(canvas);
  const pts = points.filter((p) => p[1] !== null && p[1] !== undefined);
  const top = Math.max(pct.p99 || 0, ...pts.map((p) => p[1]));
  const ymax = niceMax(top * 1.1 || 0.1);
  axes(g, ymax, fmtAxisSecs, `−${windowS} s`);
  const { ctx, left, right, bottom } = g;
  const x = (ago) => right - (Math.min(ago, windowS) / windowS) * (right - left);
  const y = (v) => bottom - (v / ymax) * (bottom - g.top);
  ctx.fillStyle = "rgba(37, 99, 235, 0.55)";
  for (const [ago, v] of pts) { ctx.beginPath(); ctx.arc(x(ago), y(v), 2.4, 0, 2 * Math.PI); ctx.fill(); }
  const lines = [["p50", pct.p50, "#10b981"], ["p90", pct.p90, "#f59e0b"], ["p99", pct.p99, "#dc2626"]];
  ctx.setLineDash([4, 3]); ctx.lineWidth = 1.2; ctx.textAlign = "left"; ctx.textBaseline = "bottom";
  for (const [name, v, color] of lines) {
    if (v === null || v === undefined) continue;
    ctx.strokeStyle = color; ctx.fillStyle = color;
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(right, yy); ctx.stroke();
    ctx.fillText(name, left + 3 + (name === "p50" ? 0 : name === "p90" ? 24 : 48), yy - 1);
  }
  ctx.setLineDash([]);
}

// ---------------------------------------------------------------- playground
const SETTING_IDS = ["system", "temperature", "top_p", "max_tokens", "seed"];
function loadSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
    for (const id of SETTING_IDS) if (saved[id] !== undefined) $(id).value = saved[id];
  } catch (e) { /* ignore a corrupt entry */ }
}
function saveSettings() {
  const out = {};
  for (const id of SETTING_IDS) out[id] = $(id).value;
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(out));
}
SETTING_IDS.forEach((id) => $(id).addEventListener("change", saveSettings));
loadSettings();

function numberOr(id, fallback) {
  const v = $(id).value.trim();
  if (v === "") return fallback;
  const n = Number(v);
  return Number.isFinite(n) ? n : fallback;
}

function addMessage(role, text) {
  const box = $("messages");
  const empty = box.querySelector(".empty");
  if (empty) empty.remove();
  const div = document.createElement("div");
  div.className = "msg " + role;
  const t = document.createElement("div");
  t.className = "text";
  t.textContent = text;
  div.appendChild(t);
  box.appendChild(div);
  box.scrollTop = box.scrollHeight;
  return div;
}

function addMeta(bubble, items) {
  const meta = document.createElement("div");
  meta.className = "meta";
  for (const [label, value, cls] of items) {
    const span = document.createElement("span");
    if (cls) span.className = cls;
    span.append(label + " ");
    const b = document.createElement("b");
    b.textContent = value;
    span.appendChild(b);
    meta.appendChild(span);
  }
  bubble.appendChild(meta);
}

// Reads an SSE body and calls onEvent(obj) for every `data:` JSON payload until [DONE].
async function readSSE(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
        for (const line of event.split(/\r?\n/)) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});  // after [DONE] or an error: stop reading, close the stream
  }
}

async function sendMessage(text) {
  const system = $("system").value.trim();
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  bubble.classList.add("streaming");
  const out = bubble.querySelector(".text");
  const body = {
    messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    stream: true, stream_options: { include_usage: true },
    temperature: numberOr("temperature", 0.7), top_p: numberOr("top_p", 1), max_tokens: numberOr("max_tokens", 256),
  };
  const seed = numberOr("seed", null);
  if (seed !== null) body.seed = Math.trunc(seed);
  if (modelName) body.model = modelName;

  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const t0 = performance.now();
  let tFirst = null, tLast = null, usage = null, finish = null, answer = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, credentials: "same-origin",
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => null);
      if (r.status === 401) signedOut();
      throw new Error((err && err.error && err.error.message) || "HTTP " + r.status);
    }
    await readSSE(r, (obj) => {
      if (obj.error) throw new Error(obj.error.message || "the server reported an error");
      if (obj.usage) usage = obj.usage;
      for (const choice of obj.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          const now = performance.now();
          if (tFirst === null) tFirst = now;
          tLast = now;
          answer += piece;
          out.textContent = answer;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else addMessage("error", e.message);
  } finally {
    controller = null;
    bubble.classList.remove("streaming");
    $("send").disabled = false; $("stop").disabled = true;
  }
  if (!answer && finish !== "stopped" && !usage) { bubble.remove(); history.pop(); return; }
  history.push({ role: "assistant", content: answer });
  const items = [];
  if (tFirst !== null) items.push(["TTFT", fmtSecs((tFirst - t0) / 1000), "ttft"]);
  const n = usage ? usage.completion_tokens : null;
  if (n && tFirst !== null) {
    // decode speed: tokens after the first over the time after the first
    const secs = (tLast - tFirst) / 1000;
    const rate = n > 1 && secs > 0 ? (n - 1) / secs : n / Math.max(1e-3, (tLast - t0) / 1000);
    items.push(["tokens/s", fmtRate(rate), "rate"]);
  }
  if (usage) {
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    items.push(["cached", `${fmtNum(cached)} / ${fmtNum(usage.prompt_tokens)} prompt tokens`, "cached"]);
    items.push(["output", `${fmtNum(n)} tokens`, "tokens"]);
  }
  if (finish) items.push(["finish", finish, "finish"]);
  addMeta(bubble, items);
}

$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  sendMessage(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $("chat-form").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  $("messages").textContent = "";
});
window.addEventListener("resize", () => { if (lastStats) render(lastStats); });

poll();

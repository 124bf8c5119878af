// dpserve dashboard: polls GET /engines every second; a tile per rank, two plots of the
// last few minutes, and (when the admin API is on) cordon / uncordon / drain buttons and
// a scale control. Plain DOM and canvas: no build step, nothing from elsewhere.
// Every URL is relative (the page works under --root-path), every request carries the
// API key typed into the page (kept in the page only), and every POST is JSON: the
// server's admin routes take nothing else.
"use strict";

const POLL_MS = 1000;
const HISTORY_S = 300;  // the plots show this many seconds
const history = [];  // {t, throughput, queue}, oldest first
const tiles = new Map();  // rank -> its tile element
let admin = false;
let sizeShown = false;  // the size box is filled in once; after that it is the user's

const $ = (id) => document.getElementById(id);

function authHeaders() {
  const key = $("api-key").value;
  return key ? { "Authorization": "Bearer " + key } : {};
}

async function post(path, body = {}) {
  const headers = { ...authHeaders(), "Content-Type": "application/json" };
  const resp = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
  let text = await resp.text();
  try {
    const json = JSON.parse(text);
    text = json.error ? json.error.message : JSON.stringify(json);
  } catch (e) { /* not JSON: show it as it came */ }
  return resp.status + " " + text;
}

function field(tile, name, value) {
  const el = tile.querySelector("[data-field=" + name + "]");
  if (el.textContent !== String(value)) el.textContent = value;
}

function makeTile(rank) {
  const tile = document.createElement("div");
  tile.className = "tile";
  tile.dataset.rank = rank;
  tile.innerHTML =
    '<h2><span>rank ' + rank + '</span><span class="state" data-field="state"></span></h2>' +
    '<div class="cordon-badge" data-field="cordon"></div>' +
    '<dl><dt>waiting</dt><dd data-field="waiting"></dd>' +
    '<dt>running</dt><dd data-field="running"></dd>' +
    '<dt>KV cache</dt><dd data-field="kv"></dd>' +
    '<dt>tokens/s</dt><dd data-field="tps"></dd>' +
    '<dt>TTFT</dt><dd data-field="ttft"></dd>' +
    '<dt>wave</dt><dd data-field="wave"></dd>' +
    '<dt>restarts</dt><dd data-field="restarts"></dd></dl>' +
    '<div class="bar"><div data-bar="kv"></div></div>' +
    '<div class="where" data-field="where"></div>' +
    '<div class="where" data-field="workers"></div>' +
    '<div class="where" data-field="lora"></div>' +
    '<div class="where" data-field="tier"></div>' +
    '<div class="where" data-field="spec"></div>' +
    '<div class="where" data-field="role"></div>' +
    '<div class="buttons" hidden>' +
    '<button type="button" data-action="cordon">Cordon</button>' +
    '<button type="button" data-action="uncordon">Uncordon</button>' +
    '<button type="button" data-action="drain">Drain</button></div>' +
    '<div class="answer" data-field="answer"></div>';
  tile.querySelectorAll("button[data-action]").forEach((button) => {
    button.addEventListener("click", async () => {
      const action = button.dataset.action;
      field(tile, "answer", action + "...");
      try {
        const answer = await post("engines/" + rank + "/" + action);
        field(tile, "answer", answer.startsWith("200 ") ? "200 " + action + " done" : answer);
      } catch (e) {
        field(tile, "answer", action + " failed: " + e);
      }
      poll();
    });
  });
  return tile;
}

function render(data) {
  const seen = new Set();
  for (const e of data.engines) {
    seen.add(e.rank);
    let tile = tiles.get(e.rank);
    if (!tile) {
      tile = makeTile(e.rank);
      tiles.set(e.rank, tile);
      $("tiles").appendChild(tile);
    }
    tile.dataset.state = e.state;
    tile.dataset.cordoned = String(e.cordoned);
    field(tile, "state", e.state);
    field(tile, "cordon", e.cordoned ? "cordoned" : "");
    field(tile, "waiting", e.waiting);
    field(tile, "running", e.running);
    field(tile, "kv", (100 * e.kv_cache_usage).toFixed(1) + " %");
    field(tile, "tps", e.tokens_per_s.toFixed(1));
    field(tile, "ttft", e.ttft_s ? (1000 * e.ttft_s).toFixed(0) + " ms" : "-");
    field(tile, "wave", e.wave);
    field(tile, "restarts", e.restarts);
    field(tile, "where", (e.host || "?") + (e.pid ? " pid " + e.pid : "") +
          " · incarnation " + e.incarnation);
    // Its tensor-parallel workers (worker 0 is the engine core): pid, device, memory.
    field(tile, "workers", (e.tp_workers || []).map((w) => "TP" + w.tp_rank + " pid " +
          w.pid + " " + w.device + " " + (w.rss_bytes / 1048576).toFixed(0) + " MiB")
          .join(" · "));
    // Its LoRA adapters (--enable-lora): resident in a device slot, then host-cached.
    field(tile, "lora", e.lora ? "LoRA " + (e.lora.resident.join(", ") || "-") +
          (e.lora.cached.length ? " (host: " + e.lora.cached.join(", ") + ")" : "") +
          " · " + e.lora.loads + " loads, " + e.lora.evictions + " evictions" : "");
    // Its use of the host's KV tier (--kv-offload-memory): the store's fill, the
    // prompt tokens found there of those looked up, bytes moved and load time.
    field(tile, "tier", e.kv_tier ? tierLine(e.kv_tier) : "");
    // Speculative decoding (--speculative-config): drafts accepted of those proposed.
    field(tile, "spec", e.spec_decode ? "drafts " + (100 * e.spec_decode.acceptance_rate)
          .toFixed(0) + " % accepted (" + e.spec_decode.accepted_tokens + " of " +
          e.spec_decode.draft_tokens + ") · " + e.spec_decode.mean_acceptance_length
          .toFixed(2) + " tokens per speculative step" : "");
    // Its role (--data-parallel-roles) and the handoffs in flight from or to it.
    field(tile, "role", e.role && e.role !== "both" ?
          e.role + " rank · " + (e.handoffs || 0) + " handoffs in flight" : "");
    tile.querySelector("[data-bar=kv]").style.width =
        Math.min(100, 100 * e.kv_cache_usage).toFixed(1) + "%";
    tile.querySelector(".buttons").hidden = !data.admin;
  }
  for (const [rank, tile] of tiles) {  // ranks scaled away
    if (!seen.has(rank)) { tile.remove(); tiles.delete(rank); }
  }
  admin = data.admin;
  $("admin").hidden = !admin;
  if (admin && !sizeShown) {
    sizeShown = true;
    if (!$("scale-size").value) $("scale-size").value = data.data_parallel_size;
  }
  const serving = data.engines.filter((e) => e.state === "serving" && !e.cordoned).length;
  $("summary").textContent = "data-parallel size " + data.data_parallel_size + " · " +
      serving + " placing new requests";
}

function tierLine(t) {
  const mib = (b) => (b / 1048576).toFixed(0) + " MiB";
  const store = t.num_blocks ? (100 * t.used_blocks / t.num_blocks).toFixed(0) + " % of " +
      t.num_blocks + " blocks · " : "";  // 0: not reported (or the store is down)
  const hits = t.queries ? (100 * t.hits / t.queries).toFixed(0) + " % hit (" + t.hits +
      " of " + t.queries + " tokens)" : "no lookups";
  return "KV tier " + store + hits + " · " + mib(t.loaded_bytes) + " loaded in " +
      t.load_seconds.toFixed(2) + " s, " + mib(t.saved_bytes) + " saved";
}

function record(data) {
  const now = Date.now() / 1000;
  history.push({
    t: now,
    throughput: data.engines.reduce((s, e) => s + e.tokens_per_s, 0),
    queue: data.engines.reduce((s, e) => s + e.waiting + e.running, 0),
  });
  while (history.length && now - history[0].t > HISTORY_S) history.shift();
}

function plot(canvas, key, color) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 28;
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000;
  const max = Math.max(1, ...history.map((p) => p[key]));
  ctx.strokeStyle = "#d6dbe4";
  ctx.fillStyle = "#5b6475";
  ctx.font = "11px system-ui, sans-serif";
  ctx.beginPath();
  ctx.moveTo(pad, 4); ctx.lineTo(pad, h - 16); ctx.lineTo(w - 4, h - 16);
  ctx.stroke();
  ctx.fillText(max.toFixed(0), 2, 12);
  ctx.fillText("0", 2, h - 16);
  ctx.fillText("-" + HISTORY_S / 60 + " min", pad, h - 3);
  ctx.fillText("now", w - 26, h - 3);
  if (history.length < 2) return;
  ctx.strokeStyle = color;
  ctx.lineWidth = 2;
  ctx.beginPath();
  history.forEach((p, i) => {
    const x = pad + (w - 4 - pad) * (1 - (now - p.t) / HISTORY_S);
    const y = (h - 16) - (h - 22) * (p[key] / max);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

async function poll() {
  try {
    const resp = await fetch("engines", { cache: "no-store", headers: authHeaders() });
    if (resp.status === 401) {
      $("status").textContent = "this server needs its API key: type it above";
      $("status").classList.add("error");
      return;
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const data = await resp.json();
    render(data);
    record(data);
    plot($("plot-throughput"), "throughput", "#2e9d5b");
    plot($("plot-queue"), "queue", "#4a7bd0");
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
    $("status").classList.remove("error");
  } catch (e) {
    $("status").textContent = "cannot reach the server: " + e.message;
    $("status").classList.add("error");
  }
}

$("scale-button").addEventListener("click", async () => {
  const n = parseInt($("scale-size").value, 10);
  $("scale-result").textContent = "scaling to " + n + "...";
  try {
    $("scale-result").textContent =
        await post("scale_elastic_ep", { new_data_parallel_size: n });
  } catch (e) {
    $("scale-result").textContent = "scale failed: " + e;
  }
  poll();
});

poll();
setInterval(poll, POLL_MS);

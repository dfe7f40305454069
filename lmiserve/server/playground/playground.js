// lmiserve playground: a chat streamed from POST /v1/chat/completions and the live batch from
// GET /playground/stats. Both are server-sent events read with fetch (EventSource cannot send the
// Authorization header). No dependencies, no build step.
"use strict";

const KEY_STORAGE = "lmiserve.apiKey";
const SPARK_POINTS = 60; // tokens/s samples the sparkline shows (~30 s at 2 updates/s)
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];

const $ = (id) => document.getElementById(id);
let conversation = []; // the turns sent with each request: {role, content}; Clear starts a new one
let vision = null; // {maxBytes, maxImages} while the served model takes images (stats' `vision`); null: it does not
let attached = null; // the image the next message sends: {url (a data: URL), name}
const rates = new Map(); // model name -> recent tokens/s values
let chatAbort = null;
let statsAbort = null;
let wakeStats = () => {};

// ---- server-sent events over fetch --------------------------------------------------------------

async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r/g, "");
    // the events of one read, cut from where the last one ended: a backlog of thousands of events in one
    // read is one pass, not a copy of the rest of the buffer an event
    let start = 0;
    let cut;
    while ((cut = buffer.indexOf("\n\n", start)) >= 0) {
      const block = buffer.slice(start, cut);
      start = cut + 2;
      const lines = block.split("\n").filter((l) => l.startsWith("data:"));
      if (lines.length) yield lines.map((l) => l.slice(5).replace(/^ /, "")).join("\n");
    }
    buffer = buffer.slice(start);
  }
}

function authHeaders() {
  const key = $("api_key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorMessage(response) {
  const text = await response.text().catch(() => "");
  let message = text;
  try {
    const body = JSON.parse(text);
    const error = body.error ?? body;
    message = typeof error === "string" ? error : error.message ?? text;
  } catch (_) {
    // not JSON: the text as it is
  }
  const status = `${response.status} ${response.statusText}`.trim();
  if (response.status === 401) return `${status}: set the server's API key in Settings.${message ? " " + message : ""}`;
  return message ? `${status}: ${message}` : status;
}

const sleep = (ms) =>
  new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    wakeStats = () => {
      clearTimeout(timer);
      resolve();
    };
  });

// ---- chat ---------------------------------------------------------------------------------------

function addMessage(kind, text, image = null) {
  const hint = document.querySelector("#messages > .hint");
  if (hint) hint.remove();
  const el = document.createElement("div");
  el.className = `msg ${kind}`;
  el.textContent = text;
  if (image) {
    const thumb = document.createElement("img");
    thumb.className = "thumb";
    thumb.src = image.url;
    thumb.alt = image.name;
    el.prepend(thumb);
  }
  $("messages").append(el);
  scrollDown();
  return el;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function note(el, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  el.append(span);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = { messages: [...messages, ...conversation], stream: true, stream_options: { include_usage: true } };
  const number = (id) => ($(id).value.trim() === "" ? undefined : Number($(id).value));
  body.temperature = number("temperature");
  body.top_p = number("top_p");
  body.max_tokens = number("max_tokens");
  body.seed = number("seed");
  if ($("json").checked) body.response_format = { type: "json_object" };
  return body;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// ---- an attached image (shown only while the served model takes images) -----------------------------

function megabytes(bytes) {
  return bytes < 1024 * 1024 ? `${Math.ceil(bytes / 1024)} KB` : `${(bytes / 1024 / 1024).toFixed(1)} MB`;
}

function setVision(model) {
  vision = model ? { maxBytes: model.max_image_bytes, maxImages: model.max_images } : null;
  $("attach").hidden = !vision;
  if (!vision) detach();
}

function detach() {
  attached = null;
  $("attachment").hidden = true;
  $("attachment-thumb").removeAttribute("src");
  $("image").value = "";
}

function attach(file) {
  if (!file || !vision) return;
  if (!IMAGE_TYPES.includes(file.type)) {
    addMessage("error", `${file.name || "The file"} is not a PNG, JPEG, WebP or GIF image.`);
    return;
  }
  if (file.size > vision.maxBytes) {
    addMessage("error", `${file.name || "The image"} is ${megabytes(file.size)}: the server takes images up to ${megabytes(vision.maxBytes)} (max_image_bytes).`);
    return;
  }
  const reader = new FileReader();
  reader.addEventListener("load", () => {
    attached = { url: reader.result, name: file.name || "pasted image" };
    $("attachment-thumb").src = attached.url;
    $("attachment-name").textContent = `${attached.name} (${megabytes(file.size)})`;
    $("attachment").hidden = false;
  });
  reader.addEventListener("error", () => addMessage("error", `${file.name || "The image"} could not be read.`));
  reader.readAsDataURL(file);
}

function imageFile(items) {
  for (const item of items ?? []) {
    const file = item instanceof File ? item : item.kind === "file" ? item.getAsFile() : null;
    if (file && file.type.startsWith("image/")) return file;
  }
  return null;
}

// ---- sending ------------------------------------------------------------------------------------

async function send(text) {
  const turns = conversation;
  const image = attached;
  detach();
  const content = image ? [{ type: "image_url", image_url: { url: image.url } }] : text;
  if (image && text) content.push({ type: "text", text });
  turns.push({ role: "user", content });
  addMessage("user", text, image);
  const reply = addMessage("assistant streaming", "");
  const body = document.createTextNode("");
  reply.append(body);
  chatAbort = new AbortController();
  busy(true);
  $("usage").textContent = "";
  const started = performance.now();
  let firstAt = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  // the pieces go into the page once a frame: a layout and a scroll per token would fall behind a fast
  // server's stream (each one lays out the whole reply) and leave the page unresponsive while it streams
  let pending = "";
  let frame = 0;
  const show = () => {
    cancelAnimationFrame(frame);
    frame = 0;
    if (!pending) return;
    body.appendData(pending);
    pending = "";
    scrollDown();
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody()),
      signal: chatAbort.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message ?? JSON.stringify(event.error));
      if (event.usage) usage = event.usage;
      const choice = event.choices?.[0];
      if (!choice) continue;
      const piece = choice.delta?.content ?? "";
      if (piece) {
        firstAt ??= performance.now();
        chunks += 1;
        pending += piece;
        frame ||= requestAnimationFrame(show);
      }
      finish = choice.finish_reason ?? finish;
    }
    show();
    turns.push({ role: "assistant", content: body.data });
    if (finish === "length") note(reply, "(stopped at max tokens)");
  } catch (error) {
    show();
    if (error.name === "AbortError") {
      turns.push({ role: "assistant", content: body.data });
      note(reply, "(stopped)");
    } else {
      turns.pop(); // the failed turn is not part of the conversation
      if (!body.data) reply.remove();
      addMessage("error", error.message);
    }
  } finally {
    reply.classList.remove("streaming");
    busy(false);
    chatAbort = null;
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage?.completion_tokens ?? chunks;
    if (tokens) {
      const ttft = firstAt === null ? "" : ` · first token ${((firstAt - started) / 1000).toFixed(2)} s`;
      $("usage").textContent = `${tokens} tokens in ${seconds.toFixed(1)} s (${(tokens / seconds).toFixed(1)} tok/s)${ttft}`;
    }
  }
}

// ---- live batch ---------------------------------------------------------------------------------

function setConnection(state, text) {
  const pill = $("connection");
  pill.dataset.state = state;
  pill.textContent = text;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

function modelCard(name) {
  const stat = (label, key) => el("div", {}, el("dt", {}, label), el("dd", { "data-stat": key }, "–"));
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", `0 0 ${SPARK_POINTS - 1} 100`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.append(document.createElementNS("http://www.w3.org/2000/svg", "polyline"));
  return el(
    "div",
    { class: "model", "data-model": name },
    el("div", { class: "model-head" }, el("b", {}, name), el("span", { class: "status", "data-stat": "status" })),
    el("dl", { class: "stats" }, stat("running", "running"), stat("waiting", "waiting"), stat("tokens/s", "tokens_per_second")),
    el("div", { class: "bar-label" }, el("span", {}, "batch"), el("span", { "data-stat": "batch" }, "–")),
    el("div", { class: "bar batch" }, el("i")),
    el("div", { class: "bar-label" }, el("span", {}, "KV cache"), el("span", { "data-stat": "kv" }, "–")),
    el("div", { class: "bar kv" }, el("i")),
    el("div", { class: "bar-label", "data-stat-row": "speculation", hidden: "" }, el("span", {}, "speculative"), el("span", { "data-stat": "speculation" }, "–")),
    svg,
  );
}

function renderStats(stats) {
  const box = $("models");
  setVision(stats.models.find((m) => m.vision));
  if (!stats.models.length) {
    box.replaceChildren(el("p", { class: "hint" }, "No text-generation model is served."));
    return;
  }
  const names = stats.models.map((m) => m.name);
  for (const card of [...box.children]) if (!names.includes(card.dataset?.model)) card.remove();
  for (const model of stats.models) {
    let card = box.querySelector(`[data-model="${CSS.escape(model.name)}"]`);
    if (!card) box.append((card = modelCard(model.name)));
    const set = (key, text) => (card.querySelector(`[data-stat="${key}"]`).textContent = text);
    const status = card.querySelector('[data-stat="status"]');
    status.dataset.status = model.status;
    status.textContent = model.status;
    if (model.running === undefined) continue; // loading or failed: no engine to read
    set("running", model.running);
    set("waiting", model.waiting);
    card.querySelector('[data-stat="waiting"]').classList.toggle("busy", model.waiting > 0);
    set("tokens_per_second", model.tokens_per_second.toFixed(1));
    set("batch", `${model.running} / ${model.batch_slots} slots`);
    card.querySelector(".bar.batch > i").style.width = `${(100 * model.running) / Math.max(1, model.batch_slots)}%`;
    const kv = 100 * model.kv_usage;
    const percent = kv > 0 && kv < 0.01 ? "<0.01" : kv < 10 ? kv.toFixed(2) : kv.toFixed(1);
    set("kv", `${percent}% · ${model.kv_tokens} / ${model.kv_capacity}`);
    const kvStat = card.querySelector('[data-stat="kv"]');
    const pool = model.kv_blocks
      ? `KV pool: ${model.kv_blocks} blocks of ${model.kv_block_size} tokens, ${model.preemptions} preemptions`
      : "KV cache: slots";
    const prefix = model.prefix_cache_capacity
      ? `prefix cache: ${model.prefix_cache_tokens} / ${model.prefix_cache_capacity} tokens`
      : "prefix cache off";
    kvStat.title = `${pool}\n${prefix}`;
    card.querySelector(".bar.kv > i").style.width = `${kv}%`;
    const spec = model.speculation;
    card.querySelector('[data-stat-row="speculation"]').hidden = !spec;
    if (spec) {
      const rate = spec.acceptance_rate === null ? "–" : `${(100 * spec.acceptance_rate).toFixed(1)}% accepted`;
      set("speculation", `${spec.method} · ${spec.active ? rate : "off: " + spec.reason}`);
    }
    const series = rates.get(model.name) ?? [];
    series.push(model.tokens_per_second);
    if (series.length > SPARK_POINTS) series.shift();
    rates.set(model.name, series);
    const top = Math.max(1, ...series);
    const offset = SPARK_POINTS - series.length;
    const points = series.map((v, i) => `${offset + i},${(100 - (95 * v) / top).toFixed(1)}`).join(" ");
    card.querySelector("svg.spark polyline").setAttribute("points", points);
  }
}

async function statsLoop() {
  for (;;) {
    statsAbort = new AbortController();
    try {
      const response = await fetch("/playground/stats", {
        headers: authHeaders(),
        signal: statsAbort.signal,
        cache: "no-store",
      });
      if (!response.ok) {
        setConnection("error", await errorMessage(response));
        await sleep(2000);
        continue;
      }
      setConnection("live", "live");
      for await (const data of sseData(response)) renderStats(JSON.parse(data));
      // the server ends each stream after a while: reconnect at once
    } catch (error) {
      if (error.name !== "AbortError") {
        setConnection("error", "stats stream lost: reconnecting…");
        await sleep(1000);
      }
    }
  }
}

// ---- wiring -------------------------------------------------------------------------------------

function init() {
  const key = $("api_key");
  key.value = sessionStorage.getItem(KEY_STORAGE) ?? "";
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, key.value.trim());
    statsAbort?.abort(); // reconnect with the new key
    wakeStats();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if ((!text && !attached) || chatAbort) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => chatAbort?.abort());
  $("attach").addEventListener("click", () => $("image").click());
  $("image").addEventListener("change", () => attach($("image").files[0]));
  $("detach").addEventListener("click", detach);
  $("prompt").addEventListener("paste", (event) => {
    const file = vision && imageFile(event.clipboardData?.items);
    if (!file) return; // text: pasted as usual
    event.preventDefault();
    attach(file);
  });
  const composer = $("composer");
  composer.addEventListener("dragover", (event) => {
    if (!vision || !event.dataTransfer?.types.includes("Files")) return;
    event.preventDefault();
    composer.classList.add("dropping");
  });
  composer.addEventListener("dragleave", () => composer.classList.remove("dropping"));
  composer.addEventListener("drop", (event) => {
    composer.classList.remove("dropping");
    if (!vision) return;
    event.preventDefault();
    attach(imageFile(event.dataTransfer?.files));
  });
  $("clear").addEventListener("click", () => {
    chatAbort?.abort();
    conversation = [];
    detach();
    $("messages").replaceChildren();
    $("usage").textContent = "";
  });
  statsLoop();
}

document.addEventListener("DOMContentLoaded", init);

// The Triptych playground: requests through the head's HTTP API, progress and previews from its
// Server-Sent Events (read with fetch, so the API key travels as a header), this browser's history
// in localStorage, and the pipeline view from GET /v1/pipeline. The form follows the request
// contract (GET /v1/contract): each field named by its data-param takes the served model's limits,
// and a parameter the contract shows in forms that the page has no field for gets one. A finished
// request's timeline comes from its Server-Timing (the header, or a stream's completed event).

const $ = (id) => document.getElementById(id);
const HISTORY_KEY = "triptych.history";
const API_KEY = "triptych.apiKey";
const HISTORY_MAX = 24;
const THUMB_MAX_CHARS = 200_000; // images larger than this are kept in history without their pixels
const PIPELINE_POLL_MS = 700;

let model = null; // {id, kind, edits}
let contract = null; // GET /v1/contract: each endpoint's parameters with this model's limits
let mine = new Set(); // request ids started from this page

function headers(extra = {}) {
  const key = $("apikey").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// An answer of the API that is an error: its status, message and Retry-After (seconds, or null).
class APIError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (!response.ok) {
    const retryAfter = Number.parseFloat(response.headers.get("Retry-After") ?? "");
    throw new APIError(response.status, await errorText(response), Number.isFinite(retryAfter) ? retryAfter : null);
  }
  return response;
}

async function errorText(response) {
  const id = response.headers.get("X-Request-Id");
  try {
    const body = await response.json();
    return naming(`${response.status}: ${body.error?.message ?? JSON.stringify(body)}`, id);
  } catch {
    return naming(`${response.status} ${response.statusText}`, id);
  }
}

// Server-Sent Events from a fetch response: yields {event, data}.
async function* sse(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trim());
      }
      if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
    }
  }
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

async function loadModel() {
  try {
    const { data } = await (await api("/v1/models")).json();
    model = data[0];
    $("model").textContent = `${model.id} · ${model.kind}`;
    document.body.dataset.kind = model.kind;
    for (const el of document.querySelectorAll(".video-only")) el.hidden = model.kind !== "video";
    for (const el of document.querySelectorAll(".edit-only")) el.hidden = !model.edits;
    contract = await (await api("/v1/contract")).json();
    applyContract(contract.endpoints[model.kind === "video" ? "/v1/videos" : "/v1/images/generations"]);
    notice("");
  } catch (err) {
    notice(String(err.message).startsWith("401") ? "This head needs an API key: enter it above." : err.message);
  }
}

// The form's fields take the model's limits; a parameter the form lacks gets a field; one the
// model does not take (e.g. FLUX.1's negative prompt) is hidden.
function applyContract(params) {
  for (const [name, spec] of Object.entries(params)) {
    if (spec.form && !document.querySelector(`#form [data-param="${name}"]`)) $("more-params").append(newField(name, spec));
  }
  for (const input of document.querySelectorAll("#form [data-param]")) {
    const spec = params[input.dataset.param];
    const label = input.closest("label");
    if (!spec || !spec.supported) {
      if (label) label.hidden = true;
      continue;
    }
    if (input.type !== "number") continue;
    if (spec.minimum !== undefined) input.min = spec.minimum;
    if (spec.maximum !== undefined) input.max = spec.maximum;
    input.step = spec.step ?? (spec.type === "float" ? "any" : 1);
  }
}

function newField(name, spec) {
  const label = document.createElement("label");
  label.title = spec.doc;
  const input = document.createElement("input");
  input.dataset.param = name;
  input.type = spec.type === "int" || spec.type === "float" ? "number" : "text";
  if (spec.default !== undefined) input.value = spec.default;
  label.append(`${name.replaceAll("_", " ")} `, input);
  return label;
}

// Every shown field with a value; empty ones are left to the model's defaults.
function requestBody() {
  const body = { prompt: $("prompt").value, size: `${$("width").value}x${$("height").value}` };
  for (const input of document.querySelectorAll("#form [data-param]")) {
    const name = input.dataset.param;
    if (name === "prompt" || name === "size" || input.closest("[hidden]") || input.value === "") continue;
    body[name] = input.type === "number" ? Number(input.value) : input.value;
  }
  return body;
}

function resetOutput() {
  $("error").hidden = true;
  $("progress").value = 0;
  $("progress").max = 1;
  $("steps-done").textContent = "";
  $("role").textContent = "queued";
  $("preview").hidden = true;
  $("result-image").hidden = true;
  $("result-video").hidden = true;
  const video = $("result-video").src;
  if (video.startsWith("blob:")) URL.revokeObjectURL(video); // the last video's bytes, held until now
  $("result-video").removeAttribute("src");
  $("caption").textContent = "";
  renderTimeline("");
}

function showEvent({ event, data }) {
  if (data.id) mine.add(data.id);
  if (data.role) $("role").textContent = data.role;
  if (event === "step") {
    $("progress").max = data.total_steps;
    $("progress").value = data.step;
    $("steps-done").textContent = `step ${data.step}/${data.total_steps}`;
    if (data.preview) {
      $("preview").src = `data:image/png;base64,${data.preview}`;
      $("preview").hidden = false;
      $("preview").dataset.step = data.step;
    }
  } else if (event === "state") {
    $("caption").textContent = data.state;
  }
}

class StreamCut extends Error {}

async function follow(response) {
  for await (const message of sse(response)) {
    showEvent(message);
    if (message.event === "completed" || message.event === "error") return message;
  }
  throw new StreamCut("the progress stream ended without a result");
}

// Retries of an image request (as the Python client's): it goes under an Idempotency-Key, so the
// heads run it once however often it arrives, and is sent again, same key, when no answer came (a
// head that died under it, a rollout: fetch's TypeError), its stream was cut, a proxy answered
// 502-504, or a 409/429 said when (at most 60 s).
const RETRIES = 3;
const BACKOFF_MS = [500, 1000, 2000];

function idempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16)); // randomUUID needs a secure context; this does not
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function retryWait(error, attempt) {
  if (attempt >= RETRIES) return null;
  if (error instanceof APIError) {
    const said = error.retryAfter !== null && error.retryAfter <= 60 ? error.retryAfter * 1000 : null;
    if ([502, 503, 504].includes(error.status)) return said || BACKOFF_MS[attempt];
    return [409, 429].includes(error.status) ? said : null;
  }
  return error instanceof TypeError || error instanceof StreamCut ? BACKOFF_MS[attempt] : null;
}

// The chosen reference image, when the model takes one (edits); null: a generation from text.
function reference() {
  return model.edits ? ($("reference").files[0] ?? null) : null;
}

// An image request with stream: true: JSON to /v1/images/generations, or with a reference image
// multipart to /v1/images/edits (the same fields, as text, and the `image` file).
function imageRequest(body, image) {
  const fields = { ...body, stream: true };
  if (!image) {
    const json = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(fields) };
    return ["/v1/images/generations", json];
  }
  const form = new FormData();
  for (const [name, value] of Object.entries(fields)) form.append(name, String(value));
  form.append("image", image);
  return ["/v1/images/edits", { method: "POST", body: form }];
}

// The final event of a stream that `open` starts, opened again (retryWait) when it was cut before one.
async function followRetrying(open, again) {
  for (let attempt = 0; ; attempt++) {
    try {
      return await follow(await open());
    } catch (err) {
      const wait = retryWait(err, attempt);
      if (wait === null) throw err;
      $("caption").textContent = `${again} (${err.message})`;
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  }
}

function sendImageRequest(body, image) {
  const key = idempotencyKey();
  const send = () => {
    const [path, options] = imageRequest(body, image);
    options.headers = { ...(options.headers ?? {}), "Idempotency-Key": key };
    return api(path, options);
  };
  return followRetrying(send, "sending it again");
}

// An error's words and the request they are about (the id the head's logs use: X-Request-Id).
function naming(message, id) {
  return id ? `${message} (request ${id})` : message;
}

async function generateImage(body, image) {
  const final = await sendImageRequest(body, image);
  if (final.event === "error") throw new Error(naming(final.data.error.message, final.data.id));
  const src = `data:image/png;base64,${final.data.data[0].b64_json}`;
  $("result-image").src = src;
  $("result-image").hidden = false;
  renderTimeline(final.data.server_timing ?? "");
  return { id: final.data.id, src, seed: final.data.seed };
}

async function generateVideo(body) {
  const job = await (
    await api("/v1/videos", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })
  ).json();
  mine.add(job.id);
  // A job's stream ends without a result when the job moves to another head (a drain, a take-over)
  // or the connection is cut: the job runs on, so its events are followed again (any head serves them).
  const events = () => api(`/v1/videos/${job.id}/events`);
  const final = await followRetrying(events, "following it again");
  if (final.event === "error") throw new Error(naming(final.data.error.message, job.id));
  // The timeline from the job itself: its content may be a redirect to the object store, whose
  // answer carries no Server-Timing.
  const done = await api(`/v1/videos/${job.id}`);
  renderTimeline(done.headers.get("Server-Timing") ?? "");
  const content = await api(`/v1/videos/${job.id}/content`);
  const blob = await content.blob();
  $("result-video").src = URL.createObjectURL(blob);
  $("result-video").hidden = false;
  return { id: job.id, seed: job.seed };
}

async function onSubmit(event) {
  event.preventDefault();
  if (!model) await loadModel();
  if (!model) return;
  const body = requestBody();
  const image = reference();
  resetOutput();
  $("generate").disabled = true;
  const started = performance.now();
  try {
    const result = model.kind === "video" ? await generateVideo(body) : await generateImage(body, image);
    $("preview").hidden = true;
    $("role").textContent = "done";
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    $("caption").textContent = `${result.id} · ${seconds} s`;
    // The seed the head used (drawn when the form left it empty): "use again" makes the same pixels.
    remember({ ...body, seed: result.seed ?? body.seed, id: result.id, kind: model.kind, src: result.src, edit: image?.name, seconds, at: Date.now() });
  } catch (err) {
    $("role").textContent = "failed";
    $("error").textContent = err.message;
    $("error").hidden = false;
  } finally {
    $("generate").disabled = false;
  }
}

// A Server-Timing value ("queue-encoder;dur=0.2, encoder;dur=51.3, ..., total;dur=80.1") to
// [{name, ms}], total last.
function timingParts(header) {
  const parts = [];
  for (const entry of header.split(",")) {
    const [name, ...params] = entry.trim().split(";");
    const dur = params.map((p) => p.trim().split("=")).find(([key]) => key === "dur");
    if (name && dur) parts.push({ name, ms: Number(dur[1]) });
  }
  return parts;
}

// The request's timeline: its parts in the order they happened (they never overlap), each a bar
// placed after the ones before it on the scale of the total; the gaps are the head's own time.
function renderTimeline(header) {
  const parts = timingParts(header);
  const total = parts.find((p) => p.name === "total")?.ms ?? 0;
  $("timeline").hidden = !total;
  if (!total) return $("timeline").replaceChildren();
  let at = 0;
  $("timeline").replaceChildren(
    ...parts.map(({ name, ms }) => {
      const row = document.createElement("div");
      row.className = "part";
      row.dataset.name = name;
      row.dataset.ms = String(ms);
      const label = document.createElement("span");
      label.textContent = `${name} ${ms.toFixed(1)} ms`;
      const track = document.createElement("span");
      track.className = "track";
      const bar = document.createElement("span");
      bar.className = name === "total" ? "bar total" : name.startsWith("queue-") || name.startsWith("transfer-") ? "bar wait" : "bar";
      bar.style.marginLeft = `${name === "total" ? 0 : (100 * at) / total}%`;
      bar.style.width = `${Math.max((100 * ms) / total, 0.5)}%`;
      if (name !== "total") at += ms;
      track.append(bar);
      row.append(label, track);
      return row;
    }),
  );
}

function history() {
  try {
    return JSON.parse(localStorage.getItem(HISTORY_KEY) ?? "[]");
  } catch {
    return [];
  }
}

function remember(entry) {
  if (entry.src && entry.src.length > THUMB_MAX_CHARS) delete entry.src;
  const entries = [entry, ...history()].slice(0, HISTORY_MAX);
  try {
    localStorage.setItem(HISTORY_KEY, JSON.stringify(entries));
  } catch {
    localStorage.setItem(HISTORY_KEY, JSON.stringify(entries.map(({ src, ...rest }) => rest)));
  }
  renderHistory();
}

function renderHistory() {
  const list = $("history");
  list.replaceChildren(
    ...history().map((entry) => {
      const li = document.createElement("li");
      if (entry.src) {
        const img = document.createElement("img");
        img.src = entry.src;
        img.alt = entry.prompt;
        li.append(img);
      }
      const text = document.createElement("span");
      const edit = entry.edit ? ` · edit of ${entry.edit}` : "";
      text.textContent = `${entry.prompt}${edit} · ${entry.size} · seed ${entry.seed ?? "random"} · ${entry.seconds} s`;
      li.append(text);
      li.addEventListener("click", () => {
        $("prompt").value = entry.prompt;
        $("seed").value = entry.seed ?? "";
        $("steps").value = entry.num_inference_steps;
        [$("width").value, $("height").value] = entry.size.split("x");
      });
      return li;
    }),
  );
}

function instanceState(inst) {
  if (!inst.alive) return "down";
  if (inst.draining || inst.leaving) return "draining";
  return inst.ready ? "ready" : "alive";
}

function renderPipeline(view) {
  const roles = Object.entries(view.roles);
  const total = roles.reduce((n, [, info]) => n + info.instances.length, 0);
  $("pipeline-summary").textContent = `${total} instances · ${view.requests.length} in flight`;
  $("roles").replaceChildren(
    ...roles.map(([role, info]) => {
      const box = document.createElement("div");
      box.className = "role";
      box.dataset.role = role;
      const title = document.createElement("h3");
      title.innerHTML = `<span></span><span class="muted"></span>`;
      title.children[0].textContent = role;
      title.children[1].textContent = `queue ${info.queued} · running ${info.running}`;
      box.append(title);
      for (const inst of info.instances) {
        const row = document.createElement("div");
        row.className = "instance";
        row.dataset.state = instanceState(inst);
        const url = document.createElement("span");
        url.className = "url";
        // What it runs on: "2 bfloat16" (a simulated worker reports no dtype).
        const devices = `${inst.devices ?? 1} ${inst.dtype ?? ""}`.trim();
        url.textContent = `${inst.url} · ${row.dataset.state} · ${devices}`;
        const slots = document.createElement("span");
        slots.title = `${inst.free_slots} of ${inst.capacity} slots free`;
        for (let i = 0; i < inst.capacity; i++) {
          const slot = document.createElement("span");
          slot.className = i < inst.free_slots ? "slot" : "slot busy";
          slots.append(slot);
        }
        row.append(url, slots);
        box.append(row);
      }
      for (const req of view.requests.filter((r) => r.role === role)) {
        const chip = document.createElement("div");
        chip.className = mine.has(req.id) ? "request mine" : "request";
        chip.dataset.id = req.id;
        chip.dataset.state = req.state;
        chip.dataset.done = req.done.join(" ");
        const steps = req.total_steps ? ` ${req.step}/${req.total_steps}` : "";
        const path = req.done.map((r) => `${r} ✓ `).join("");
        chip.textContent = `${req.id.slice(0, 14)}… ${path}${req.state.toLowerCase()}${steps}`;
        box.append(chip);
      }
      return box;
    }),
  );
}

async function pollPipeline() {
  try {
    renderPipeline(await (await api("/v1/pipeline")).json());
  } catch (err) {
    $("pipeline-summary").textContent = err.message;
  }
  setTimeout(pollPipeline, PIPELINE_POLL_MS);
}

// The key is kept for this tab only (sessionStorage): a reload keeps it, closing the tab forgets it,
// and no later user of this browser profile can read it back.
localStorage.removeItem(API_KEY); // where earlier versions kept it
$("apikey").value = sessionStorage.getItem(API_KEY) ?? "";
$("apikey").addEventListener("change", () => {
  sessionStorage.setItem(API_KEY, $("apikey").value.trim());
  loadModel();
});
$("form").addEventListener("submit", onSubmit);
$("reference").addEventListener("change", () => {
  const file = $("reference").files[0];
  if ($("reference-thumb").src) URL.revokeObjectURL($("reference-thumb").src);
  $("reference-thumb").src = file ? URL.createObjectURL(file) : "";
  $("reference-thumb").hidden = !file;
});
$("clear-history").addEventListener("click", () => {
  localStorage.removeItem(HISTORY_KEY);
  renderHistory();
});
renderHistory();
loadModel();
pollPipeline();

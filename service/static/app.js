// The search page: plain DOM, no dependencies. Every text from the service goes in through
// textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { mode: null, offset: 0, k: 24 };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function describeError(body, status) {
  if (body && Array.isArray(body.detail)) {
    return body.detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
  }
  if (body && typeof body.detail === "string") return body.detail;
  return `HTTP ${status}`;
}

async function call(path, options = {}) {
  let response;
  try {
    response = await fetch(path, options);
  } catch (err) {
    throw new Error(`the service did not answer (${err.message})`);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error(`${response.status}: ${describeError(body, response.status)}`);
  return body;
}

function showError(message) {
  $("error").textContent = message ? `Request failed: ${message}` : "";
  $("error").hidden = !message;
}

// -- what is serving ------------------------------------------------------------------------
async function checkReady() {
  const response = await fetch("/readyz").catch(() => null);
  const body = response ? await response.json().catch(() => ({})) : {};
  if (!response || !response.ok) {
    const why = !response ? "the service does not answer" : body.status + (body.error ? ` (${body.error})` : "");
    $("status").textContent = `The service is not ready: ${why}. Retrying…`;
    $("status").hidden = false;
    setTimeout(checkReady, 2000);
    return;
  }
  $("status").hidden = true;
  const info = await call("/v1/info").catch((err) => { showError(err.message); return null; });
  if (info) {
    const b = info.bundle, s = info.snapshot;
    $("serving").textContent = `bundle ${b.name} ${b.version} (${b.precision}) · snapshot ${s.version} · ` +
      `${s.count.toLocaleString("en")} images · ${s.index.type}`;
    listExpansions(info.expansions || []);
  }
}

// the expansion methods the service registers (its one list), those it has configured
function listExpansions(methods) {
  const select = $("expansion");
  const chosen = select.value;
  for (const option of [...select.options]) if (option.value && option.value !== "none") option.remove();
  for (const m of methods.filter((m) => m.configured)) select.append(el("option", { value: m.name }, m.label));
  if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
}

// -- results ---------------------------------------------------------------------------------
// an indexed url is data, not trusted: only http(s) becomes a link or an image source (never javascript: or data:)
function webLink(url) {
  try {
    return url && ["http:", "https:"].includes(new URL(url).protocol) ? url : null;
  } catch {
    return null;
  }
}

function imageSource(result) {
  return result.path !== undefined || !webLink(result.url) ? `/v1/images/${result.id}` : result.url;
}

function licenceLine(result) {
  const line = el("div", { class: "licence" });
  if (result.licence && result.licence.name) {
    line.append("licence: ");
    line.append(webLink(result.licence.url) ? el("a", { href: result.licence.url, rel: "license noopener", target: "_blank" },
      result.licence.name) : result.licence.name);
  }
  if (webLink(result.url)) {
    if (line.childNodes.length) line.append(" · ");
    line.append(el("a", { href: result.url, rel: "noopener", target: "_blank" }, "source"));
  }
  return line;
}

function card(result) {
  const caption = (result.captions && result.captions[0]) || "";
  return el("figure", { class: "card", "data-id": String(result.id) },
    el("img", { src: imageSource(result), alt: caption || `image ${result.id}`, loading: "lazy" }),
    el("figcaption", { class: "body" },
      el("span", { class: "score" }, `#${result.rank} · score ${result.score.toFixed(3)} · id ${result.id}`),
      el("p", { class: "caption", title: (result.captions || []).join("\n") }, caption),
      licenceLine(result),
      el("button", { type: "button", class: "similar", onclick: () => run({ type: "similar", id: result.id }) },
        "more like this")));
}

function render(response) {
  const m = state.mode;
  const what = m.type === "text" ? `“${m.query}”` : m.type === "image" ? `the image ${m.file.name}` : `more like image ${m.id}`;
  const first = state.offset + 1, last = state.offset + response.results.length;
  $("summary").textContent = response.results.length
    ? `Results ${first}–${last} for ${what} · ${response.timings.total_ms.toFixed(0)} ms` +
      (response.expansions ? ` · expanded with: ${response.expansions.join("; ")}` : "")
    : `No results for ${what} on this page.`;
  $("grid").replaceChildren(...response.results.map(card));
  $("prev").disabled = state.offset === 0;
  $("next").disabled = response.results.length < state.k;
  $("query-image").hidden = m.type !== "image";
  $("results-section").hidden = false;
  $("consistency-section").hidden = m.type !== "text";
}

function expansionField() {
  const method = $("expansion").value;
  return method ? { expansion: { method } } : {};
}

// the service filters before ranking: the top k among images with a caption containing the text
function filterField() {
  const text = $("caption-filter").value.trim();
  return text ? { filter: { caption_contains: text } } : {};
}

async function fetchResults(mode) {
  const page = { k: state.k, offset: state.offset };
  if (mode.type === "text") {
    return call("/v1/search", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ query: mode.query, ...page, ...expansionField(), ...filterField() }) });
  }
  if (mode.type === "similar") {
    return call("/v1/search/similar", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ id: mode.id, ...page, ...filterField() }) });
  }
  const form = new FormData();
  form.append("image", mode.file);
  form.append("k", String(page.k));
  form.append("offset", String(page.offset));
  const { filter } = filterField();
  if (filter) form.append("filter", JSON.stringify(filter));
  return call("/v1/search/image", { method: "POST", body: form });
}

async function run(mode, offset = 0) {
  state.mode = mode;
  state.offset = offset;
  state.k = Number($("k").value);
  showError("");
  document.body.setAttribute("aria-busy", "true");
  try {
    render(await fetchResults(mode));
    if (offset === 0 && mode.type !== "text") window.scrollTo(0, 0);
  } catch (err) {
    showError(err.message);
  } finally {
    document.body.removeAttribute("aria-busy");
  }
}

// -- consistency view ------------------------------------------------------------------------
function thumbnails(ids, shared) {
  return ids.map((id) => el("img", { src: `/v1/images/${id}`, alt: `image ${id}`, title: `id ${id}`,
    class: shared && shared.has(id) ? "shared" : "" }));
}

function renderConsistency(query, report) {
  const k = report.k;
  const verdict = el("span", { class: report.stable ? "stable" : "unstable" }, report.stable ? "stable" : "unstable");
  $("consistency-summary").replaceChildren(
    `${report.produced} paraphrase(s) · mean AO@${k} ${report.mean_ao.toFixed(3)} · mean JS@${k} ` +
    `${report.mean_js.toFixed(3)} · `, verdict, ` (threshold ${report.threshold})` +
    (report.expansion ? ` · lists compared under ${report.expansion} expansion` : ""));
  const queryIds = new Set(report.ids);
  const columns = [el("div", { class: "list query" }, el("div", { class: "label" }, el("h3", {}, `query: ${query}`),
    el("p", { class: "metrics" }, `its top ${k}`)), ...thumbnails(report.ids, null))];
  for (const p of report.paraphrases) {
    // green: in the query's top k too
    columns.push(el("div", { class: "list paraphrase" }, el("div", { class: "label" }, el("h3", {}, p.text),
      el("p", { class: "metrics" }, `AO@${k} ${p.ao.toFixed(3)} · JS@${k} ${p.js.toFixed(3)}`)),
      ...thumbnails(p.ids, queryIds)));
  }
  $("consistency").replaceChildren(...columns);
}

async function compare(event) {
  event.preventDefault();
  if (!state.mode || state.mode.type !== "text") return;
  const typed = $("paraphrases").value.split("\n").map((s) => s.trim()).filter(Boolean);
  const k = Number($("consistency-k").value);
  const consistency = typed.length ? { paraphrases: typed, k }
    : { auto: Number($("auto-n").value), method: $("auto-method").value, k };
  showError("");
  try {
    const response = await call("/v1/search", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ query: state.mode.query, k, consistency, ...expansionField(), ...filterField() }) });
    if (!response.consistency) throw new Error("the service produced no paraphrase to compare");
    renderConsistency(state.mode.query, response.consistency);
  } catch (err) {
    showError(err.message);
  }
}

// -- wiring -----------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    $("consistency").replaceChildren();
    $("consistency-summary").textContent = "";
    run({ type: "text", query: $("query").value.trim() });
  });
  $("image-file").addEventListener("change", () => {
    const file = $("image-file").files[0];
    if (!file) return;
    const preview = $("query-image");
    if (preview.src) URL.revokeObjectURL(preview.src);
    preview.src = URL.createObjectURL(file);
    $("image-file").value = "";  // choosing the same file again searches again
    run({ type: "image", file });
  });
  $("prev").addEventListener("click", () => run(state.mode, Math.max(0, state.offset - state.k)));
  $("next").addEventListener("click", () => run(state.mode, state.offset + state.k));
  $("consistency-form").addEventListener("submit", compare);
  checkReady();
});

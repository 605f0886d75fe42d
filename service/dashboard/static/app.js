// torchjobs dashboard: a single script over the REST API (contract §2), no framework.
//
// The bearer token the user types in is kept in sessionStorage (this tab only) and sent as an
// Authorization header on every call. EventSource cannot send that header, so the job page reads
// the SSE stream with fetch() and a stream reader, and parses the event-stream format itself.
// Every text from the API reaches the page through textContent, never as HTML.
(() => {
  "use strict";

  const TOKEN_KEY = "torchjobs.token";
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  const LOG_KEEP_CHARS = 200000;
  const STEP_INCREMENTS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 1e7];
  const $ = (id) => document.getElementById(id);

  // ---------------------------------------------------------------- helpers

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const sleep = (ms, signal) =>
    new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
    });

  function fmtTime(ts) {
    if (!ts) return "–";
    const d = new Date(ts);
    const today = new Date();
    return d.toDateString() === today.toDateString() ? d.toLocaleTimeString() : d.toLocaleString();
  }

  function fmtAgo(ts) {
    if (!ts) return "–";
    const s = Math.max(0, Math.round((Date.now() - new Date(ts).getTime()) / 1000));
    if (s < 60) return `${s}s ago`;
    if (s < 3600) return `${Math.floor(s / 60)}m ago`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
    return `${Math.floor(s / 86400)}d ago`;
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
  }

  const fmtNum = (v, digits = 4) => (v === null || v === undefined ? "–" : Number(v).toPrecision(digits));

  function progressText(p) {
    const parts = [];
    if (p.epochs) parts.push(`epoch ${p.epoch ?? 0}/${p.epochs}`);
    if (p.total_steps) parts.push(`step ${p.step ?? 0}/${p.total_steps}`);
    else if (p.step !== null && p.step !== undefined) parts.push(`step ${p.step}`);
    return parts.join(" · ");
  }

  function progressBar(fraction) {
    const fill = el("span");
    fill.style.width = `${Math.round(Math.min(1, Math.max(0, fraction ?? 0)) * 100)}%`;
    return el("div", { class: "bar" }, fill);
  }

  function describeError(detail) {
    // FastAPI's 422 detail is a list of {loc, msg}; domain errors carry a string.
    if (Array.isArray(detail)) {
      return detail
        .map((d) => {
          const loc = (d.loc || []).filter((p) => p !== "body").join(".");
          return loc ? `${loc}: ${d.msg}` : d.msg;
        })
        .join("\n");
    }
    return typeof detail === "string" ? detail : JSON.stringify(detail);
  }

  function randomKey() {
    // crypto.randomUUID needs a secure context; getRandomValues does not.
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  // ---------------------------------------------------------------- API

  class ApiError extends Error {
    constructor(status, detail) {
      super(describeError(detail));
      this.status = status;
    }
  }

  async function request(path, { method = "GET", body, headers = {}, signal, token } = {}) {
    const auth = token ?? sessionStorage.getItem(TOKEN_KEY);
    const init = { method, signal, cache: "no-store", headers: { Authorization: `Bearer ${auth}`, ...headers } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const resp = await fetch(path, init);
    if (resp.ok) return resp;
    let detail = resp.statusText;
    try { detail = (await resp.json()).detail ?? detail; } catch { /* not JSON */ }
    if (resp.status === 401 && token === undefined) signOut("Your token was not accepted; sign in again.");
    throw new ApiError(resp.status, detail);
  }

  const getJson = async (path, opts) => (await request(path, opts)).json();

  // ---------------------------------------------------------------- SSE over fetch

  // The text/event-stream format (HTML Living Standard, "Server-sent events"): lines end in CR, LF
  // or CRLF; a blank line dispatches the event; lines starting with ":" are comments (keep-alives).
  class SSEParser {
    constructor(onEvent) {
      this.onEvent = onEvent;
      this.buffer = "";
      this.data = [];
      this.event = "";
      this.lastId = "";
    }

    push(text) {
      this.buffer += text;
      this.drain(false);
    }

    end() {
      this.drain(true); // an event without its closing blank line is dropped, as the standard says
    }

    drain(final) {
      const eol = /[\r\n]/g;
      let start = 0;
      for (;;) {
        eol.lastIndex = start;
        const match = eol.exec(this.buffer);
        if (!match) break;
        const at = match.index;
        let next = at + 1;
        if (this.buffer[at] === "\r") {
          if (at + 1 === this.buffer.length && !final) break; // a CRLF may be split across chunks
          if (this.buffer[at + 1] === "\n") next = at + 2;
        }
        this.line(this.buffer.slice(start, at));
        start = next;
      }
      this.buffer = this.buffer.slice(start);
    }

    line(line) {
      if (line === "") {
        if (this.data.length) this.onEvent({ id: this.lastId, event: this.event || "message", data: this.data.join("\n") });
        this.data = [];
        this.event = "";
        return;
      }
      if (line.startsWith(":")) return;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") this.data.push(value);
      else if (field === "event") this.event = value;
      else if (field === "id" && !value.includes("\0")) this.lastId = value;
    }
  }

  // Streams a job's events after `after` into onEvent until the server closes the stream.
  async function readEventStream(jobId, after, onEvent, signal) {
    const resp = await request(`/v1/jobs/${jobId}/events/stream?after=${after}`, {
      headers: { Accept: "text/event-stream" },
      signal,
    });
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    const parser = new SSEParser((message) => {
      try {
        onEvent(JSON.parse(message.data));
      } catch (err) {
        console.error("bad event", message, err);
      }
    });
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        parser.push(value);
      }
      parser.end();
    } finally {
      reader.releaseLock();
    }
  }

  // ---------------------------------------------------------------- views and routing

  let current = null; // {controller} of the view on screen; aborted when the view changes
  let me = null;

  function showView(name) {
    for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== `view-${name}`;
  }

  // Calls fn every `ms` (never overlapping) until the view changes or fn returns false.
  function poll(fn, ms, signal) {
    (async () => {
      while (!signal.aborted) {
        try {
          if ((await fn()) === false) return;
        } catch (err) {
          if (signal.aborted || err.name === "AbortError") return;
          console.error(err);
        }
        await sleep(ms, signal);
      }
    })();
  }

  async function route() {
    current?.controller.abort();
    const controller = new AbortController();
    current = { controller };
    if (!sessionStorage.getItem(TOKEN_KEY)) {
      showSignIn("");
      return;
    }
    if (!me) {
      try {
        me = await getJson("/v1/me", { signal: controller.signal });
      } catch (err) {
        if (!controller.signal.aborted && err.status !== 401) showSignIn(`Cannot reach the API: ${err.message}`);
        return;
      }
      $("whoami").textContent = `signed in as ${me.name}${me.is_admin ? " (admin)" : ""}`;
      $("signout").hidden = false;
    }
    const match = location.hash.match(/^#\/jobs\/(\d+)$/);
    if (match) jobView(Number(match[1]), controller.signal);
    else homeView(controller.signal);
  }

  function showSignIn(message) {
    current?.controller.abort();
    me = null;
    $("whoami").textContent = "";
    $("signout").hidden = true;
    $("signin-error").textContent = message;
    showView("signin");
    $("token").focus();
  }

  function signOut(message = "") {
    sessionStorage.removeItem(TOKEN_KEY);
    showSignIn(message);
  }

  $("signin-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const token = $("token").value.trim();
    if (!token) return;
    try {
      me = await getJson("/v1/me", { token });
    } catch (err) {
      $("signin-error").textContent = err.status === 401 ? "That token was not accepted." : err.message;
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    $("token").value = "";
    me = null;
    route();
  });
  $("signout").addEventListener("click", () => signOut(""));
  window.addEventListener("hashchange", route);

  // ---------------------------------------------------------------- home: jobs, workers, submit

  function homeView(signal) {
    showView("home");
    poll(refreshJobs, 3000, signal);
    poll(refreshWorkers, 5000, signal);
    poll(refreshUsage, 10000, signal);
  }

  async function refreshUsage() {
    const { items } = await getJson("/v1/usage", { signal: current.controller.signal });
    $("usage-body").replaceChildren(
      ...items.map((u) =>
        el(
          "tr",
          { "data-user": u.user },
          el("td", { text: u.user }),
          el("td", { text: (u.gpu_seconds / 3600).toFixed(2), title: `${Math.round(u.gpu_seconds)} GPU-seconds` }),
          el("td", { text: String(u.jobs) }),
          el("td", { text: String(u.attempts) }),
        ),
      ),
    );
  }

  // Sweeps (contract §10): one row each, opening to its children with their results side by side.
  const openSweeps = new Set();

  function jobRow(job) {
    const p = job.progress || {};
    const sweep = job.sweep;
    const mode = sweep ? `sweep of ${sweep.children}` : job.parent_id ? `${job.mode} (sweep #${job.parent_id})` : job.mode;
    const name = el("td", {}, el("a", { href: `#/jobs/${job.id}`, text: job.name || "(unnamed)" }));
    if (sweep) {
      const open = openSweeps.has(job.id);
      name.prepend(el("button", {
        class: "toggle", type: "button", "data-sweep": job.id, title: "show the children",
        text: open ? "▾" : "▸",
        onclick: () => {
          open ? openSweeps.delete(job.id) : openSweeps.add(job.id);
          refreshJobs().catch(console.error);
        },
      }), " ");
    }
    return el(
      "tr",
      { "data-job": job.id },
      el("td", {}, el("a", { href: `#/jobs/${job.id}`, text: `#${job.id}` })),
      name,
      el("td", {}, el("span", { class: `badge ${job.state}`, text: job.state })),
      el("td", { text: mode }),
      el("td", { text: `${nodesText(job)}×${job.gpus_per_node}` }),
      el("td", {}, el("div", { class: "progress-cell" }, progressBar(p.fraction),
        el("span", { class: "small muted", text: sweep ? `${sweep.ended} of ${sweep.children} ended` : progressText(p) }))),
      el("td", { class: "mono", text: fmtNum(p.loss) }),
      el("td", { text: job.owner }),
      el("td", { class: "small", text: fmtTime(job.created_at) }),
    );
  }

  function childrenRow(parent, children) {
    const paths = [...new Set(children.flatMap((c) => Object.keys(c.sweep_point || {})))];
    const head = el("tr", {}, ...["job", ...paths, "state", "loss", "val_loss", "val_accuracy"].map((h) => el("th", { text: h })));
    const rows = children
      .sort((a, b) => a.id - b.id)
      .map((c) => {
        const p = c.progress || {};
        return el(
          "tr",
          { "data-child": c.id },
          el("td", {}, el("a", { href: `#/jobs/${c.id}`, text: `#${c.id}` })),
          ...paths.map((path) => el("td", { class: "mono", text: JSON.stringify((c.sweep_point || {})[path]) })),
          el("td", {}, el("span", { class: `badge ${c.state}`, text: c.state })),
          el("td", { class: "mono", text: fmtNum(p.loss) }),
          el("td", { class: "mono", text: fmtNum(p.val_loss) }),
          el("td", { class: "mono", text: fmtNum(p.val_accuracy) }),
        );
      });
    const table = el("table", { class: "list children" }, el("thead", {}, head), el("tbody", {}, ...rows));
    return el("tr", { "data-children-of": parent.id }, el("td", { colspan: "9" }, table));
  }

  // A sweep's children, every page (up to 1,000); best first by its objective when `byObjective`.
  async function sweepChildren(parentId, byObjective, signal) {
    const kids = [];
    let cursor = "";
    do {
      const query = new URLSearchParams({ parent: String(parentId), limit: "500" });
      if (byObjective) query.set("order", "objective");
      if (cursor) query.set("cursor", cursor);
      const page = await getJson(`/v1/jobs?${query}`, { signal });
      kids.push(...page.items);
      cursor = page.next_cursor || "";
    } while (cursor);
    return kids;
  }

  async function refreshJobs() {
    const state = $("jobs-state").value;
    const query = new URLSearchParams({ limit: "50" });
    if (state) query.set("state", state);
    const signal = current.controller.signal;
    const { items } = await getJson(`/v1/jobs?${query}`, { signal });
    const shown = new Set(items.map((j) => j.id));
    const rows = [];
    for (const job of items) {
      if (job.parent_id && shown.has(job.parent_id)) continue; // inside its sweep's row
      rows.push(jobRow(job));
      if (job.sweep && openSweeps.has(job.id)) {
        rows.push(childrenRow(job, await sweepChildren(job.id, false, signal)));
      }
    }
    $("jobs-body").replaceChildren(...rows);
    $("jobs-empty").hidden = items.length > 0;
  }
  $("jobs-state").addEventListener("change", () => refreshJobs().catch(console.error));

  async function refreshWorkers() {
    const { items } = await getJson("/v1/workers", { signal: current.controller.signal });
    $("workers-body").replaceChildren(
      ...items.map((w) => {
        const used = w.state === "online" ? w.gpus - w.gpus_free : 0;
        const slots = el("span", { class: "slots", title: `${w.gpus_free} of ${w.gpus} free` });
        for (let i = 0; i < w.gpus; i += 1) {
          slots.append(el("i", { class: w.state !== "online" ? "off" : i < used ? "used" : "" }));
        }
        return el(
          "tr",
          { "data-worker": w.name },
          el("td", { title: `${w.address} · ${w.accelerator} · heartbeat ${fmtAgo(w.last_heartbeat)}` }, w.name,
            el("div", { class: "small muted", text: w.accelerator })),
          el("td", {}, el("span", { class: `badge ${w.state}`, text: w.state, title: w.reason || "" }),
            w.reason ? el("div", { class: "small muted quarantine-reason", text: w.reason }) : ""),
          el("td", {}, slots, el("span", { class: "gpus-free", text: `${w.gpus_free} / ${w.gpus}` })),
          el("td", {}, ...w.jobs.flatMap((id, i) => [i ? ", " : "", el("a", { href: `#/jobs/${id}`, text: `#${id}` })])),
        );
      }),
    );
    $("workers-empty").hidden = items.length > 0;
  }

  $("f-mode").addEventListener("change", syncSubmitForm);
  function syncSubmitForm() {
    const mode = $("f-mode").value;
    const multiNode = mode === "ddp" || mode === "fsdp";
    $("f-nodes").disabled = !multiNode;
    if (!multiNode) $("f-nodes").value = "1";
    $("f-gpus").disabled = mode === "single";
    if (mode === "single") $("f-gpus").value = "1";
  }
  syncSubmitForm();

  $("submit-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const button = $("submit-button");
    const spec = {
      mode: $("f-mode").value,
      nodes: Number($("f-nodes").value),
      gpus_per_node: Number($("f-gpus").value),
      entrypoint: { kind: "builtin", model: $("f-model").value, dataset: $("f-dataset").value },
      hyperparameters: { epochs: Number($("f-epochs").value) },
    };
    const name = $("f-name").value.trim();
    if (name) spec.name = name;
    button.disabled = true;
    $("submit-error").textContent = "";
    try {
      // One key per click: a retried request never makes a second job.
      const job = await getJson("/v1/jobs", { method: "POST", body: spec, headers: { "Idempotency-Key": randomKey() } });
      $("f-name").value = "";
      location.hash = `#/jobs/${job.id}`;
    } catch (err) {
      $("submit-error").textContent = err.message;
    } finally {
      button.disabled = false;
    }
  });

  // ---------------------------------------------------------------- the job page

  class Chart {
    // x: the global step; y: training and validation loss (left axis), validation accuracy (right).
    constructor(container) {
      this.container = container;
      this.points = new Map();
      this.plot = null;
      this.pending = false;
      this.onResize = () => this.plot?.setSize(this.size());
      window.addEventListener("resize", this.onResize);
    }

    size() {
      return { width: Math.max(300, this.container.clientWidth), height: 300 };
    }

    add(progress) {
      const x = progress.step ?? progress.epoch;
      if (x === null || x === undefined) return;
      const point = this.points.get(x) || {};
      // A report with validation results closes an epoch: its loss is the epoch's mean, drawn as
      // its own series so that it does not zig-zag against the in-epoch running loss.
      const epochEnd = progress.val_loss != null || progress.val_accuracy != null;
      const fields = { loss: epochEnd ? "epoch_loss" : "loss", val_loss: "val_loss", val_accuracy: "val_accuracy" };
      for (const [from, to] of Object.entries(fields)) {
        if (progress[from] !== null && progress[from] !== undefined) point[to] = progress[from];
      }
      this.points.set(x, point);
      if (!this.pending) {
        this.pending = true;
        requestAnimationFrame(() => { this.pending = false; this.draw(); });
      }
    }

    draw() {
      const xs = [...this.points.keys()].sort((a, b) => a - b);
      const column = (key) => xs.map((x) => this.points.get(x)[key] ?? null);
      const data = [xs, column("loss"), column("epoch_loss"), column("val_loss"), column("val_accuracy")];
      if (!this.plot) {
        this.container.replaceChildren();
        this.plot = new uPlot(
          {
            ...this.size(),
            scales: { x: { time: false }, acc: { range: [0, 1] } },
            axes: [
              { label: "step", incrs: STEP_INCREMENTS },
              { label: "loss", scale: "y" },
              { label: "accuracy", scale: "acc", side: 1, grid: { show: false },
                values: (u, ticks) => ticks.map((t) => `${Math.round(t * 100)}%`) },
            ],
            series: [
              { label: "step" },
              { label: "loss", stroke: "#2563eb", width: 2, spanGaps: true, value: (u, v) => fmtNum(v) },
              { label: "epoch loss", stroke: "#7c3aed", width: 2, spanGaps: true, value: (u, v) => fmtNum(v) },
              { label: "val loss", stroke: "#d97706", width: 2, dash: [6, 4], spanGaps: true, value: (u, v) => fmtNum(v) },
              { label: "val accuracy", stroke: "#16a34a", width: 2, scale: "acc", spanGaps: true,
                value: (u, v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(1)}%`) },
            ],
          },
          data,
          this.container,
        );
      } else {
        this.plot.setData(data);
      }
      this.container.dataset.points = String(xs.length);
    }

    destroy() {
      window.removeEventListener("resize", this.onResize);
      this.plot?.destroy();
    }
  }

  class LogView {
    // One rank's log, read from a byte offset; a streaming decoder keeps multi-byte characters whole.
    constructor(pre, select, jobId) {
      this.pre = pre;
      this.select = select;
      this.jobId = jobId;
      this.ranks = "";
      select.onchange = () => this.reset();
      this.reset();
    }

    setRanks(job) {
      const perNode = job.mode === "ddp" || job.mode === "fsdp" ? job.gpus_per_node : 1;
      const nodes = nodeCount(job);
      const key = `${nodes}x${perNode}`;
      if (key === this.ranks) return;
      this.ranks = key;
      const options = [];
      for (let node = 0; node < nodes; node += 1) {
        for (let rank = 0; rank < perNode; rank += 1) {
          options.push(el("option", { value: `${node}:${rank}`, text: `node ${node} · rank ${rank}` }));
        }
      }
      this.select.replaceChildren(...options);
      this.reset();
    }

    reset() {
      this.offset = 0;
      this.attempt = null;
      this.decoder = new TextDecoder();
      this.pre.textContent = "";
      this.generation = (this.generation || 0) + 1;
    }

    // Reads until the log has no more bytes for now. The latest attempt is read: when a retry
    // starts, its log starts over at offset 0 under a separator.
    async fetchMore(signal) {
      const [node, rank] = (this.select.value || "0:0").split(":");
      const generation = this.generation;
      for (;;) {
        const query = new URLSearchParams({ node, rank, offset: String(this.offset) });
        const resp = await request(`/v1/jobs/${this.jobId}/logs?${query}`, { signal });
        const bytes = await resp.arrayBuffer();
        if (generation !== this.generation) return; // another rank was chosen meanwhile
        const attempt = resp.headers.get("X-Attempt");
        if (attempt && this.attempt && attempt !== this.attempt) {
          this.attempt = attempt;
          this.offset = 0;
          this.decoder = new TextDecoder();
          this.append(`\n──── attempt ${attempt} ────\n`);
          continue;
        }
        this.attempt = attempt;
        const next = Number(resp.headers.get("X-Next-Offset") ?? this.offset + bytes.byteLength);
        if (bytes.byteLength === 0 || next <= this.offset) return;
        this.offset = next;
        this.append(this.decoder.decode(bytes, { stream: true }));
      }
    }

    append(text) {
      const pre = this.pre;
      const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
      let all = pre.textContent + text;
      if (all.length > LOG_KEEP_CHARS) all = `…\n${all.slice(all.length - LOG_KEEP_CHARS)}`;
      pre.textContent = all;
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    }
  }

  // ---------------------------------------------------------------- series and sweeps (§13)

  const SERIES_SHOWN = 12; // names charted before the user picks
  const SWEEP_CURVES = 20; // children whose objective is charted, best first
  const PALETTE = ["#2563eb", "#d97706", "#16a34a", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#ea580c", "#475569"];

  // A job's series, asked by name where the names can be put in `?names=` (a name holding a
  // comma cannot: then every series is read and picked here).
  async function readSeries(jobId, names, signal) {
    const plain = names && names.length && names.every((n) => !n.includes(","));
    const query = plain ? `?names=${encodeURIComponent(names.join(","))}` : "";
    return getJson(`/v1/jobs/${jobId}/metrics${query}`, { signal });
  }

  // x of a series: the epoch where every point of it has one (what ASHA compares), else the step.
  function seriesAxis(points) {
    return points.length && points.every((p) => p.epoch !== null && p.epoch !== undefined) ? "epoch" : "step";
  }

  function xyOf(points, name, given = null) {
    const held = points.filter((p) => typeof p[name] === "number");
    const axis = given ?? seriesAxis(held);
    const pairs = held.map((p, i) => [p[axis] ?? i, p[name]]).sort((a, b) => a[0] - b[0]);
    return { axis, xs: pairs.map((p) => p[0]), ys: pairs.map((p) => p[1]) };
  }

  function makePlot(container, xLabel, series, data, height) {
    container.replaceChildren();
    return new uPlot(
      {
        width: Math.max(300, container.clientWidth),
        height,
        scales: { x: { time: false } },
        axes: [{ label: xLabel, incrs: STEP_INCREMENTS }, {}],
        series: [{ label: xLabel }, ...series],
      },
      data,
      container,
    );
  }

  class SeriesView {
    // Every series the job reported, one small chart per picked name (uPlot writes labels as text).
    constructor(jobId, signal) {
      this.jobId = jobId;
      this.signal = signal;
      this.names = [];
      this.selected = null;
      this.charts = new Map(); // name -> {box, plot, axis}
      this.namesKey = null;
      signal.addEventListener("abort", () => this.charts.forEach((c) => c.plot?.destroy()), { once: true });
    }

    async refresh() {
      const data = await readSeries(this.jobId, this.selected ? [...this.selected] : null, this.signal);
      if (this.signal.aborted) return;
      $("series-panel").hidden = data.names.length === 0;
      if (!data.names.length) return;
      if (!this.selected) this.selected = new Set(data.names.slice(0, SERIES_SHOWN));
      this.names = data.names;
      this.renderNames();
      this.draw(data.series);
      $("series-status").textContent = `${data.names.length} series · ${data.series.length} points shown`;
    }

    renderNames() {
      const key = this.names.join("\u0000");
      if (key === this.namesKey) return;
      this.namesKey = key;
      $("series-names").replaceChildren(
        ...this.names.map((name) =>
          el("label", {},
            el("input", {
              type: "checkbox", "data-series-name": name, checked: this.selected.has(name),
              onchange: (event) => {
                if (event.target.checked) this.selected.add(name);
                else this.selected.delete(name);
                this.refresh().catch(console.error);
              },
            }),
            el("span", { class: "name", text: name })),
        ),
      );
    }

    draw(points) {
      const shown = this.names.filter((n) => this.selected.has(n));
      for (const [name, chart] of this.charts) {
        if (shown.includes(name)) continue;
        chart.plot?.destroy();
        chart.box.remove();
        this.charts.delete(name);
      }
      shown.forEach((name, i) => {
        const { axis, xs, ys } = xyOf(points, name);
        let chart = this.charts.get(name);
        if (!chart) {
          const holder = el("div");
          const box = el("div", { class: "series-chart", "data-series-chart": name }, el("h3", { text: name }), holder);
          $("series-charts").append(box);
          chart = { box, holder, plot: null, axis: null };
          this.charts.set(name, chart);
        }
        chart.box.dataset.points = String(xs.length);
        if (!chart.plot || chart.axis !== axis) {
          chart.plot?.destroy();
          const line = { label: name, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true, value: (u, v) => fmtNum(v) };
          chart.plot = makePlot(chart.holder, axis, [line], [xs, ys], 200);
          chart.axis = axis;
        } else {
          chart.plot.setData([xs, ys]);
        }
      });
      for (const name of shown) $("series-charts").append(this.charts.get(name).box); // in the names' order
      $("series-charts").dataset.charts = String(shown.length);
    }
  }

  class SweepView {
    // A sweep's children: points, objective, state, best first; their objective in one chart.
    constructor(jobId, signal) {
      this.jobId = jobId;
      this.signal = signal;
      this.plot = null;
      this.plotKey = null;
      this.ended = new Map(); // child id -> its objective's points, once it has ended
      signal.addEventListener("abort", () => this.plot?.destroy(), { once: true });
    }

    async refresh(parent) {
      $("sweep-panel").hidden = false;
      const sweep = parent.sweep;
      const objective = sweep.objective;
      const kids = await sweepChildren(this.jobId, Boolean(objective), this.signal);
      if (!objective) kids.sort((a, b) => a.id - b.id);
      if (this.signal.aborted) return;
      this.renderTable(kids, sweep);
      $("sweep-status").textContent = `${sweep.ended} of ${sweep.children} ended`
        + (sweep.early_stop ? ` · early stopping: ${sweep.early_stop.kind}` : "");
      if (objective) await this.chart(kids, objective, sweep.best);
      else {
        $("sweep-chart-title").textContent = "No objective";
        $("sweep-chart-note").textContent = "set sweep.objective to rank the children and chart them";
      }
    }

    renderTable(kids, sweep) {
      const objective = sweep.objective;
      const paths = [...new Set(kids.flatMap((c) => Object.keys(c.sweep_point || {})))];
      const heads = ["", "job", ...paths, ...(objective ? [`${objective.metric} (${objective.mode})`] : []), "state", "stopped early", "GPU-s"];
      $("sweep-head").replaceChildren(el("tr", {}, ...heads.map((h) => el("th", { text: h }))));
      const bestId = sweep.best?.job_id;
      $("sweep-body").replaceChildren(
        ...kids.map((c, i) => el(
          "tr",
          { "data-sweep-child": c.id, class: c.id === bestId ? "best" : null },
          el("td", { class: "muted", text: objective && c.objective_value != null ? String(i + 1) : "" }),
          el("td", {}, el("a", { href: `#/jobs/${c.id}`, text: `#${c.id}` })),
          ...paths.map((path) => el("td", { class: "mono", text: JSON.stringify((c.sweep_point || {})[path]) })),
          ...(objective ? [el("td", { class: "mono", "data-objective": "", text: fmtNum(c.objective_value, 5) })] : []),
          el("td", {}, el("span", { class: `badge ${c.state}`, text: c.state })),
          el("td", { text: c.stopped_early ? `at epoch ${c.stopped_early.epoch}` : "" }),
          el("td", { class: "mono", text: Math.round(c.gpu_seconds ?? 0).toString() }),
        )),
      );
    }

    async chart(kids, objective, best) {
      const valued = kids.filter((c) => c.objective_value != null);
      const charted = valued.slice(0, SWEEP_CURVES);
      $("sweep-chart-title").textContent = `${objective.metric} of each child`;
      const more = valued.length - charted.length;
      $("sweep-chart-note").textContent = more > 0 ? `the best ${charted.length} charted (${more} more in the table)` : "";
      const held = [];
      for (const c of charted) {
        let points = this.ended.get(c.id);
        if (!points) {
          const data = await readSeries(c.id, [objective.metric], this.signal);
          points = data.series.filter((p) => typeof p[objective.metric] === "number");
          if (TERMINAL.has(c.state)) this.ended.set(c.id, points);
        }
        held.push({ child: c, points });
      }
      if (this.signal.aborted) return;
      // one x for every curve: the epoch only where every child's every point has one
      const axis = seriesAxis(held.flatMap((h) => h.points));
      const curves = held.map((h) => ({ child: h.child, ...xyOf(h.points, objective.metric, axis) }));
      const xs = [...new Set(curves.flatMap((c) => c.xs))].sort((a, b) => a - b);
      const columns = curves.map((c) => {
        const at = new Map(c.xs.map((x, i) => [x, c.ys[i]]));
        return xs.map((x) => (at.has(x) ? at.get(x) : null));
      });
      const key = `${axis}|${curves.map((c) => c.child.id).join(",")}|${best?.job_id}`;
      if (key !== this.plotKey || !this.plot) {
        this.plot?.destroy();
        const series = curves.map((c, i) => ({
          label: `#${c.child.id} ${Object.entries(c.child.sweep_point || {}).map(([k, v]) => `${k.split(".").pop()}=${v}`).join(" ")}`,
          stroke: PALETTE[i % PALETTE.length],
          width: c.child.id === best?.job_id ? 3 : 1.5,
          spanGaps: true,
          value: (u, v) => fmtNum(v),
        }));
        this.plot = curves.length ? makePlot($("sweep-chart"), axis, series, [xs, ...columns], 300) : null;
        if (!curves.length) $("sweep-chart").replaceChildren(el("p", { class: "muted", text: "No child has reported the objective yet." }));
        this.plotKey = key;
      } else {
        this.plot.setData([xs, ...columns]);
      }
      $("sweep-chart").dataset.curves = String(curves.length);
    }
  }

  function jobView(jobId, signal) {
    showView("job");
    $("job-title").textContent = `Job #${jobId}`;
    $("job-state").textContent = "";
    $("job-facts").replaceChildren();
    $("job-error").hidden = true;
    $("ckpt-body").replaceChildren();
    $("ckpt-empty").hidden = false;
    $("chart").dataset.points = "0";
    $("chart").replaceChildren(el("p", { class: "muted placeholder", text: "No progress reported yet." }));
    $("chart-status").textContent = "";

    $("series-panel").hidden = true;
    $("series-names").replaceChildren();
    $("series-charts").replaceChildren();
    $("sweep-panel").hidden = true;
    $("sweep-chart").replaceChildren();
    $("sweep-chart").dataset.curves = "0";

    const chart = new Chart($("chart"));
    const series = new SeriesView(jobId, signal);
    const sweep = new SweepView(jobId, signal);
    const logs = new LogView($("log"), $("log-rank"), jobId);
    let job = null;
    let lastSeq = 0;
    let sawTerminal = false;
    signal.addEventListener("abort", () => chart.destroy(), { once: true });

    const terminal = () => job && TERMINAL.has(job.state);

    async function refreshJob() {
      job = await getJson(`/v1/jobs/${jobId}`, { signal });
      renderJob(job);
      logs.setRanks(job);
    }

    async function refreshCheckpoints() {
      const { items } = await getJson(`/v1/jobs/${jobId}/checkpoints`, { signal });
      renderCheckpoints(items);
    }

    function onEvent(event) {
      if (event.seq <= lastSeq) return; // already seen (a reconnect that overlapped)
      lastSeq = event.seq;
      if (event.type === "progress") {
        chart.add(event.data);
        if (job) {
          job.progress = { ...job.progress, ...event.data };
          renderProgress(job);
        }
      } else if (event.type === "state") {
        if (job) {
          job.state = event.data.state;
          renderState(job);
        }
        refreshJob().catch(() => {});
        if (TERMINAL.has(event.data.state)) {
          sawTerminal = true;
          refreshCheckpoints().catch(() => {});
        }
      } else if (event.type === "checkpoint") {
        refreshCheckpoints().catch(() => {});
      }
    }

    // Reads the stream until the job's terminal state event; reconnects after `lastSeq` when cut off.
    async function followEvents() {
      let backoff = 1000;
      while (!signal.aborted && !sawTerminal) {
        $("chart-status").textContent = "live";
        try {
          await readEventStream(jobId, lastSeq, onEvent, signal);
          backoff = 1000;
        } catch (err) {
          if (signal.aborted) return;
          if (err.status === 404 || err.status === 401) {
            $("chart-status").textContent = err.message;
            return;
          }
          console.error("event stream", err);
          $("chart-status").textContent = "reconnecting…";
          backoff = Math.min(backoff * 2, 15000);
        }
        if (!sawTerminal) await sleep(backoff, signal);
      }
      if (!signal.aborted) $("chart-status").textContent = `job ${job?.state ?? "ended"}`;
    }

    (async () => {
      try {
        await refreshJob();
      } catch (err) {
        if (signal.aborted) return;
        $("job-title").textContent = `Job #${jobId}`;
        $("job-error").hidden = false;
        $("job-error").textContent = err.status === 404 ? "No such job (or it is not yours)." : err.message;
        return;
      }
      refreshCheckpoints().catch(console.error);
      followEvents();
      // The job row (pending reason, assignments) and the logs, until the job ends.
      // Once the job has ended, one more read of the logs and the polling stops.
      poll(async () => {
        const ended = terminal();
        if (!ended) await refreshJob();
        await logs.fetchMore(signal);
        return !ended;
      }, 2000, signal);
      // The series (§13) and a sweep's children, until the job ends, then once more.
      poll(async () => {
        const ended = terminal();
        if (job?.sweep) await sweep.refresh(job);
        else await series.refresh();
        return !ended;
      }, 5000, signal);
    })();
  }

  function renderState(job) {
    const badge = $("job-state");
    badge.className = `badge ${job.state}`;
    badge.textContent = job.state;
    $("job-cancel").hidden = TERMINAL.has(job.state) || job.state === "cancelling";
    renderExec(job);
  }

  // Contract §14: the command that looks into a running job, to copy into a terminal.
  function renderExec(job) {
    const running = job.state === "running";
    const command = `torchjobs exec ${job.id} -- ps -ef`;
    $("job-exec-copy").hidden = !running;
    $("job-exec-line").hidden = !running;
    $("job-exec").textContent = command;
    $("job-exec-copy").onclick = async () => {
      try {
        await navigator.clipboard.writeText(command);
        $("job-exec-copy").textContent = "Copied";
      } catch (err) {
        window.getSelection().selectAllChildren($("job-exec"));  // no clipboard: selected to copy by hand
      }
    };
  }

  function renderProgress(job) {
    const p = job.progress || {};
    let fraction = p.fraction;
    if (p.total_steps && p.step !== undefined && p.step !== null) fraction = Math.min(1, p.step / p.total_steps);
    if (job.state === "succeeded") fraction = 1;
    $("job-bar").style.width = `${Math.round((fraction ?? 0) * 100)}%`;
    const loss = p.loss !== null && p.loss !== undefined ? ` · loss ${fmtNum(p.loss)}` : "";
    const acc = p.val_accuracy !== null && p.val_accuracy !== undefined ? ` · val accuracy ${(p.val_accuracy * 100).toFixed(1)}%` : "";
    $("job-progress").textContent = `${progressText(p)}${loss}${acc}`;
  }

  // An elastic job's `nodes` is its range {min, max} (contract §12): the nodes it has now, then the range.
  function nodeCount(job) {
    if (typeof job.nodes === "number") return job.nodes;
    return (job.assignments || []).length || job.nodes.max;
  }

  function nodesText(job) {
    if (typeof job.nodes === "number") return String(job.nodes);
    const now = (job.assignments || []).length;
    return `${now || "–"} (${job.nodes.min}–${job.nodes.max})`;
  }

  function renderJob(job) {
    $("chart-panel").hidden = Boolean(job.sweep); // a sweep's parent trains nothing itself
    $("job-title").textContent = `Job #${job.id}${job.name ? ` · ${job.name}` : ""}`;
    renderState(job);
    renderProgress(job);
    const ep = job.entrypoint || {};
    const entry = ep.kind === "builtin" ? `builtin ${ep.model} on ${ep.dataset}`
      : ep.kind === "script" ? `script ${ep.path}` : `factory ${ep.model ?? ""}`;
    const facts = [
      ["owner", job.owner],
      ["mode", `${job.mode}, ${nodesText(job)} node(s) × ${job.gpus_per_node} GPU(s)`],
      ["entrypoint", entry],
      ["attempt", `${job.attempt} (max retries ${job.max_retries})`],
      ["created", fmtTime(job.created_at)],
      ["started", fmtTime(job.started_at)],
      ["finished", fmtTime(job.finished_at)],
      ["placed on", job.assignments.map((a) => `node ${a.node_rank}: ${a.worker} [${a.gpus.join(", ")}]`).join("; ") || "–"],
    ];
    if (job.state === "queued") {
      facts.push(["waiting", `${job.pending_reason || "for the scheduler"} (position ${job.queue_position ?? "?"})`]);
    }
    if ((job.attempts || []).length > 1) {
      facts.push(["attempts", job.attempts.map((a) => `${a.attempt}: ${a.reason || job.state}`).join("; ")]);
    }
    if (job.exit_code !== null && job.exit_code !== undefined) facts.push(["exit code", String(job.exit_code)]);
    if (job.code) facts.push(["code", job.code]);
    if (job.environment && (job.environment.pip || []).length) {
      facts.push(["environment", `pip: ${job.environment.pip.join(" ")}`]);
    }
    if (job.hyperparameters) {
      facts.push(["hyperparameters", Object.entries(job.hyperparameters).map(([k, v]) => `${k}=${v}`).join(" ")]);
    }
    $("job-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
    $("job-error").hidden = !job.error;
    $("job-error").textContent = job.error || "";
    $("job-cancel").onclick = async () => {
      if (!confirm(`Cancel job #${job.id}?`)) return;
      try {
        renderJob(await getJson(`/v1/jobs/${job.id}/cancel`, { method: "POST" }));
      } catch (err) {
        alert(err.message);
      }
    };
  }

  // A download's progress and verdict, by checkpoint id (or "ID/PATH" for one file of a folder):
  // kept across the table's re-renders (a checkpoint or state event may redraw it while a
  // download is still running), as is which folders' file lists are open.
  const ckptStatus = new Map();
  const openFolders = new Set();
  const FILES_SHOWN = 1000;

  function renderCheckpoints(items) {
    $("ckpt-empty").hidden = items.length > 0;
    $("ckpt-body").replaceChildren(
      ...items.map((ckpt) => {
        const folder = ckpt.kind === "folder";
        const key = String(ckpt.id);
        const status = el("span", { class: "verified", "data-ckpt-status": key });
        status.textContent = ckptStatus.get(key) || "";
        // A folder downloads as its tar (contract §11), whose X-Checksum-SHA256 is the
        // manifest's: the tar is checked by its length; each file by its own SHA-256 below.
        const target = {
          key,
          url: ckpt.download_url,
          filename: folder ? `${ckpt.name}.tar` : ckpt.name,
          sha256: folder ? null : ckpt.sha256,
          size: folder ? null : ckpt.size_bytes,
        };
        const link = el("a", {
          class: "download",
          href: ckpt.download_url,
          download: target.filename,
          "data-ckpt": ckpt.id,
          text: folder ? "download .tar" : "download",
          onclick: (event) => {
            event.preventDefault();
            downloadCheckpoint(target, link, status);
          },
        });
        return el(
          "tr",
          { title: `sha256 ${ckpt.sha256}\nstep ${ckpt.step ?? "–"} · ${fmtTime(ckpt.created_at)}` },
          el("td", { class: "mono" }, ckpt.name, folder ? folderFiles(ckpt) : null),
          el("td", { text: ckpt.epoch ?? "–" }),
          el("td", { text: fmtBytes(ckpt.size_bytes) }),
          el("td", {}, link, status),
        );
      }),
    );
  }

  // A folder checkpoint's files, listed when opened (GET /v1/checkpoints/{id}/files).
  function folderFiles(ckpt) {
    const body = el("tbody");
    const details = el(
      "details",
      {
        class: "ckpt-files",
        "data-ckpt-files": ckpt.id,
        ontoggle: () => {
          if (details.open) openFolders.add(ckpt.id);
          else openFolders.delete(ckpt.id);
          if (details.open && !details.dataset.loaded) loadFiles(ckpt, body, details);
        },
      },
      el("summary", { text: `${ckpt.files} file${ckpt.files === 1 ? "" : "s"}` }),
      el(
        "table",
        { class: "files" },
        el("thead", {}, el("tr", {}, el("th", { text: "path" }), el("th", { text: "size" }), el("th", { text: "node" }), el("th"))),
        body,
      ),
    );
    if (openFolders.has(ckpt.id)) details.open = true;
    return details;
  }

  async function loadFiles(ckpt, body, details) {
    details.dataset.loaded = "1";
    try {
      const { items } = await getJson(`/v1/checkpoints/${ckpt.id}/files`);
      const rows = items.slice(0, FILES_SHOWN).map((f) => fileRow(ckpt, f));
      if (items.length > FILES_SHOWN) {
        rows.push(el("tr", {}, el("td", { colspan: 4, class: "muted", text: `… and ${items.length - FILES_SHOWN} more` })));
      }
      body.replaceChildren(...rows);
    } catch (err) {
      delete details.dataset.loaded;
      body.replaceChildren(el("tr", {}, el("td", { colspan: 4, text: `failed: ${err.message}` })));
    }
  }

  function fileRow(ckpt, file) {
    const url = `/v1/checkpoints/${ckpt.id}/files/${file.path.split("/").map(encodeURIComponent).join("/")}`;
    const key = `${ckpt.id}/${file.path}`;
    const target = { key, url, filename: file.path.split("/").pop(), sha256: file.sha256, size: file.size_bytes };
    const status = el("span", { class: "verified", "data-ckpt-status": key });
    status.textContent = ckptStatus.get(key) || "";
    const link = el("a", {
      class: "file-download",
      href: url,
      download: target.filename,
      text: "download",
      onclick: (event) => {
        event.preventDefault();
        downloadCheckpoint(target, link, status);
      },
    });
    return el(
      "tr",
      { title: `sha256 ${file.sha256}` },
      el("td", { class: "mono", text: file.path }),
      el("td", { text: fmtBytes(file.size_bytes) }),
      el("td", { text: file.node_rank }),
      el("td", {}, link, status),
    );
  }

  // The download needs the Authorization header, so it is fetched here and saved from a Blob.
  // `target`: {key, url, filename, sha256 (null: check the length only), size (null: as sent)}.
  async function downloadCheckpoint(target, link, status) {
    if (link.dataset.busy) return;
    link.dataset.busy = "1";
    const show = (text) => {
      ckptStatus.set(target.key, text);
      const live = document.querySelector(`[data-ckpt-status="${CSS.escape(target.key)}"]`) || status;
      live.textContent = text;
    };
    show("0%");
    try {
      const resp = await request(target.url);
      const sent = Number(resp.headers.get("Content-Length"));
      const total = target.size ?? sent;
      const reader = resp.body.getReader();
      const chunks = [];
      let received = 0;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        chunks.push(value);
        received += value.byteLength;
        if (total) show(`${Math.floor((received / total) * 100)}%`);
      }
      const blob = new Blob(chunks, { type: "application/octet-stream" });
      if (target.sha256 && crypto.subtle) {
        // Only in a secure context (https or localhost); elsewhere the size is all we can check.
        const digest = await crypto.subtle.digest("SHA-256", await blob.arrayBuffer());
        const hex = Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
        if (hex !== target.sha256) throw new Error("SHA-256 mismatch: the download is corrupt");
        show("✓ sha256");
      } else {
        if (blob.size !== total) throw new Error("size mismatch: the download is incomplete");
        show("✓ size");
      }
      const url = URL.createObjectURL(blob);
      const save = el("a", { href: url, download: target.filename, hidden: true });
      document.body.append(save);
      save.click();
      save.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60000);
    } catch (err) {
      show(`failed: ${err.message}`);
    } finally {
      delete link.dataset.busy;
    }
  }

  window.torchjobs = { SSEParser }; // for tests and the console
  route();
})();

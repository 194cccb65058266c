// The live page: one websocket (docs/protocol.md) for sessions, standing answers and asks;
// GET /v1/sessions/{name}/bars for the chart. No framework; uPlot is vendored under /static/vendor.
(() => {
  "use strict";
  const $ = (sel, el = document) => el.querySelector(sel);
  const el = (tag, attrs = {}, text) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  };
  const TOKEN_KEY = "streamllm_token";
  const state = { ws: null, nextId: 1, pending: new Map(), onToken: new Map(), sessions: new Map(), auth: false };

  // `streamllm serve` prints the page's URL with ?token= (its local token): taken once, kept for this
  // tab only (sessionStorage), and removed from the address bar so it lands in no history or bookmark.
  (function adoptUrlToken() {
    const url = new URL(location.href);
    const hash = new URLSearchParams(url.hash.slice(1));  // #token= links of earlier versions
    const given = url.searchParams.get("token") || hash.get("token");
    if (!given) return;
    sessionStorage.setItem(TOKEN_KEY, given);
    url.searchParams.delete("token");
    hash.delete("token");
    url.hash = hash.toString();
    history.replaceState(null, "", url.pathname + url.search + url.hash);
  })();
  const token = () => sessionStorage.getItem(TOKEN_KEY) || "";
  // Every request sends the token in a header; only an EventSource (which cannot) would put it in its URL.
  const authHeaders = () => (token() ? { Authorization: "Bearer " + token() } : {});

  function setStatus(text, cls) {
    const s = $("#status");
    s.textContent = text;
    s.className = "status " + (cls || "");
  }

  function request(type, fields = {}, onToken) {
    const id = state.nextId++;
    return new Promise((resolve, reject) => {
      state.pending.set(id, { resolve, reject });
      if (onToken) state.onToken.set(id, onToken);
      state.ws.send(JSON.stringify({ type, id, ...fields }));
    });
  }

  function connect() {
    const ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/");
    state.ws = ws;
    ws.onopen = async () => {
      try {
        const hello = await request("hello", token() ? { token: token() } : {});
        state.auth = hello.auth;
        $("#model").textContent = `model ${hello.model} · tenant ${hello.tenant}` + (hello.read_only ? " (read-only)" : "");
        setStatus("live", "live");
        await refreshSessions();
      } catch (err) {
        setStatus(String(err.message || err), "down");
        $("#token-form").hidden = false;
      }
    };
    ws.onmessage = (ev) => {
      const msg = JSON.parse(ev.data);
      if (msg.type === "token") {
        const fn = state.onToken.get(msg.id);
        if (fn) fn(msg.text);
        return;
      }
      if (msg.id !== undefined && state.pending.has(msg.id)) {
        const p = state.pending.get(msg.id);
        state.pending.delete(msg.id);
        state.onToken.delete(msg.id);
        if (msg.type === "error") p.reject(new Error(`${msg.code}: ${msg.message}`));
        else p.resolve(msg);
        return;
      }
      if (msg.type === "standing") showAnswer(msg.session, msg);
      else if (msg.type === "data") onData(msg.session, msg.data_version);
    };
    ws.onclose = (ev) => {
      for (const p of state.pending.values()) p.reject(new Error("connection closed"));
      state.pending.clear();
      if (ev.code === 1008) {  // no token, or a wrong one: ask for one
        setStatus(`not connected (${ev.reason || "policy"}): enter a token`, "down");
        $("#token-form").hidden = false;
        return;
      }
      setStatus(`disconnected (${ev.code}${ev.reason ? ": " + ev.reason : ""}); retrying`, "down");
      setTimeout(connect, 2000);
    };
  }

  async function refreshSessions() {
    const stats = await request("stats");
    const names = stats.sessions.map((s) => s.name).filter((n) => !n.startsWith(".")).sort();
    $("#empty").hidden = names.length > 0;
    state.many = names.length > CARD_LIMIT;
    $("#overview").hidden = names.length < 2;
    const select = $("#ask-session");
    for (const name of names) {
      if (!state.sessions.has(name)) {
        addCard(name);
        select.append(el("option", { value: name }, name));
      }
      const snap = await request("subscribe", { session: name });
      setVersion(name, snap.data_version, true);
      for (const a of snap.standing) showAnswer(name, a);
      fetchBars(name);
    }
  }

  function addCard(name) {
    const card = el("section", { class: "card", "data-session": name });
    const h2 = el("h2", {}, name);
    h2.append(el("span", { class: "version" }, "data_version 0"));
    const chart = el("div", { class: "chart" });
    const table = el("table");
    table.innerHTML = "<thead><tr><th>question</th><th>answer</th><th>path</th><th>confidence</th>" +
      "<th title=\"the gap the gate decided at, and whose: config (the question's threshold), head (its adapter head's own), auto (live)\">threshold</th>" +
      "<th title=\"labelled questions: standing answers scored against the label, over the last 500; base: what always giving the most common truth would score\">right (live)</th>" +
      "<th title=\"the gate over the same window: share answered fast, and right among those\">gate</th>" +
      "<th>data_version</th><th>age</th></tr></thead><tbody></tbody>";
    const curves = el("div", { class: "curves" });
    card.append(h2, chart, table, curves);
    $("#sessions").append(card);
    // confirmed: the session's data_version at the last snapshot. Events carry only answers whose text
    // changed, so an answer is "behind" only if a snapshot showed it older than the session's data.
    const s = { card, chart: null, chartEl: chart, version: 0, confirmed: 0, answers: new Map(), refreshAt: 0, timer: null,
      curvesEl: curves, curves: new Map() };
    state.sessions.set(name, s);
    card.hidden = !!state.many;  // many sessions: the overview's row opens its card
    s.row = overviewRow(name);
  }

  // The overview (many sessions on one page): one row per session, a sparkline of its closes and each
  // standing question's answer; sortable by any column, filtered by a question's answer. Past CARD_LIMIT
  // sessions the cards (and their charts) stay hidden until a row is clicked.
  const CARD_LIMIT = 24;
  const overview = { questions: [], sortKey: "session", dir: 1, pending: false };

  function overviewRow(name) {
    const row = el("tr", { "data-session": name });
    row.append(el("td", { class: "session" }, name), el("td", { class: "spark" }), el("td", { class: "change num" }, "-"),
      el("td", { class: "dv num" }, "0"));
    for (const q of overview.questions) row.append(el("td", { class: "answer", "data-question": q }, "-"));
    row.addEventListener("click", () => {
      const s = state.sessions.get(name);
      s.card.hidden = !s.card.hidden;
      row.classList.toggle("open", !s.card.hidden);
      if (!s.card.hidden) {
        fetchBars(name);
        s.card.scrollIntoView({ block: "nearest" });
      }
    });
    $("#overview-table tbody").append(row);
    return row;
  }

  function overviewHeader() {
    const tr = $("#overview-table thead tr");
    tr.replaceChildren();
    const cols = [["session", "session"], ["", "last bars"], ["change", "change"], ["version", "data_version"],
      ...overview.questions.map((q) => ["q:" + q, q])];
    for (const [key, label] of cols) {
      const th = el("th", key ? { "data-sort": key } : {}, label);
      if (key === overview.sortKey) th.dataset.dir = overview.dir;
      if (key) th.addEventListener("click", () => {
        overview.dir = overview.sortKey === key ? -overview.dir : 1;
        overview.sortKey = key;
        overviewHeader();
        overviewChanged();
      });
      tr.append(th);
    }
  }

  function overviewAnswer(s, a) {
    const qid = a.question_id;
    if (!overview.questions.includes(qid)) {
      overview.questions.push(qid);
      overview.questions.sort();
      $("#filter-question").append(el("option", { value: qid }, qid));
      for (const other of state.sessions.values()) {  // a column for it in every row, in the sorted place
        const at = overview.questions.indexOf(qid);
        const cell = el("td", { class: "answer", "data-question": qid }, "-");
        const cells = other.row.querySelectorAll("td.answer");
        if (at < cells.length) other.row.insertBefore(cell, cells[at]);
        else other.row.append(cell);
      }
      overviewHeader();
    }
    const cell = $(`td.answer[data-question="${CSS.escape(qid)}"]`, s.row);
    cell.textContent = a.path === "gate" ? "-" : a.warming_up ? "warming up" : a.text;
    overviewChanged();
  }

  function sparkline(s, closes) {
    const td = $(".spark", s.row);
    const pts = closes.slice(-60);
    s.change = pts.length > 1 ? pts[pts.length - 1] / pts[0] - 1 : null;
    $(".change", s.row).textContent = s.change === null ? "-" : `${(100 * s.change).toFixed(2)}%`;
    if (pts.length < 2) return td.replaceChildren();
    const w = 120, h = 24, lo = Math.min(...pts), hi = Math.max(...pts), span = hi - lo || 1;
    const xy = pts.map((c, i) => `${(i * w / (pts.length - 1)).toFixed(1)},${(h - 1 - (c - lo) / span * (h - 2)).toFixed(1)}`);
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("class", "spark " + (s.change > 0 ? "up" : s.change < 0 ? "down" : ""));
    svg.setAttribute("width", w);
    svg.setAttribute("height", h);
    svg.dataset.points = pts.length;
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", xy.join(" "));
    svg.append(line);
    td.replaceChildren(svg);
    overviewChanged();
  }

  // Sorting and filtering run once a frame, however many answers arrived in it.
  function overviewChanged() {
    if (overview.pending) return;
    overview.pending = true;
    requestAnimationFrame(() => {
      overview.pending = false;
      const key = overview.sortKey, dir = overview.dir;
      const value = (name, s) => key === "session" ? name : key === "version" ? s.version
        : key === "change" ? (s.change ?? -Infinity) : (s.answers.get(key.slice(2))?.text ?? "");
      const rows = [...state.sessions.entries()].sort(([a, sa], [b, sb]) => {
        const va = value(a, sa), vb = value(b, sb);
        return (va < vb ? -1 : va > vb ? 1 : a < b ? -1 : a > b ? 1 : 0) * dir;
      });
      const q = $("#filter-question").value, want = $("#filter-answer").value.trim().toLowerCase();
      let shown = 0;
      const body = $("#overview-table tbody");
      for (const [, s] of rows) {
        const texts = q ? [s.answers.get(q)?.text ?? ""] : [...s.answers.values()].map((a) => a.text);
        s.row.hidden = !!want && !texts.some((t) => t.toLowerCase().includes(want));
        shown += !s.row.hidden;
        body.append(s.row);  // re-appending moves it: the rows end up in sorted order
      }
      $("#overview-count").textContent = `${shown} of ${rows.length} sessions`;
    });
  }
  $("#filter-question").addEventListener("change", overviewChanged);
  $("#filter-answer").addEventListener("input", overviewChanged);
  overviewHeader();

  function setVersion(name, version, snapshot = false) {
    const s = state.sessions.get(name);
    if (!s) return;
    s.version = Math.max(s.version, version);
    if (snapshot) s.confirmed = Math.max(s.confirmed, version);
    $(".version", s.card).textContent = `data_version ${s.version}`;
    $(".dv", s.row).textContent = s.version;
    s.row.dataset.version = s.version;
    overviewChanged();
  }

  function showAnswer(name, a) {
    const s = state.sessions.get(name);
    if (!s) return;
    let row = $(`tr[data-question="${CSS.escape(a.question_id)}"]`, s.card);
    const old = s.answers.get(a.question_id);
    if (!row) {
      row = el("tr", { "data-question": a.question_id });
      for (const cls of ["question", "answer", "path", "confidence num", "threshold num", "right num", "gate num", "dv num", "age num"]) {
        row.append(el("td", { class: cls }));
      }
      $("tbody", s.card).append(row);
    }
    s.answers.set(a.question_id, a);
    overviewAnswer(s, a);
    $(".question", row).textContent = a.question_id;
    // path "gate": a push = false free-text question. Nobody is sent its answer; what the engine keeps is
    // the gate's view (the first token), no answer: ask decodes one.
    const notPushed = a.path === "gate";
    const answer = $(".answer", row);
    answer.textContent = notPushed ? "ask to decode" : a.warming_up ? "warming up" : a.text;
    answer.title = notPushed ? `push = false: nobody is sent this answer; ask "${a.question_id}" to decode it`
      : a.warming_up ? `a guess (${a.text}), not an answer yet: ${a.warming_up_reason || "not enough data yet"}` : "";
    answer.classList.toggle("pending", notPushed || !!a.warming_up);
    const path = $(".path", row);
    path.textContent = notPushed ? "not pushed" : a.path;
    path.className = "path path-" + a.path;
    const guess = notPushed || a.warming_up;
    $(".confidence", row).textContent = !guess && typeof a.confidence === "number" ? a.confidence.toFixed(2) : "-";
    const threshold = $(".threshold", row);
    threshold.textContent = !a.threshold_source ? "-"
      : `${typeof a.threshold === "number" ? a.threshold.toFixed(2) : "closed"} ${a.threshold_source}`;
    row.dataset.warming = a.warming_up ? "1" : "";
    showCalibration(row, a.calibration);
    showCurve(s, a.question_id, a.calibration);
    $(".dv", row).textContent = a.data_version;
    row.dataset.version = a.data_version;
    if (old && old.text !== a.text) {
      row.classList.add("flash");
      setTimeout(() => row.classList.remove("flash"), 800);
    }
    ages();
  }

  const UNDATED_BEFORE = 365 * 86400;  // bar times before 1971: lines without a date
  const pct = (x) => (typeof x === "number" ? `${Math.round(100 * x)}%` : "-");

  // Live calibration (docs/calibration.md): only labelled questions carry it; the rest show "-".
  function showCalibration(row, c) {
    const right = $(".right", row), gate = $(".gate", row);
    if (!c || !c.samples) {
      right.textContent = gate.textContent = "-";
      gate.title = "";
      return;
    }
    right.textContent = `${pct(c.accuracy)} of ${c.samples}` + (typeof c.base_rate === "number" ? `, base ${pct(c.base_rate)}` : "");
    const rule = typeof c.target === "number"
      ? `auto:${c.target}` + (typeof c.confidence === "number" && c.confidence > 0.5 ? `, confidence ${c.confidence}` : "")
      : "fixed threshold";
    if (c.threshold === null && typeof c.target === "number") {
      gate.textContent = "closed";
      gate.title = `${rule}: not enough evidence yet to reach precision ${c.target}`;
    } else {
      gate.textContent = `${pct(c.coverage)} at ${pct(c.precision)}`;
      gate.title = `${rule}; threshold ${typeof c.threshold === "number" ? c.threshold.toFixed(2) : "-"}`;
    }
  }

  // The learning curve (docs/calibration.md): every 10 scored answers, [scored, accuracy and base rate of
  // the newest 50, whether the gate was open]; drawn from the first point, shaded where the gate was open.
  function showCurve(s, qid, c) {
    const history = (c && c.history) || [];
    let curve = s.curves.get(qid);
    if (!history.length) {
      if (curve) {
        curve.plot.destroy();
        curve.fig.remove();
        s.curves.delete(qid);
      }
      return;
    }
    if (!curve) {
      const fig = el("figure", { class: "curve", "data-question": qid,
        title: "accuracy and base rate of the newest 50 scored answers, every 10; shaded: the gate was open" });
      const caption = el("figcaption");
      caption.append(el("span", { class: "name" }, qid), el("span", { class: "key acc" }, "accuracy"),
        el("span", { class: "key base" }, "base rate"), el("span", { class: "key open" }, "gate open"),
        el("span", { class: "learned" }));
      fig.append(caption, el("div", { class: "plot" }));
      s.curvesEl.append(fig);
      curve = { fig, plot: null, open: [], key: "" };
      s.curves.set(qid, curve);
    }
    const l = c.learning;
    // The control: the same head on the lines' own numbers, scored on the same answers (docs/calibration.md).
    const control = l && l.compared
      ? `; right ${pct(l.answer_accuracy)} vs raw-number control ${pct(l.control_accuracy)} (last ${l.compared})` : "";
    $(".learned", curve.fig).textContent = l
      ? `learning: ${l.fits} head${l.fits === 1 ? "" : "s"} fitted on ${l.samples} sample${l.samples === 1 ? "" : "s"}${control}` : "";
    const last = history[history.length - 1];
    const key = `${history[0][0]}-${last[0]}:${history.length}`;  // points are only appended (the oldest dropped)
    if (key === curve.key) return;
    curve.key = key;
    curve.open = history.map((p) => !!p[3]);
    curve.fig.dataset.points = history.length;
    curve.fig.dataset.open = curve.open.filter(Boolean).length;
    const data = [history.map((p) => p[0]), history.map((p) => p[1]), history.map((p) => p[2])];
    if (curve.plot) {
      curve.plot.setData(data);
      return;
    }
    const axis = { stroke: "#8b949e", grid: { stroke: "#30363d" }, font: "11px system-ui", size: 30 };
    curve.plot = new uPlot({
      width: 340, height: 150, legend: { show: false }, cursor: { show: false },
      scales: { x: { time: false }, y: { range: [0, 1] } },
      axes: [{ ...axis, label: "scored answers", labelFont: "11px system-ui", labelSize: 14 },
        { ...axis, size: 46, splits: () => [0, 0.5, 1], values: (u, vals) => vals.map(pct) }],
      series: [{}, { label: "accuracy", stroke: "#4fa3ff", width: 1.5 },
        { label: "base rate", stroke: "#8b949e", width: 1, dash: [4, 4] }],
      hooks: { drawClear: [(u) => shadeOpen(u, curve.open)] },
    }, data, $(".plot", curve.fig));
  }

  // Each run of points with the gate open: a band from half a step before its first to half after its last.
  function shadeOpen(u, open) {
    const xs = u.data[0], { left, top, width, height } = u.bbox;
    const half = xs.length > 1 ? (xs[1] - xs[0]) / 2 : 5;
    u.ctx.save();
    u.ctx.fillStyle = "rgba(63, 185, 80, 0.18)";
    for (let i = 0; i < xs.length; i++) {
      if (!open[i]) continue;
      let j = i;
      while (j + 1 < xs.length && open[j + 1]) j++;
      const x0 = Math.max(left, u.valToPos(xs[i] - half, "x", true));
      const x1 = Math.min(left + width, u.valToPos(xs[j] + half, "x", true));
      if (x1 > x0) u.ctx.fillRect(x0, top, x1 - x0, height);
      i = j;
    }
    u.ctx.restore();
  }

  function onData(name, version) {
    setVersion(name, version);
    const s = state.sessions.get(name);
    if (!s || s.timer) return;
    // A burst of data events refreshes once a second: bars, and a fresh snapshot of the answers
    // (events only carry answers whose text changed; the snapshot shows their data_version too).
    const wait = Math.max(0, s.refreshAt - Date.now());
    s.timer = setTimeout(async () => {
      s.timer = null;
      s.refreshAt = Date.now() + 1000;
      fetchBars(name);
      try {
        const snap = await request("subscribe", { session: name, data: true });
        setVersion(name, snap.data_version, true);
        for (const a of snap.standing) showAnswer(name, a);
      } catch (_) { /* reconnecting */ }
    }, wait);
  }

  async function fetchBars(name) {
    const s = state.sessions.get(name);
    const res = await fetch(`/v1/sessions/${encodeURIComponent(name)}/bars`, { headers: authHeaders() });
    if (!res.ok || !s) return;
    const body = await res.json();
    s.card.dataset.bars = body.t.length;
    sparkline(s, body.close);
    if (!body.t.length || s.card.hidden) return;
    // Lines with a time of day but no date (bars.py counts them from 1970-01-01): no date to draw them
    // at, so the x axis is the bar's number in the session instead (bars_seen counts them all).
    const dated = body.t[0] >= UNDATED_BEFORE;
    const first = (body.bars_seen || body.t.length) - body.t.length + 1;
    const data = [dated ? body.t : body.t.map((_, i) => first + i), body.close];
    if (s.chart && s.card.dataset.axis !== (dated ? "time" : "bar")) {
      s.chart.destroy();
      s.chart = null;
    }
    if (!s.chart) {
      const width = Math.max(300, s.chartEl.clientWidth || 480);
      s.card.dataset.axis = dated ? "time" : "bar";
      const grid = { stroke: "#8b949e", grid: { stroke: "#30363d" } };
      s.chart = new uPlot({
        width, height: 220, legend: { show: false },
        scales: { x: { time: dated } },
        tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"),
        axes: [dated ? grid : { ...grid, label: "bar (lines carry no date)", labelSize: 18 },
          { ...grid, size: 70 }],
        series: [{}, { label: "close", stroke: "#4fa3ff", width: 1.5 }],
      }, data, s.chartEl);
    } else {
      s.chart.setData(data);
    }
  }

  function ages() {
    const now = Date.now() / 1000;
    for (const s of state.sessions.values()) {
      for (const [qid, a] of s.answers) {
        const row = $(`tr[data-question="${CSS.escape(qid)}"]`, s.card);
        if (!row) continue;
        $(".age", row).textContent = a.updated_at ? `${Math.max(0, now - a.updated_at).toFixed(1)}s` : "-";
        $(".dv", row).classList.toggle("behind", a.data_version < s.confirmed);
      }
    }
  }
  setInterval(ages, 500);

  $("#ask-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const session = $("#ask-session").value;
    const question = $("#ask-question").value.trim();
    if (!session || !question) return;
    const out = $("#ask-output");
    const text = $(".text", out), meta = $(".meta", out);
    text.textContent = "";
    meta.textContent = "…";
    out.dataset.state = "asking";
    try {
      const answer = await request("ask", { session, question, stream: true, max_tokens: 24 },
        (delta) => { text.textContent += delta; });
      text.textContent = answer.text;
      const conf = typeof answer.confidence === "number" ? `, confidence ${answer.confidence.toFixed(2)}` : "";
      const warming = answer.warming_up ? `, warming up: ${answer.warming_up_reason || "not enough data yet"}` : "";
      meta.textContent = `[${answer.path} path${conf}, data_version ${answer.data_version}, ${answer.latency_ms.toFixed(1)} ms${warming}]`;
      out.dataset.state = "answered";
    } catch (err) {
      meta.textContent = String(err.message || err);
      out.dataset.state = "error";
    }
  });

  $("#token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value);
    $("#token-form").hidden = true;
    connect();
  });

  connect();
})();

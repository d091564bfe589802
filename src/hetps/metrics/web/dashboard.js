/* hetps live dashboard: polls /api/state once a second and draws it (docs/LIVE.md). */
(function () {
  "use strict";
  var T = window.hetpsTimeline;
  var params = new URLSearchParams(location.search);
  var interval = Math.max(250, 1000 * (parseFloat(params.get("interval")) || 1));
  var HISTORY = 300;
  var hist = {t: [], rate: [], links: {}};
  var last = null, polls = 0, errors = 0, rateChart = null, bytesChart = null, bytesKeys = "";
  var state = null, valuesChart = null, valuesKeys = "";

  function $(id) { return document.getElementById(id); }
  function fmt(v, digits) { return v === null || v === undefined ? "-" : Number(v).toFixed(digits); }
  function cell(row, text, cls) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }
  function fill(tbody, rows) {
    tbody.textContent = "";
    rows.forEach(function (r) { tbody.appendChild(r); });
  }

  function chart(el, title, series, data) {
    var width = Math.max(300, el.clientWidth || 400);
    var opts = {
      width: width, height: 180, legend: {show: true, live: false},
      scales: {x: {time: false}},
      axes: [{label: "uptime (s)"}, {size: 70, values: function (u, vals) {
        return vals.map(function (v) { return title === "bytes/s" ? T.human(v) : String(v); });
      }}],
      series: [{label: "s"}].concat(series),
    };
    el.textContent = "";
    return new uPlot(opts, data, el);
  }

  var PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"];

  function updateCharts(s) {
    var t = s.uptime;
    if (last && t > last.uptime) {
      var rate = (s.rounds - last.rounds) / (t - last.uptime);
      hist.t.push(t);
      hist.rate.push(rate);
      var seen = {};
      s.workers.forEach(function (w) {
        (w.rates || []).forEach(function (r) {
          var up = "worker" + w.rank + "\u2192server" + r[0];
          var down = "server" + r[0] + "\u2192worker" + w.rank;
          seen[up] = r[1]; seen[down] = r[2];
        });
      });
      Object.keys(seen).forEach(function (k) {
        if (!hist.links[k]) hist.links[k] = hist.t.slice(0, -1).map(function () { return null; });
      });
      Object.keys(hist.links).forEach(function (k) {
        hist.links[k].push(k in seen ? seen[k] : null);
      });
      if (hist.t.length > HISTORY) {
        hist.t.shift(); hist.rate.shift();
        Object.keys(hist.links).forEach(function (k) { hist.links[k].shift(); });
      }
      $("rate").textContent = rate.toFixed(1);
      document.body.dataset.rate = String(rate);
    }
    if (!hist.t.length) return;
    if (!rateChart) {
      rateChart = chart($("rate-chart"), "rounds/s", [{label: "rounds/s", stroke: "#4c72b0", width: 2}],
                        [hist.t, hist.rate]);
    } else {
      rateChart.setData([hist.t, hist.rate]);
    }
    var keys = Object.keys(hist.links).sort();
    if (!keys.length) return;
    var data = [hist.t].concat(keys.map(function (k) { return hist.links[k]; }));
    if (keys.join("|") !== bytesKeys) {
      if (bytesChart) bytesChart.destroy();
      bytesChart = chart($("bytes-chart"), "bytes/s", keys.map(function (k, i) {
        return {label: k, stroke: PALETTE[i % PALETTE.length], width: 1.5};
      }), data);
      bytesKeys = keys.join("|");
    } else {
      bytesChart.setData(data);
    }
  }

  function everyNode(s) {
    var out = [{node: "scheduler", sys: s.scheduler ? s.scheduler.sys : null,
                log: s.scheduler ? s.scheduler.log : []}];
    return out.concat(s.nodes);
  }

  function renderMachines(s) {
    fill($("machines").tBodies[0], everyNode(s).map(function (n) {
      var tr = document.createElement("tr");
      tr.dataset.node = n.node;
      var sys = n.sys || {};
      cell(tr, n.node);
      cell(tr, sys.cpu === undefined ? "-" : sys.cpu.toFixed(1), "num cpu");
      cell(tr, sys.rss === undefined ? "-" : T.human(sys.rss), "num rss");
      var g = sys.gpu ? sys.gpu.map(function (x, i) {
        return "gpu" + i + " " + x[0] + "% " + T.human(x[1]) + " of " + T.human(x[2]);
      }).join("; ") : (sys.nogpu ? "none: " + sys.nogpu : "-");
      cell(tr, g, "gpu");
      tr.dataset.cpu = sys.cpu === undefined ? "" : String(sys.cpu);
      tr.dataset.rss = sys.rss === undefined ? "" : String(sys.rss);
      return tr;
    }));
  }

  function renderLogs(s) {
    var box = $("logs"), open = {};
    box.querySelectorAll("details").forEach(function (d) { open[d.dataset.node] = d.open; });
    var nodes = everyNode(s).filter(function (n) { return n.log && n.log.length; });
    if (!nodes.length) return;
    box.className = "";
    box.textContent = "";
    nodes.forEach(function (n) {
      var d = document.createElement("details");
      d.dataset.node = n.node;
      d.open = n.node in open ? open[n.node] : true;
      var sm = document.createElement("summary");
      sm.textContent = n.node + " (" + n.log.length + " lines)";
      var pre = document.createElement("pre");
      pre.textContent = n.log.join("\n");
      d.appendChild(sm);
      d.appendChild(pre);
      box.appendChild(d);
    });
  }

  function renderValues(s) {
    var names = [], steps = {};
    s.workers.forEach(function (w) {
      Object.keys(w.metrics || {}).forEach(function (k) {
        var key = "worker" + w.rank + " " + k;
        names.push([key, w.metrics[k]]);
        w.metrics[k].forEach(function (p) { steps[p[0]] = true; });
      });
    });
    var el = $("values-chart");
    document.body.dataset.values = String(names.length);
    if (!names.length) return;
    var xs = Object.keys(steps).map(Number).sort(function (a, b) { return a - b; });
    var data = [xs].concat(names.map(function (n) {
      var at = {};
      n[1].forEach(function (p) { at[p[0]] = p[1]; });
      return xs.map(function (x) { return x in at ? at[x] : null; });
    }));
    var keys = names.map(function (n) { return n[0]; }).join("|");
    if (keys !== valuesKeys) {
      if (valuesChart) valuesChart.destroy();
      var width = Math.max(300, el.clientWidth || 400);
      el.textContent = "";
      valuesChart = new uPlot({
        width: width, height: 180, legend: {show: true, live: false},
        scales: {x: {time: false}}, axes: [{label: "step"}, {size: 60}],
        series: [{label: "step"}].concat(names.map(function (n, i) {
          return {label: n[0], stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true};
        })),
      }, data, el);
      valuesKeys = keys;
    } else {
      valuesChart.setData(data);
    }
  }

  function render(s) {
    $("job").textContent = s.job ? "job " + s.job : "";
    $("rounds").textContent = String(s.rounds);
    document.body.dataset.rounds = String(s.rounds);
    document.body.dataset.uptime = String(s.uptime);
    var alive = s.nodes.filter(function (n) { return n.state === "alive" || n.state === "rejoined" || n.state === "finished"; }).length;
    $("alive").textContent = alive + " / " + (s.expected.server + s.expected.worker);
    $("finished").textContent = s.finished + " / " + s.expected.worker;
    $("uptime").textContent = s.uptime.toFixed(1);
    $("refused").textContent = String(s.refused);

    fill($("nodes").tBodies[0], s.nodes.map(function (n) {
      var tr = document.createElement("tr");
      tr.dataset.node = n.node;
      tr.dataset.state = n.state;
      cell(tr, n.node);
      var st = document.createElement("span");
      st.className = "state state-" + n.state.split(" ")[0];
      st.textContent = n.state;
      cell(tr, "").appendChild(st);
      cell(tr, n.detail);
      return tr;
    }));

    var steps = s.esync && s.esync.round > 0 ? s.esync.steps : null;
    fill($("workers").tBodies[0], s.workers.map(function (w) {
      var tr = document.createElement("tr");
      tr.dataset.rank = String(w.rank);
      cell(tr, "worker" + w.rank);
      cell(tr, String(w.rounds), "num rounds");
      cell(tr, w.round_s === null ? "-" : (1000 * w.round_s).toFixed(2), "num");
      cell(tr, fmt(w.push_ms, 3), "num");
      cell(tr, fmt(w.pull_ms, 3), "num");
      cell(tr, steps && w.rank < steps.length ? String(steps[w.rank]) : "-", "num");
      var vals = Object.keys(w.metrics || {}).map(function (k) {
        var v = w.metrics[k];
        return k + " " + Number(v[v.length - 1][1]).toPrecision(4);
      });
      cell(tr, vals.length ? vals.join(", ") : "-", "values");
      return tr;
    }));

    fill($("servers").tBodies[0], (s.servers || []).map(function (v) {
      var tr = document.createElement("tr");
      tr.dataset.rank = String(v.rank);
      cell(tr, "server" + v.rank);
      cell(tr, String(v.rounds), "num rounds");
      cell(tr, v.opt_s.toFixed(3), "num");
      cell(tr, T.human(v.bytes_out), "num");
      cell(tr, T.human(v.bytes_in), "num");
      cell(tr, String(v.replicas), "num");
      return tr;
    }));

    // the link matrix: workers by servers
    var servers = s.expected.server;
    var thead = $("links").tHead;
    thead.textContent = "";
    var hr = document.createElement("tr");
    var th = document.createElement("th"); th.textContent = ""; hr.appendChild(th);
    for (var j = 0; j < servers; j++) {
      th = document.createElement("th"); th.textContent = "server" + j; hr.appendChild(th);
    }
    thead.appendChild(hr);
    var rows = [];
    s.workers.forEach(function (w) {
      var tr = document.createElement("tr");
      cell(tr, "worker" + w.rank);
      var lastRound = w.timeline.length ? w.timeline[w.timeline.length - 1] : null;
      for (var j = 0; j < servers; j++) {
        var rate = w.rates ? w.rates.filter(function (r) { return r[0] === j; })[0] : null;
        var tot = w.links.filter(function (r) { return r[0] === j; })[0];
        var lr = lastRound ? lastRound.links.filter(function (r) { return r[0] === j; })[0] : null;
        var text = rate ? "\u2191" + T.human(rate[1]) + "/s \u2193" + T.human(rate[2]) + "/s"
                        : (w.rates ? "-" : "no data");
        if (tot) text += " (" + T.human(tot[1]) + ", " + T.human(tot[2]) + ")";
        if (lr) text += "; last round \u2191" + T.human(lr[1]) + " \u2193" + T.human(lr[2]);
        var td = cell(tr, text, w.rates ? "" : "nodata");
        td.dataset.link = "worker" + w.rank + "-server" + j;
        td.dataset.rate = rate ? String(rate[1] + rate[2]) : (w.rates ? "" : "none");
      }
      rows.push(tr);
    });
    fill($("links").tBodies[0], rows);

    var plan = $("plan");
    if (s.plan) {
      plan.className = "";
      plan.textContent = "";
      var p = document.createElement("div");
      p.textContent = "plan " + s.plan.epoch + " in force; share of the elements per server:";
      plan.appendChild(p);
      s.plan.shares.forEach(function (share, i) {
        var d = document.createElement("div");
        var b = document.createElement("span");
        b.className = "bar";
        b.style.width = Math.round(200 * share) + "px";
        d.textContent = "server" + i + " " + (100 * share).toFixed(1) + "% ";
        d.appendChild(b);
        plan.appendChild(d);
      });
    }
    var es = $("esync");
    if (s.esync && s.esync.round > 0) {
      es.className = "";
      es.textContent = "round " + s.esync.round + "; local steps this round: " +
        s.esync.steps.map(function (n, i) { return "worker" + i + " " + n; }).join(", ") +
        "; all rounds: " + s.esync.total.map(function (n, i) { return "worker" + i + " " + n; }).join(", ");
    }

    var ev = $("events");
    if (s.events.length) {
      fill(ev, s.events.slice().reverse().map(function (e) {
        var li = document.createElement("li");
        li.className = e.kind;
        li.textContent = "at " + e.uptime.toFixed(1) + " s: " + e.text;
        return li;
      }));
    }

    renderMachines(s);
    renderLogs(s);
    renderValues(s);

    var drawn = T.draw($("timeline"), s.workers, {
      rounds: parseInt($("keep").value, 10),
      empty: "no rounds yet: a round is drawn once it has ended",
    });
    document.body.dataset.timelineRounds = drawn ? String(drawn.rounds) : "0";
  }

  function poll() {
    fetch("/api/state", {cache: "no-store"}).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.json();
    }).then(function (s) {
      polls++;
      state = s;
      render(s);
      updateCharts(s);
      last = s;
      document.body.dataset.polls = String(polls);
      var st = $("status");
      if (s.ended && s.outcome) {
        st.className = s.outcome.ok ? "ok" : "failed";
        st.textContent = "the job ended: " + s.outcome.text;
        document.body.dataset.ended = s.outcome.ok ? "ok" : "failed";
        return;  // nothing more will change: polling stops
      }
      st.className = "";
      st.textContent = "live: " + s.workers.length + " of " + s.expected.worker +
        " workers reporting; updated " + new Date(s.now * 1000).toLocaleTimeString();
      setTimeout(poll, interval);
    }).catch(function () {
      errors++;
      document.body.dataset.errors = String(errors);
      var st = $("status");
      st.className = "ended";
      st.textContent = last ? "the endpoint stopped answering before it said how the job ended: the last values stay shown"
                            : "cannot reach the job's endpoint";
      setTimeout(poll, interval);
    });
  }

  T.legend($("legend"));
  $("keep").addEventListener("change", function () { if (state) render(state); });
  poll();
})();

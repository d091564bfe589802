/* hetps report: draws the data embedded in the file (no network). */
(function () {
  "use strict";
  var T = window.hetpsTimeline;
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"];
  function $(id) { return document.getElementById(id); }
  function row(tbody, cells, numFrom) {
    var tr = document.createElement("tr");
    cells.forEach(function (c, i) {
      var td = document.createElement(i === 0 && numFrom ? "th" : "td");
      td.textContent = c === null || c === undefined ? "-" : String(c);
      if (numFrom && i >= numFrom) td.className = "num";
      tr.appendChild(td);
    });
    tbody.appendChild(tr);
    return tr;
  }
  function fmt(v, d) { return typeof v === "number" ? v.toFixed(d) : "-"; }

  // cards
  var s = data.summary;
  var cards = [
    [data.workers.length, "workers"],
    [s.iterations, "rounds (rank 0)"],
    [fmt(s.wall_time_s, 1), "wall time (s)"],
    [fmt(s.throughput_samples_per_s, 0), "samples/s"],
    [s.asrit_s ? fmt(1000 * s.asrit_s, 2) : "-", "mean round (ms)"],
    [data.failures.length, "failures"],
  ];
  cards.forEach(function (c) {
    var d = document.createElement("div");
    d.className = "card";
    var b = document.createElement("b"); b.textContent = String(c[0]);
    var sp = document.createElement("span"); sp.textContent = c[1];
    d.appendChild(b); d.appendChild(sp);
    $("cards").appendChild(d);
  });
  document.body.dataset.rounds = String(s.iterations);

  // the timeline
  T.legend($("legend"));
  var total = data.workers.reduce(function (m, w) { return Math.max(m, w.timeline.length); }, 0);
  function drawTimeline() {
    var keep = parseInt($("keep").value, 10);
    var from = parseInt($("from").value, 10);
    var ws = data.workers.map(function (w) {
      var tl = w.timeline;
      var i0 = 0;
      if (from > 0) {
        i0 = tl.findIndex(function (r) { return r.round >= from; });
        if (i0 < 0) i0 = Math.max(0, tl.length - keep);
      } else {
        i0 = Math.max(0, tl.length - keep);
      }
      return {rank: w.rank, timeline: tl.slice(i0, i0 + keep)};
    });
    var drawn = T.draw($("timeline"), ws, {rounds: keep, empty: "no phase spans in this run's logs"});
    document.body.dataset.timelineRounds = drawn ? String(drawn.rounds) : "0";
  }
  $("keep").addEventListener("change", drawTimeline);
  $("from").addEventListener("change", drawTimeline);
  drawTimeline();

  // charts: one x per worker's own points, joined on the round number
  function chart(el, label, col, scale) {
    var xs = {};
    data.workers.forEach(function (w) { w.series.forEach(function (p) { if (p[0] !== null) xs[p[0]] = true; }); });
    var x = Object.keys(xs).map(Number).sort(function (a, b) { return a - b; });
    if (!x.length) { el.textContent = "no data"; return null; }
    var pos = {};
    x.forEach(function (v, i) { pos[v] = i; });
    var ys = data.workers.map(function (w) {
      var y = x.map(function () { return null; });
      w.series.forEach(function (p) {
        var v = p[col];
        if (p[0] !== null && v !== null && v !== undefined) y[pos[p[0]]] = v * (scale || 1);
      });
      return y;
    });
    if (!ys.some(function (y) { return y.some(function (v) { return v !== null; }); })) {
      el.textContent = "not logged in this run";
      return null;
    }
    var series = [{label: "round"}].concat(data.workers.map(function (w, i) {
      return {label: label + " " + w.label, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true};
    }));
    return new uPlot({width: Math.max(320, el.clientWidth || 420), height: 200,
                      scales: {x: {time: false}}, legend: {live: false},
                      axes: [{label: "round"}, {size: 70, values: function (u, vals) {
                        return vals.map(function (v) { return col === 4 ? T.human(v) : String(v); });
                      }}], series: series},
                     [x].concat(ys), el);
  }
  chart($("round-chart"), "round ms", 2, 1000);
  chart($("loss-chart"), "loss", 3);
  chart($("bytes-chart"), "bytes sent", 4);

  var tb = $("phases").tBodies[0];
  data.workers.forEach(function (w) {
    var p = w.phase_ms;
    row(tb, [w.label, w.rounds, fmt(p.compute, 3), fmt(p.push, 3), fmt(p.wait, 3), fmt(p.pull, 3)], 1);
  });

  var sb = $("summary").tBodies[0];
  ["mode", "network", "workers", "servers", "batch_size", "iterations", "wall_time_s",
   "throughput_samples_per_s", "asrit_s", "final_accuracy", "ended", "heterogeneity_note"].forEach(function (k) {
    var v = s[k];
    if (typeof v === "number" && !Number.isInteger(v)) v = v.toPrecision(5);
    row(sb, [k, v]);
  });
  var tm = s.traffic_mb_per_s || {};
  row(sb, ["traffic MB/s (push, pull)", fmt(tm.push, 3) + ", " + fmt(tm.pull, 3)]);
  var cr = s.computing_time_ratio || {};
  row(sb, ["computing-time ratio", Object.keys(cr).map(function (k) { return k + " " + cr[k].toFixed(3); }).join(", ")]);

  var cb = $("config").tBodies[0];
  Object.keys(data.config).sort().forEach(function (k) {
    var v = data.config[k];
    row(cb, [k, typeof v === "object" && v !== null ? JSON.stringify(v) : v]);
  });

  var fl = $("failures");
  if (!data.failures.length) {
    var li = document.createElement("li"); li.textContent = "none: the run completed"; fl.appendChild(li);
  }
  data.failures.forEach(function (f) {
    var li = document.createElement("li"); li.className = "failure"; li.textContent = f; fl.appendChild(li);
  });
  if (data.live && data.live.nodes) {
    var t = document.createElement("table");
    var b = document.createElement("tbody");
    row(b, ["node", "state at the end", "detail"]);
    data.live.nodes.forEach(function (n) { row(b, [n.node, n.state, n.detail]); });
    t.appendChild(b);
    $("live-nodes").appendChild(t);
  }

  if (data.figures.length) {
    var fg = $("figures");
    fg.textContent = "";
    fg.className = "";
    data.figures.forEach(function (f) {
      var h = document.createElement("h3"); h.textContent = f.name; fg.appendChild(h);
      if (f.data) {
        var img = document.createElement("img");
        img.src = "data:image/png;base64," + f.data;
        img.style.maxWidth = "100%";
        img.alt = f.name;
        fg.appendChild(img);
      } else {
        var p = document.createElement("p"); p.textContent = "not embedded (" + f.size + " bytes)"; fg.appendChild(p);
      }
    });
  }
  document.body.dataset.ready = "1";
})();

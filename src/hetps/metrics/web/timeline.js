/* hetps: a timeline of the last rounds of every worker, drawn on a canvas.
   Shared by the live dashboard and the report (hetps report). One row per worker; each round's
   phase spans (compute, push, wait, pull) at the times they ran, the round's number where it
   starts, and the bytes it sent and received over its links under the row. */
(function (global) {
  "use strict";
  var COLORS = {compute: "#4c72b0", push: "#dd8452", wait: "#b8b8b8", pull: "#55a868"};
  var OTHER = "#8172b3";

  function human(bytes) {
    var u = ["B", "KB", "MB", "GB", "TB"], i = 0, v = bytes;
    while (v >= 1000 && i < u.length - 1) { v /= 1000; i++; }
    return (i === 0 ? String(Math.round(v)) : v.toFixed(v < 10 ? 2 : 1)) + " " + u[i];
  }

  function timeText(s) {
    var a = Math.abs(s);
    if (a === 0) return "0";
    if (a < 1e-3) return (s * 1e6).toFixed(0) + " \u00b5s";
    if (a < 1) return (s * 1e3).toFixed(a < 0.01 ? 1 : 0) + " ms";
    return s.toFixed(2) + " s";
  }

  /* workers: [{rank, timeline: [{round, spans: [[phase, start, seconds]], links: [[server,
     sent, received]]}]}]; opts.rounds: how many of each worker's last rounds to show. Returns
     {start, end, rounds} of what was drawn (null when there was nothing). */
  function drawTimeline(canvas, workers, opts) {
    opts = opts || {};
    var keep = opts.rounds || 6;
    var dpr = global.devicePixelRatio || 1;
    var width = canvas.clientWidth || 900;
    var rowH = 34, byteH = 16, top = 22, left = 78, right = 12, axisH = 24;
    var rows = workers.filter(function (w) { return w.timeline && w.timeline.length; });
    var height = top + Math.max(1, rows.length) * (rowH + byteH) + axisH;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.height = height + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "12px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    if (!rows.length) {
      ctx.fillStyle = "#666";
      ctx.fillText(opts.empty || "no phase spans yet", left, top + rowH / 2);
      return null;
    }
    // the window: it ends where every worker's spans are known (the earliest of the workers'
    // last span ends: reports arrive at different times) and starts at the latest of the
    // workers' starts of their last `keep` rounds before that, so that every row is full
    function first(r) { return Math.min.apply(null, r.spans.map(function (s) { return s[1]; })); }
    function last(r) { return Math.max.apply(null, r.spans.map(function (s) { return s[1] + s[2]; })); }
    var end = Infinity, start = -Infinity, shown = 0;
    rows.forEach(function (w) {
      var done = w.timeline.filter(function (r) { return r.spans.length; });
      if (done.length) end = Math.min(end, last(done[done.length - 1]));
    });
    rows.forEach(function (w) {
      var before = w.timeline.filter(function (r) { return r.spans.length && first(r) < end; });
      if (before.length) start = Math.max(start, first(before.slice(-keep)[0]));
    });
    if (!isFinite(start) || !isFinite(end) || end <= start) return null;
    var span = Math.max(end - start, 1e-6);
    var plotW = width - left - right;
    function x(t) { return left + (t - start) / span * plotW; }
    // axis: times since the first span shown
    ctx.strokeStyle = "#ddd";
    ctx.fillStyle = "#555";
    var axisY = height - axisH + 4;
    var ticks = 6;
    ctx.textAlign = "center";
    for (var k = 0; k <= ticks; k++) {
      var tx = left + k / ticks * plotW;
      ctx.beginPath(); ctx.moveTo(tx, top - 4); ctx.lineTo(tx, axisY); ctx.stroke();
      ctx.fillText(timeText(k / ticks * span), tx, axisY + 10);
    }
    rows.forEach(function (w, i) {
      var y = top + i * (rowH + byteH);
      ctx.textAlign = "left";
      ctx.fillStyle = "#222";
      ctx.fillText("worker " + w.rank, 6, y + rowH / 2);
      var rounds = w.timeline.filter(function (r) {
        return r.spans.length && last(r) > start && first(r) < end;
      });
      ctx.save();
      ctx.beginPath(); ctx.rect(left, 0, plotW + 1, height); ctx.clip();
      rounds.forEach(function (r, j) {
        var r0 = Infinity, sent = 0, recv = 0;
        r.spans.forEach(function (s) {
          r0 = Math.min(r0, s[1]);
          var x0 = x(Math.max(s[1], start)), x1 = x(Math.min(s[1] + s[2], end));
          if (x1 <= x0 && s[2] > 0 && (s[1] >= end || s[1] + s[2] <= start)) return;
          ctx.fillStyle = COLORS[s[0]] || OTHER;
          ctx.fillRect(x0, y + 4, Math.max(1, x1 - x0), rowH - 8);
        });
        shown++;
        (r.links || []).forEach(function (l) { sent += l[1]; recv += l[2]; });
        if (r0 < start) return;
        var next = j + 1 < rounds.length ? first(rounds[j + 1]) : end;
        var room = x(next) - x(r0) - 4;
        ctx.strokeStyle = "#333";
        ctx.beginPath(); ctx.moveTo(x(r0), y); ctx.lineTo(x(r0), y + rowH + byteH - 2); ctx.stroke();
        ctx.fillStyle = "#333";
        ctx.textAlign = "left";
        ctx.font = "10px system-ui, sans-serif";
        ctx.fillText("r" + r.round, x(r0) + 2, y + 1);
        ctx.fillStyle = "#555";
        var bytes = "\u2191" + human(sent) + " \u2193" + human(recv);
        if (ctx.measureText(bytes).width > room) bytes = "\u2191" + human(sent);
        if (ctx.measureText(bytes).width <= room) ctx.fillText(bytes, x(r0) + 2, y + rowH + byteH / 2 - 2);
        ctx.font = "12px system-ui, sans-serif";
      });
      ctx.restore();
    });
    return {start: start, end: end, rounds: shown};
  }

  function legend(el) {
    el.textContent = "";
    Object.keys(COLORS).forEach(function (name) {
      var item = document.createElement("span");
      item.className = "key";
      var sw = document.createElement("i");
      sw.style.background = COLORS[name];
      item.appendChild(sw);
      item.appendChild(document.createTextNode(name));
      el.appendChild(item);
    });
  }

  global.hetpsTimeline = {draw: drawTimeline, legend: legend, human: human, timeText: timeText,
                          colors: COLORS};
})(window);

// report.html's timeline, on a canvas: a row per traced rank (each row names its rank, r) with bands for regions, compute and communication
// over a background that marks idle time. Each pixel column is painted by the time the spans cover in it,
// so 8 ranks of 100 steps draw as fast as 8 spans and dense short kernels do not read as solid work. Wheel
// zooms about the pointer, dragging pans, double-click resets. Reads #timeline-data (timeline_json in
// html_report.cc). A pipeline's forward and backward tasks, when the report has them, are a band of
// their own at the top of each row, named by micro-batch where there is room.
(function () {
  var D = JSON.parse(document.getElementById('timeline-data').textContent);
  var box = document.getElementById('timeline');
  var canvas = box.querySelector('canvas');
  var tip = document.getElementById('tip');
  var ctx = null;
  var colour = {};
  ['compute', 'comm', 'wait', 'idle', 'region', 'forward', 'backward'].forEach(function (k) { colour[k] = ranklab.colour(k); });
  var fill = { c: colour.compute, m: colour.comm, w: colour.wait, g: colour.region, f: colour.forward, b: colour.backward };
  var LABEL = 66, AXIS = 24, RIGHT = 8;
  var n = D.rows.length;
  var hasRegions = D.rows.some(function (r) { return r.g.length > 0; });
  // A pipeline's tasks get a band of their own, tall enough to name them where there is room.
  var hasTasks = D.rows.some(function (r) { return r.f.length + r.b.length > 0; });
  var rowH = n <= 16 ? (hasTasks ? 42 : 30) : n <= 64 ? 14 : n <= 256 ? 6 : 3;
  var end = D.end > 0 ? D.end : 1;
  D.rows.forEach(function (r) {
    ['c', 'm', 'w', 'i', 'g', 'f', 'b'].forEach(function (k) {
      var a = r[k], pm = new Float64Array(a.length / 3), best = -Infinity;
      for (var j = 0; j < pm.length; j++) { best = Math.max(best, a[3 * j + 1]); pm[j] = best; end = Math.max(end, best); }
      r[k + 'max'] = pm;  // running maximum of the ends, to find the first span a view can show
    });
  });
  var t0 = 0, t1 = end, width = 0;

  function bands(y) {
    // [key, top, height] of each band of a row starting at y.
    var h = rowH - 2, out = [];
    if (rowH < 10) return [['c', y, h / 2], ['m', y + h / 2, h / 2], ['w', y + h / 2, h / 2]];
    var p = hasTasks ? Math.max(4, Math.round(h * 0.36)) : 0;
    if (hasTasks) out.push(['f', y, p - 1], ['b', y, p - 1]);
    y += p; h -= p;
    var g = hasRegions ? Math.max(3, Math.round(h * 0.18)) : 0;
    var half = (h - g) / 2;
    if (hasRegions) out.push(['g', y, g - 1]);
    out.push(['c', y + g, half], ['m', y + g + half, half], ['w', y + g + half, half]);
    return out;
  }
  function px(t) { return LABEL + (t - t0) / (t1 - t0) * (width - LABEL - RIGHT); }
  function firstVisible(pm) {
    var lo = 0, hi = pm.length;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (pm[mid] < t0) lo = mid + 1; else hi = mid; }
    return lo;
  }
  // Each pixel column is painted in proportion to the time the band's spans cover in it (its coverage as
  // opacity): a column of dense 1-px kernels on an idle background reads as mostly idle, as it is, not as
  // solid compute. Fully covered runs of columns are one rectangle.
  function drawBand(a, pm, y, h, fill) {
    ctx.fillStyle = fill;
    var left = LABEL, right = width - RIGHT, cols = Math.max(1, Math.ceil(right - left));
    var cov = new Float32Array(cols), any = false;
    for (var j = firstVisible(pm); j < pm.length; j++) {
      var s = a[3 * j], e = a[3 * j + 1];
      if (s > t1) break;
      if (e < t0) continue;
      var x0 = Math.max(0, px(s) - left), x1 = Math.min(cols, px(e) - left);
      if (x1 <= x0) continue;
      any = true;
      var c0 = Math.floor(x0), c1 = Math.floor(x1);
      if (c0 === c1) { cov[c0] += x1 - x0; continue; }
      cov[c0] += c0 + 1 - x0;
      for (var c = c0 + 1; c < c1 && c < cols; c++) cov[c] += 1;
      if (c1 < cols) cov[c1] += x1 - c1;
    }
    if (!any) return;
    var run = -1;
    for (var c = 0; c <= cols; c++) {
      var v = c < cols ? Math.min(1, cov[c]) : 0;
      if (v >= 0.999) { if (run < 0) run = c; continue; }
      if (run >= 0) { ctx.fillRect(left + run, y, c - run, h); run = -1; }
      if (v > 0.02) {
        ctx.globalAlpha = v;
        ctx.fillRect(left + c, y, 1, h);
        ctx.globalAlpha = 1;
      }
    }
  }
  // Names each pipeline task whose box is wide enough for its label ("F3": the forward of micro-batch 3).
  function nameTasks(a, labels, y, h) {
    if (h < 11) return;
    ctx.fillStyle = '#fff';
    ctx.textAlign = 'center';
    for (var j = 0; j < labels.length; j++) {
      var x0 = Math.max(LABEL, px(a[3 * j])), x1 = Math.min(width - RIGHT, px(a[3 * j + 1]));
      var text = D.names[labels[j]];
      if (x1 - x0 >= ctx.measureText(text).width + 4) ctx.fillText(text, (x0 + x1) / 2, y + h / 2 + 0.5);
    }
  }
  function niceStep(span, pixels) {
    var raw = span / Math.max(1, pixels / 110), p = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
  }
  function fmtTime(us, step) {
    var unit = step >= 1e5 ? [1e6, ' s'] : step >= 100 ? [1e3, ' ms'] : [1, ' us'];
    var v = us / unit[0], d = Math.max(0, Math.min(6, -Math.floor(Math.log10(step / unit[0]) + 1e-9)));
    return v.toFixed(d) + unit[1];
  }
  function draw() {
    width = box.clientWidth || 1000;
    var height = AXIS + n * rowH + 4;
    ctx = ranklab.canvas(canvas, width, height);
    ctx.textBaseline = 'middle';
    var step = niceStep(t1 - t0, width - LABEL - RIGHT);
    ctx.strokeStyle = '#e4e7eb';
    ctx.fillStyle = '#5d6875';
    ctx.textAlign = 'center';
    for (var t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
      var x = Math.round(px(t)) + 0.5;
      ctx.beginPath(); ctx.moveTo(x, AXIS - 4); ctx.lineTo(x, height); ctx.stroke();
      var text = fmtTime(t, step), half = ctx.measureText(text).width / 2;
      ctx.fillText(text, Math.min(Math.max(x, LABEL + half), width - RIGHT - half), AXIS / 2);
    }
    var every = Math.max(1, Math.ceil(12 / rowH));
    for (var r = 0; r < n; r++) {
      var y = AXIS + r * rowH, row = D.rows[r];
      ctx.textAlign = 'right';
      ctx.fillStyle = '#1d232b';
      if (r % every === 0) ctx.fillText('rank ' + row.r, LABEL - 8, y + rowH / 2);
      drawBand(row.i, row.imax, y, rowH - 2, colour.idle);
      bands(y).forEach(function (b) {
        drawBand(row[b[0]], row[b[0] + 'max'], b[1], b[2], fill[b[0]]);
        if (b[0] === 'f' || b[0] === 'b') nameTasks(row[b[0]], row[b[0] + 'l'], b[1], b[2]);
      });
    }
    box.setAttribute('data-rows', String(n));
    box.setAttribute('data-view', t0.toFixed(3) + ' ' + t1.toFixed(3));
  }
  function timeAt(x) { return t0 + (x - LABEL) / (width - LABEL - RIGHT) * (t1 - t0); }
  function zoom(factor, x) {
    var t = timeAt(x), span = Math.min(end * 1.05, Math.max(1e-3, (t1 - t0) * factor));
    var f = (x - LABEL) / (width - LABEL - RIGHT);
    t0 = Math.max(-end * 0.025, t - f * span); t1 = t0 + span;
    draw();
  }
  function findSpan(a, pm, t) {
    // The last span starting at or before t that still covers it; overlapping spans are rare and short.
    var lo = 0, hi = pm.length;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (a[3 * mid] <= t) lo = mid + 1; else hi = mid; }
    for (var j = lo - 1; j >= 0 && pm[j] >= t; j--) if (a[3 * j + 1] >= t) return j;
    return -1;
  }
  var drag = null;
  canvas.addEventListener('wheel', function (e) {
    e.preventDefault();
    zoom(Math.exp(e.deltaY * 0.0015), e.offsetX);
  }, { passive: false });
  canvas.addEventListener('mousedown', function (e) { drag = { x: e.clientX, t0: t0, t1: t1 }; canvas.style.cursor = 'grabbing'; });
  window.addEventListener('mouseup', function () { drag = null; canvas.style.cursor = 'grab'; });
  canvas.addEventListener('dblclick', function () { t0 = 0; t1 = end; draw(); });
  canvas.addEventListener('mouseleave', function () { ranklab.tip(tip); });
  window.addEventListener('mousemove', function (e) {
    if (!drag) return;
    var dt = (e.clientX - drag.x) / (width - LABEL - RIGHT) * (drag.t1 - drag.t0);
    t0 = drag.t0 - dt; t1 = drag.t1 - dt;
    draw();
  });
  canvas.addEventListener('mousemove', function (e) {
    if (drag) return;
    var r = Math.floor((e.offsetY - AXIS) / rowH);
    if (r < 0 || r >= n || e.offsetX < LABEL) { ranklab.tip(tip); return; }
    var t = timeAt(e.offsetX), row = D.rows[r], hit = null;
    bands(AXIS + r * rowH).concat([['i', AXIS + r * rowH, rowH]]).some(function (b) {
      if (e.offsetY < b[1] || e.offsetY > b[1] + b[2] + 1) return false;
      var j = findSpan(row[b[0]], row[b[0] + 'max'], t);
      if (j < 0) return false;
      hit = [b[0], row[b[0]], j];
      return true;
    });
    if (!hit) { ranklab.tip(tip); return; }
    var a = hit[1], j = hit[2], kind = { c: 'compute', m: 'comm', w: 'waiting for peers', i: 'idle', g: 'region', f: 'pipeline task', b: 'pipeline task' }[hit[0]];
    var s = a[3 * j], d = a[3 * j + 1] - s;
    ranklab.tip(tip, 'rank ' + row.r + ' \u00b7 ' + kind + '\n' + D.names[a[3 * j + 2]] + '\nstart ' + fmtTime(s, 1e-3) +
        ', ' + fmtTime(d, Math.max(1e-3, d / 1000)), e.offsetX, e.offsetY, width - 240);
  });
  window.addEventListener('resize', draw);
  draw();
  document.body.setAttribute('data-rendered', '1');
})();

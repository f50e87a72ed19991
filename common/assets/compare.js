// compare.html's plot of B's time against A's, log-log, one point per item, on a canvas: the diagonal is
// agreement, and the dashed lines are 10% and 2x off it. Hovering a point names it. Reads #compare-data
// (comparison_to_html in compare.cc).
(function () {
  var D = JSON.parse(document.getElementById('compare-data').textContent);
  var box = document.getElementById('plot');
  var canvas = box.querySelector('canvas');
  var tip = document.getElementById('tip');
  var ctx = null;
  var colours = [ranklab.colour('compute'), ranklab.colour('comm')];
  var pts = D.points.filter(function (p) { return p[0] > 0 && p[1] > 0; });
  var lo = Infinity, hi = -Infinity;
  pts.forEach(function (p) { lo = Math.min(lo, p[0], p[1]); hi = Math.max(hi, p[0], p[1]); });
  if (!isFinite(lo)) { lo = 1; hi = 10; }
  var l0 = Math.floor(Math.log10(lo) * 4) / 4 - 0.1, l1 = Math.ceil(Math.log10(hi) * 4) / 4 + 0.1;
  var M = 72, size = 0;
  function sx(v) { return M + (Math.log10(v) - l0) / (l1 - l0) * (size - M - 16); }
  function sy(v) { return size - M - (Math.log10(v) - l0) / (l1 - l0) * (size - M - 16); }
  function label(us) {
    return us >= 1e6 ? (us / 1e6) + ' s' : us >= 1e3 ? (us / 1e3) + ' ms' : us >= 1 ? us + ' us' : (us * 1e3) + ' ns';
  }
  function line(k, dash) {
    ctx.setLineDash(dash);
    ctx.beginPath();
    ctx.moveTo(sx(Math.pow(10, l0)), sy(Math.pow(10, l0) * k));
    ctx.lineTo(sx(Math.pow(10, l1)), sy(Math.pow(10, l1) * k));
    ctx.stroke();
    ctx.setLineDash([]);
  }
  function draw() {
    size = Math.min(640, Math.max(320, box.clientWidth || 640));
    ctx = ranklab.canvas(canvas, size, size);
    ctx.strokeStyle = '#e4e7eb'; ctx.fillStyle = '#5d6875';
    for (var e = Math.ceil(l0); e <= Math.floor(l1); e++) {
      var v = Math.pow(10, e);
      ctx.beginPath(); ctx.moveTo(sx(v), 16); ctx.lineTo(sx(v), size - M); ctx.stroke();
      ctx.beginPath(); ctx.moveTo(M, sy(v)); ctx.lineTo(size - 16, sy(v)); ctx.stroke();
      ctx.textAlign = 'center'; ctx.fillText(label(v), sx(v), size - M + 14);
      ctx.textAlign = 'right'; ctx.fillText(label(v), M - 6, sy(v) + 4);
    }
    ctx.textAlign = 'center';
    ctx.fillText('A: ' + D.a, M + (size - M) / 2, size - 12);
    ctx.save(); ctx.translate(12, (size - M) / 2); ctx.rotate(-Math.PI / 2); ctx.fillText('B: ' + D.b, 0, 0); ctx.restore();
    ctx.save();
    ctx.beginPath(); ctx.rect(M, 16, size - M - 16, size - M - 16); ctx.clip();
    ctx.strokeStyle = '#1d232b'; line(1, []);
    ctx.strokeStyle = '#9aa5b1'; line(1.1, [5, 4]); line(1 / 1.1, [5, 4]); line(2, [2, 4]); line(0.5, [2, 4]);
    ctx.globalAlpha = pts.length > 2000 ? 0.35 : 0.75;
    pts.forEach(function (p) {
      ctx.fillStyle = colours[p[2]];
      ctx.beginPath(); ctx.arc(sx(p[0]), sy(p[1]), 3, 0, 2 * Math.PI); ctx.fill();
    });
    ctx.globalAlpha = 1;
    ctx.restore();
    box.setAttribute('data-points', String(pts.length));
  }
  canvas.addEventListener('mousemove', function (e) {
    var best = null, bd = 64;
    pts.forEach(function (p) {
      var dx = sx(p[0]) - e.offsetX, dy = sy(p[1]) - e.offsetY, d = dx * dx + dy * dy;
      if (d < bd) { bd = d; best = p; }
    });
    if (!best) { ranklab.tip(tip); return; }
    ranklab.tip(tip, D.labels[best[3]] + '\nA ' + best[0].toFixed(3) + ' us, B ' + best[1].toFixed(3) +
        ' us, B/A ' + (best[1] / best[0]).toFixed(3), e.offsetX, e.offsetY);
  });
  canvas.addEventListener('mouseleave', function () { ranklab.tip(tip); });
  window.addEventListener('resize', draw);
  draw();
  document.body.setAttribute('data-rendered', '1');
})();

// report.html's heat strip: every rank as one row of cells over the run, each cell the mix of the time the
// rank computed (compute), communicated beyond its compute (comm), waited for late members (wait) and stood
// idle (idle). Reads #strip-data (strip_json in html_report.cc): the bins' width, and per rank three digits
// per bin (ninths of the bin) or, for a mirror of a symmetric run, the rank it mirrors. With more ranks than
// rows the canvas can hold, neighbouring ranks share a row and their cells are averaged.
(function () {
  var D = JSON.parse(document.getElementById('strip-data').textContent);
  var box = document.getElementById('strip');
  var canvas = box.querySelector('canvas');
  var tip = box.querySelector('.tip');
  var n = D.rows.length, LABEL = 66, MAX_ROWS = 512;
  // The bins that hold the run: the last may reach past its end.
  var bins = Math.max(1, Math.min(D.bins, Math.ceil(D.end / D.bin_us)));
  var perRow = Math.max(1, Math.ceil(n / MAX_ROWS)), rows = Math.ceil(n / perRow);
  var rowH = rows <= 64 ? 8 : rows <= 256 ? 3 : 1;
  function rgb(name) {
    var c = ranklab.colour(name), m = /^#?([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(c);
    return m ? [parseInt(m[1], 16), parseInt(m[2], 16), parseInt(m[3], 16)] : [128, 128, 128];
  }
  var colours = [rgb('compute'), rgb('comm'), rgb('wait'), [246, 247, 249]];
  // A rank's row of digits: its own, or its representative's.
  function digits(r) { var row = D.rows[r]; return typeof row === 'number' ? D.rows[row] : row; }
  // Shares of [compute, comm, wait, idle] in bin b, averaged over ranks lo .. hi - 1.
  function shares(lo, hi, b) {
    var s = [0, 0, 0, 0];
    for (var r = lo; r < hi; r++) {
      var d = digits(r);
      if (typeof d !== 'string' || d.length < 3 * D.bins) { s[3] += 1; continue; }
      var c = +d[3 * b] / 9, m = +d[3 * b + 1] / 9, w = +d[3 * b + 2] / 9;
      s[0] += c; s[1] += m; s[2] += w; s[3] += Math.max(0, 1 - c - m - w);
    }
    for (var k = 0; k < 4; k++) s[k] /= (hi - lo);
    return s;
  }
  var width = 0, cell = 1;
  function draw() {
    width = Math.max(200, box.clientWidth || 1000);
    cell = (width - LABEL) / bins;
    var height = rows * rowH;
    var ctx = ranklab.canvas(canvas, width, height + 18);
    for (var row = 0; row < rows; row++) {
      var lo = row * perRow, hi = Math.min(n, lo + perRow);
      for (var b = 0; b < bins; b++) {
        var s = shares(lo, hi, b), c = [0, 0, 0];
        for (var k = 0; k < 4; k++) for (var j = 0; j < 3; j++) c[j] += s[k] * colours[k][j];
        ctx.fillStyle = 'rgb(' + Math.round(c[0]) + ',' + Math.round(c[1]) + ',' + Math.round(c[2]) + ')';
        ctx.fillRect(LABEL + b * cell, row * rowH, Math.ceil(cell), rowH);
      }
    }
    ctx.fillStyle = '#5d6875';
    ctx.textBaseline = 'top';
    ctx.fillText('rank 0', 4, 0);
    ctx.fillText('rank ' + (n - 1), 4, Math.max(12, height - 12));
    ctx.fillText('0', LABEL, height + 4);
    var total = D.bin_us * bins, unit = total >= 1e6 ? [1e6, ' s'] : total >= 1e3 ? [1e3, ' ms'] : [1, ' us'];
    var text = (total / unit[0]).toPrecision(3) + unit[1];
    ctx.textAlign = 'right';
    ctx.fillText(text, width - 2, height + 4);
    box.setAttribute('data-rows', String(rows));
  }
  canvas.addEventListener('mousemove', function (e) {
    var row = Math.floor(e.offsetY / rowH), b = Math.floor((e.offsetX - LABEL) / cell);
    if (row < 0 || row >= rows || b < 0 || b >= bins) { ranklab.tip(tip); return; }
    var lo = row * perRow, hi = Math.min(n, lo + perRow), s = shares(lo, hi, b);
    var who = hi - lo === 1 ? 'rank ' + lo + (typeof D.rows[lo] === 'number' ? ' (mirrors rank ' + D.rows[lo] + ')' : '')
                            : 'ranks ' + lo + '-' + (hi - 1);
    var pct = function (x) { return Math.round(100 * x) + '%'; };
    ranklab.tip(tip, who + '\n' + (b * D.bin_us / 1e3).toFixed(2) + '-' + ((b + 1) * D.bin_us / 1e3).toFixed(2) + ' ms\n' +
        'compute ' + pct(s[0]) + ', communication ' + pct(s[1]) + ', waiting ' + pct(s[2]) + ', idle ' + pct(s[3]),
        e.offsetX, e.offsetY, width - 260);
  });
  canvas.addEventListener('mouseleave', function () { ranklab.tip(tip); });
  window.addEventListener('resize', draw);
  draw();
})();

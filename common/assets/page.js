// Every page's first script: what the others share, and the catcher that lists any script error in
// #errors, where a person sees it and a test can count it (data-count).
window.addEventListener('error', function (e) {
  var list = document.getElementById('errors');
  var item = document.createElement('li');
  item.textContent = 'script error: ' + e.message + ' (line ' + e.lineno + ')';
  list.appendChild(item);
  list.setAttribute('data-count', String(list.children.length));
});

var ranklab = {
  // A colour the stylesheet names: 'compute', 'comm', 'wait', 'idle', 'region'.
  colour: function (name) {
    return getComputedStyle(document.documentElement).getPropertyValue('--' + name).trim();
  },
  // Sizes `canvas` to width x height CSS pixels at the screen's resolution, and returns its context set to
  // draw in CSS pixels, cleared.
  canvas: function (canvas, width, height) {
    var dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.width = width + 'px';
    canvas.style.height = height + 'px';
    var ctx = canvas.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = '11px system-ui, sans-serif';
    return ctx;
  },
  // Shows the tooltip element `tip` with `text` below and right of (x, y), its left edge at most `maxLeft`;
  // ranklab.tip(tip) hides it.
  tip: function (tip, text, x, y, maxLeft) {
    if (text === undefined) { tip.style.display = 'none'; return; }
    tip.textContent = text;
    tip.style.display = 'block';
    tip.style.left = Math.min(x + 14, maxLeft === undefined ? Infinity : maxLeft) + 'px';
    tip.style.top = (y + 14) + 'px';
  }
};

(function () {
  'use strict';
  var data = JSON.parse(document.getElementById('attn-data').textContent);
  var state = { last: 'tired', layer: 2, word: null, step: 0 };
  var $ = function (id) { return document.getElementById(id); };
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function pct(x) { return (100 * x).toFixed(1) + '%'; }

  // --- click a word -------------------------------------------------------------------------
  function renderWords() {
    var s = data.sentences[state.last];
    var row = state.word === null ? null : s.layers[state.layer - 1].weights[state.word];
    var most = -1, j;
    if (row) { most = 0; for (j = 1; j < row.length; j++) if (row[j] > row[most]) most = j; }
    var box = $('sentence');
    box.textContent = '';
    s.words.forEach(function (w, k) {
      var b = el('button', 'word');
      b.type = 'button';
      b.setAttribute('data-index', String(k));
      b.setAttribute('data-word', w);
      b.appendChild(el('span', 'text', w));
      var tag = el('span', 'weight', row ? pct(row[k]) : '');
      b.appendChild(tag);
      if (row) {
        b.setAttribute('data-weight', row[k].toFixed(6));
        b.style.backgroundColor = 'rgba(230, 97, 0, ' + (0.08 + 0.82 * row[k] / row[most]).toFixed(3) + ')';
        if (k === most) { b.classList.add('most-attended'); b.setAttribute('data-most-attended', 'true'); }
        if (k === state.word) b.classList.add('selected');
      }
      b.addEventListener('click', function () { state.word = k; update(); });
      box.appendChild(b);
    });
    box.setAttribute('data-selected', row ? s.words[state.word] : '');
    box.setAttribute('data-last', state.last);
    box.setAttribute('data-layer', String(state.layer));
    box.setAttribute('data-most-attended', row ? s.words[most] : '');

    var bars = $('bars');
    bars.textContent = '';
    if (!row) {
      $('readout').textContent = 'Click a word.';
      return;
    }
    $('readout').textContent = '\u201c' + s.words[state.word] + '\u201d pays the most attention to \u201c' +
        s.words[most] + '\u201d (' + pct(row[most]) + ') in layer ' + state.layer +
        '. Its row of weights sums to ' + row.reduce(function (a, b) { return a + b; }, 0).toFixed(4) + ':';
    s.words.forEach(function (w, k) {
      bars.appendChild(el('span', 'w', w));
      bars.appendChild(el('span', 'num', row[k].toFixed(4)));
      var bar = el('span', 'bar');
      bar.style.width = (100 * row[k]).toFixed(2) + '%';
      bars.appendChild(bar);
    });
  }

  function renderToggles() {
    ['tired', 'wide'].forEach(function (w) {
      $('last-' + w).setAttribute('aria-pressed', String(state.last === w));
    });
    [1, 2].forEach(function (l) {
      $('layer-' + l).setAttribute('aria-pressed', String(state.layer === l));
    });
  }

  // --- the 3-token step-through --------------------------------------------------------------
  var t = data.three_tokens;
  var tokens = ['token 1', 'token 2', 'token 3'];
  function num(x) {
    if (x === null) return '\u2212\u221e';
    var s = x.toFixed(4);
    return s === '-0.0000' ? '0.0000' : s;
  }
  function matrixTable(caption, M, cols, extra) {
    var table = el('table', 'matrix');
    table.appendChild(el('caption', '', caption));
    var head = el('tr');
    head.appendChild(el('th', '', ''));
    cols.forEach(function (c) { head.appendChild(el('th', '', c)); });
    if (extra) head.appendChild(el('th', '', extra.name));
    table.appendChild(head);
    M.forEach(function (r, i) {
      var tr = el('tr');
      tr.appendChild(el('th', '', tokens[i]));
      r.forEach(function (x) { tr.appendChild(el('td', '', num(x))); });
      if (extra) tr.appendChild(el('td', '', num(extra.values[i])));
      table.appendChild(tr);
    });
    return table;
  }
  var keys = ['key 1', 'key 2', 'key 3'];
  var dims = ['[0]', '[1]'];
  var steps = [
    { title: 'Inputs: Q, K, V (d_k = ' + t.d_k + ')',
      text: 'Three tokens with hand-chosen 2-dimensional queries, keys and values (the first document\u2019s table).',
      tables: function () { return [matrixTable('Q', t.Q, dims), matrixTable('K', t.K, dims), matrixTable('V', t.V, dims)]; } },
    { title: 'Raw scores Q K\u1d40',
      text: 'Every query dotted with every key: row = query token, column = key token.',
      tables: function () { return [matrixTable('Q K\u1d40', t.scores, keys)]; } },
    { title: 'Scale by 1/\u221ad_k = ' + num(t.scale),
      text: 'Dividing by \u221a' + t.d_k + ' keeps the scores from growing with the dimension.',
      tables: function () { return [matrixTable('Q K\u1d40 / \u221ad_k', t.scaled, keys)]; } },
    { title: 'Softmax, part 1: subtract the row maximum and exponentiate',
      text: 'The library\u2019s stable softmax: e^(x \u2212 max) can never overflow, and the factor e^\u2212max cancels in the ratio.',
      tables: function () { return [matrixTable('e^(x \u2212 row max)', t.exp, keys, { name: 'row max', values: t.row_max })]; } },
    { title: 'Softmax, part 2: divide by the row sum',
      text: 'Each row now sums to 1: these are the attention weights.',
      tables: function () { return [matrixTable('weights', t.weights, keys, { name: 'row sum of e^(x \u2212 max)', values: t.row_sum })]; } },
    { title: 'Output = weights \u00b7 V',
      text: 'Each token\u2019s output is the weighted average of the value vectors.',
      tables: function () { return [matrixTable('weights', t.weights, keys), matrixTable('V', t.V, dims), matrixTable('output', t.output, dims)]; } }
  ];
  function renderStep() {
    state.step = Math.max(0, Math.min(steps.length - 1, state.step));
    var s = steps[state.step];
    $('step-title').textContent = 'Step ' + state.step + ' of ' + (steps.length - 1) + ': ' + s.title;
    $('step-text').textContent = s.text;
    var box = $('step-tables');
    box.textContent = '';
    s.tables().forEach(function (tb) { box.appendChild(tb); });
    $('step-prev').disabled = state.step === 0;
    $('step-next').disabled = state.step === steps.length - 1;
    $('steps').setAttribute('data-step', String(state.step));
  }

  // --- embeddings (illustrative) -------------------------------------------------------------
  function renderEmbeddings() {
    var box = $('embeddings');
    box.textContent = '';
    ['tired', 'wide'].forEach(function (last) {
      var s = data.sentences[last];
      var cols = data.model.features;
      var table = el('table', 'matrix');
      table.appendChild(el('caption', '', 'X, sentence ending in \u201c' + last + '\u201d'));
      var head = el('tr');
      head.appendChild(el('th', '', 'word'));
      cols.forEach(function (c) { head.appendChild(el('th', '', c)); });
      table.appendChild(head);
      s.X.forEach(function (r, i) {
        var tr = el('tr');
        tr.appendChild(el('th', '', s.words[i]));
        r.forEach(function (x) { tr.appendChild(el('td', '', x === 0 ? '\u00b7' : String(x))); });
        table.appendChild(tr);
      });
      box.appendChild(table);
    });
  }

  // --- state <-> URL hash ------------------------------------------------------------------------
  function readHash() {
    var params = {};
    location.hash.replace(/^#/, '').split('&').forEach(function (kv) {
      var i = kv.indexOf('=');
      if (i > 0) params[decodeURIComponent(kv.slice(0, i))] = decodeURIComponent(kv.slice(i + 1));
    });
    if (params.last === 'tired' || params.last === 'wide') state.last = params.last;
    if (params.layer === '1' || params.layer === '2') state.layer = Number(params.layer);
    if (params.step !== undefined && /^\d+$/.test(params.step)) state.step = Number(params.step);
    if (params.word !== undefined) {
      var words = data.sentences[state.last].words;
      var k = words.indexOf(params.word);
      if (k < 0) k = words.map(function (w) { return w.toLowerCase(); }).indexOf(params.word.toLowerCase());
      if (k < 0 && /^\d+$/.test(params.word) && Number(params.word) < words.length) k = Number(params.word);
      state.word = k < 0 ? null : k;
    }
  }
  function writeHash() {
    var words = data.sentences[state.last].words;
    var parts = [];
    if (state.word !== null) parts.push('word=' + encodeURIComponent(words[state.word]));
    parts.push('last=' + state.last, 'layer=' + state.layer, 'step=' + state.step);
    try { history.replaceState(null, '', '#' + parts.join('&')); } catch (e) { /* file: URLs */ }
  }
  function update() { renderToggles(); renderWords(); renderStep(); writeHash(); }

  ['tired', 'wide'].forEach(function (w) {
    $('last-' + w).addEventListener('click', function () { state.last = w; update(); });
  });
  [1, 2].forEach(function (l) {
    $('layer-' + l).addEventListener('click', function () { state.layer = l; update(); });
  });
  $('step-prev').addEventListener('click', function () { state.step -= 1; update(); });
  $('step-next').addEventListener('click', function () { state.step += 1; update(); });
  window.addEventListener('hashchange', function () { readHash(); renderToggles(); renderWords(); renderStep(); });
  $('library').textContent = data.library;
  readHash();
  renderEmbeddings();
  renderToggles();
  renderWords();
  renderStep();
  document.body.setAttribute('data-ready', 'true');
})();

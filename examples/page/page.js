(function () {
  'use strict';
  var data = JSON.parse(document.getElementById('attn-data').textContent);
  var state = { last: 'tired', layer: 2, word: null, step: 0, trap: null };
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
  // caption, M (rows of numbers), column labels; optional extra column {name, values}, row
  // labels (default token 1..3) and a class ('wrong' or 'right').
  function matrixTable(caption, M, cols, extra, rows, cls) {
    var labels = rows || tokens;
    var table = el('table', 'matrix' + (cls ? ' ' + cls : ''));
    table.appendChild(el('caption', '', caption));
    var head = el('tr');
    head.appendChild(el('th', '', ''));
    cols.forEach(function (c) { head.appendChild(el('th', '', c)); });
    if (extra) head.appendChild(el('th', '', extra.name));
    table.appendChild(head);
    M.forEach(function (r, i) {
      var tr = el('tr');
      tr.appendChild(el('th', '', labels[i]));
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

  // --- the exam traps: a toggle per trap of the first document, wrong beside right ------------
  var tt = data.traps.three_tokens, love = data.traps.i_love_ai;
  function rowSums(M) { return M.map(function (r) { return r.reduce(function (a, b) { return a + b; }, 0); }); }
  var traps = [
    { key: 'scale', label: '1 \u221ad_k',
      text: 'Without \u00f7\u221a' + t.d_k + ' every row\u2019s largest weight grows (token 3: ' + num(Math.max.apply(null, t.weights[2])) +
            ' \u2192 ' + num(Math.max.apply(null, tt.unscaled_weights[2])) + '). The dot products grow with d_k, and so does the effect: ' +
            'the walkthrough\u2019s Part 6 measures it up to d_k = 1024, where the unscaled weights are nearly one-hot and the gradient vanishes.',
      tables: function () { return [matrixTable('weights of Q K\u1d40 (wrong)', tt.unscaled_weights, keys, null, null, 'wrong'),
                                    matrixTable('weights of Q K\u1d40 / \u221ad_k (right)', t.weights, keys, null, null, 'right')]; } },
    { key: 'columns', label: '2 per row',
      text: 'Softmax down each column makes each key\u2019s weights sum to 1, not each token\u2019s: the rows sum to ' +
            tt.column_row_sums.map(num).join(', ') + ', so weights \u00b7 V is no longer an average of the values.',
      tables: function () { return [matrixTable('softmax per column (wrong)', tt.column_weights, keys, { name: 'row sum', values: tt.column_row_sums }, null, 'wrong'),
                                    matrixTable('softmax per row (right)', t.weights, keys, { name: 'row sum', values: rowSums(t.weights) }, null, 'right')]; } },
    { key: 'order', label: '3 order',
      text: 'The same tokens in the order 3, 2, 1, without positions: the same output rows, in reverse order. ' +
            'Nothing in the calculation knows which token came first (the walkthrough\u2019s Part 5 adds positions).',
      tables: function () { return [matrixTable('outputs, order 3, 2, 1', tt.reversed_output, dims, null, ['token 3', 'token 2', 'token 1'], 'wrong'),
                                    matrixTable('outputs, order 1, 2, 3', t.output, dims, null, null, 'right')]; } },
    { key: 'values', label: '4 values',
      text: 'The same weights applied to the queries, the keys and the values. Queries and keys are used up in making the weights; ' +
            'the values are what a token hands on, so the output is weights \u00b7 V. (Here Q = K, so the first two agree.)',
      tables: function () { return [matrixTable('weights \u00b7 Q (wrong)', tt.average_of_queries, dims, null, null, 'wrong'),
                                    matrixTable('weights \u00b7 K (wrong)', tt.average_of_keys, dims, null, null, 'wrong'),
                                    matrixTable('weights \u00b7 V (right)', t.output, dims, null, null, 'right')]; } },
    { key: 'matrices', label: '5 three matrices',
      text: 'The 3 tokens are given as Q, K and V directly, with no W matrices, so this trap uses the second document\u2019s \u201cI love AI\u201d: ' +
            'with W_q reused for all three, \u201cI\u201d puts ' + pct(love.shared_weights[0][1]) + ' on \u201clove\u201d instead of ' +
            pct(love.weights[0][1]) + ', and each word\u2019s weight on itself (the diagonal) becomes ' +
            love.shared_weights.map(function (r, i) { return num(r[i]); }).join(', ') + ' from ' +
            love.weights.map(function (r, i) { return num(r[i]); }).join(', ') + '.',
      tables: function () { return [matrixTable('weights, W_q reused (wrong)', love.shared_weights, love.words, null, love.words, 'wrong'),
                                    matrixTable('weights, W_q W_k W_v (right)', love.weights, love.words, null, love.words, 'right')]; } },
    { key: 'itself', label: '6 itself',
      text: 'A token attends to itself: its own weight is on the diagonal (' + t.weights.map(function (r, i) { return num(r[i]); }).join(', ') +
            '). Masked out, tokens 1 and 2 change; token 3 does not, since V3 is the average of V1 and V2.',
      tables: function () { return [matrixTable('weights, itself masked (wrong)', tt.self_masked_weights, keys, null, null, 'wrong'),
                                    matrixTable('output', tt.self_masked_output, dims, null, null, 'wrong'),
                                    matrixTable('weights (right)', t.weights, keys, null, null, 'right'),
                                    matrixTable('output', t.output, dims, null, null, 'right')]; } }
  ];
  function trapByKey(key) {
    for (var k = 0; k < traps.length; k++) if (traps[k].key === key) return k;
    return -1;
  }
  function renderTraps() {
    var box = $('trap-toggles');
    if (!box.firstChild) {
      traps.forEach(function (trap) {
        var b = el('button', 'toggle', trap.label);
        b.type = 'button';
        b.id = 'trap-' + trap.key;
        b.addEventListener('click', function () { state.trap = state.trap === trap.key ? null : trap.key; update(); });
        box.appendChild(b);
      });
    }
    traps.forEach(function (trap) { $('trap-' + trap.key).setAttribute('aria-pressed', String(state.trap === trap.key)); });
    var k = trapByKey(state.trap);
    $('traps').setAttribute('data-trap', k < 0 ? '' : state.trap);
    $('trap-sentence').textContent = k < 0 ? '' : data.traps.sentences[k];
    $('trap-text').textContent = k < 0 ? 'Switch a trap on.' : traps[k].text;
    var tables = $('trap-tables');
    tables.textContent = '';
    if (k >= 0) traps[k].tables().forEach(function (tb) { tables.appendChild(tb); });
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
    if (params.trap !== undefined) state.trap = trapByKey(params.trap) < 0 ? null : params.trap;
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
    if (state.trap !== null) parts.push('trap=' + state.trap);
    try { history.replaceState(null, '', '#' + parts.join('&')); } catch (e) { /* file: URLs */ }
  }
  function update() { renderToggles(); renderWords(); renderStep(); renderTraps(); writeHash(); }

  ['tired', 'wide'].forEach(function (w) {
    $('last-' + w).addEventListener('click', function () { state.last = w; update(); });
  });
  [1, 2].forEach(function (l) {
    $('layer-' + l).addEventListener('click', function () { state.layer = l; update(); });
  });
  $('step-prev').addEventListener('click', function () { state.step -= 1; update(); });
  $('step-next').addEventListener('click', function () { state.step += 1; update(); });
  window.addEventListener('hashchange', function () { readHash(); renderToggles(); renderWords(); renderStep(); renderTraps(); });
  $('library').textContent = data.library;
  readHash();
  renderEmbeddings();
  renderToggles();
  renderWords();
  renderStep();
  renderTraps();
  document.body.setAttribute('data-ready', 'true');
})();

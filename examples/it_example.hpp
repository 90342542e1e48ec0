#pragma once
/// \file it_example.hpp
/// The second document's click-a-word picture, "The animal didn't cross the street because it was
/// too tired" (or "... too wide"), as one self-contained HTML page whose every weight is computed
/// by `attn` when the page is generated, and the first document's 3-token step-through.
///
/// ILLUSTRATIVE WEIGHTS, NOT A TRAINED MODEL. The embeddings and projection matrices below are
/// small and set by hand, as the document's own are, so that the pictures tell the document's
/// story: "it" attends most to "animal" when the sentence ends in "tired" and to "street" when it
/// ends in "wide". Nothing here was learned from data.
///
/// Why two layers: in one layer, "it" compares its own query with every word's key. Switching
/// "tired" to "wide" changes only the last word's key, so one layer could not move "it" from
/// "animal" to "street". Here layer 1 lets "it" read the adjective (it attends to "tired"/"wide"
/// and adds that word's value to its own vector: a residual connection), and layer 2 uses what "it"
/// read: its query now asks for "something that gets tired" or "something that is wide", which the
/// key of "animal" or of "street" answers.
///
/// Also the inputs of the documents' other examples that `attn-walkthrough --svg DIR` draws.
/// Used by `attn-walkthrough --html FILE` / `--svg DIR` and by tests/render_test.cpp.

#include <attn/attn.hpp>
#include <cmath>
#include <cstddef>
#include <limits>
#include <locale>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace attn_examples {

using Matrix = attn::Matrix<double>;
using attn::Index;

/// The hand-set features of the illustrative embeddings: one column of X each.
enum Feature : Index {
  kNoun = 0,          ///< a thing that "it" could refer to
  kAnimate = 1,       ///< a living thing (animal)
  kPlace = 2,         ///< a place (street)
  kPronoun = 3,       ///< "it"
  kNeedsAnimate = 4,  ///< an adjective said of living things (tired)
  kNeedsPlace = 5,    ///< an adjective said of places (wide)
  kAdjective = 6,     ///< any adjective
  kVerb = 7,          ///< a verb (cross)
  kFeatureCount = 8
};

/// The features' names, in column order (shown on the page).
inline std::vector<std::string> feature_names() {
  return {"noun",          "animate",     "place",     "pronoun",
          "needs-animate", "needs-place", "adjective", "verb"};
}

/// The sentence, one row of X per word.
struct ItSentence {
  std::vector<std::string> words;  ///< n words
  Matrix X;                        ///< n x kFeatureCount hand-set embeddings
};

/// "The animal didn't cross the street because it was too <last>".
/// \param last  "tired" or "wide"
/// \throws std::invalid_argument for any other last word.
inline ItSentence it_sentence(const std::string& last) {
  if (last != "tired" && last != "wide") {
    throw std::invalid_argument("it_sentence: the last word must be 'tired' or 'wide', not '" +
                                last + "'");
  }
  ItSentence s;
  s.words = {"The",     "animal", "didn't", "cross", "the", "street",
             "because", "it",     "was",    "too",   last};
  s.X = Matrix::Zero(static_cast<Index>(s.words.size()), kFeatureCount);
  const auto set = [&s](Index word, Feature feature) { s.X(word, feature) = 1.0; };
  set(1, kNoun);  // animal
  set(1, kAnimate);
  set(3, kVerb);  // cross
  set(5, kNoun);  // street
  set(5, kPlace);
  set(7, kPronoun);     // it
  set(10, kAdjective);  // tired / wide
  set(10, last == "tired" ? kNeedsAnimate : kNeedsPlace);
  return s;
}

/// The index of `word` in `s.words` (the first occurrence).
/// \throws std::invalid_argument when absent.
inline Index word_index(const ItSentence& s, const std::string& word) {
  for (std::size_t k = 0; k < s.words.size(); ++k) {
    if (s.words[k] == word) return static_cast<Index>(k);
  }
  throw std::invalid_argument("word_index: no word '" + word + "' in the sentence");
}

/// The hand-set projections of the two layers (`Q = X W_Q`, as everywhere in attn).
struct ItModel {
  Matrix W_Q1, W_K1, W_V1;  ///< layer 1: kFeatureCount x 2, kFeatureCount x 2, 8 x 8
  Matrix W_Q2, W_K2, W_V2;  ///< layer 2: kFeatureCount x 4 (queries and keys), 8 x 8 (values)
};

/// Layer 1: the pronoun's query looks for adjectives; values carry only the adjective's
/// "needs-animate" / "needs-place" features. Layer 2: a query that carries "needs-animate" looks
/// for an animate key, "needs-place" for a place; pronouns and verbs look for nouns; adjectives
/// look for the pronoun. Words with no such feature have zero queries and attend evenly.
inline ItModel it_model() {
  constexpr double strength = 3.0;  // how sharply layer 1's "it" picks the adjective
  ItModel model;
  model.W_Q1 = Matrix::Zero(kFeatureCount, 2);
  model.W_K1 = Matrix::Zero(kFeatureCount, 2);
  model.W_Q1(kPronoun, 0) = strength;
  model.W_K1(kAdjective, 0) = strength;
  model.W_V1 = Matrix::Zero(kFeatureCount, kFeatureCount);
  model.W_V1(kNeedsAnimate, kNeedsAnimate) = 1.0;
  model.W_V1(kNeedsPlace, kNeedsPlace) = 1.0;

  model.W_Q2 = Matrix::Zero(kFeatureCount, 4);
  model.W_K2 = Matrix::Zero(kFeatureCount, 4);
  model.W_Q2(kNeedsAnimate, 0) = 2.0;  // "what gets tired?"  -> animate keys
  model.W_K2(kAnimate, 0) = 2.0;
  model.W_Q2(kNeedsPlace, 1) = 2.0;  // "what is wide?"     -> place keys
  model.W_K2(kPlace, 1) = 2.0;
  model.W_Q2(kPronoun, 2) = 2.0;  // pronouns and verbs  -> nouns
  model.W_Q2(kVerb, 2) = 2.0;
  model.W_K2(kNoun, 2) = 1.0;
  model.W_Q2(kAdjective, 3) = 3.0;  // adjectives         -> the pronoun
  model.W_K2(kPronoun, 3) = 1.0;
  model.W_V2 = Matrix::Identity(kFeatureCount, kFeatureCount);
  return model;
}

/// Both layers' results for one sentence.
struct ItAttention {
  attn::Attention<double> layer1;  ///< weights n x n, output n x kFeatureCount
  Matrix X1;                       ///< n x kFeatureCount: X + layer 1's output (the residual)
  attn::Attention<double> layer2;  ///< weights n x n: what the page highlights
};

/// Runs the two layers with `attn::project_qkv` and `attn::attention_with_weights` (default scale
/// 1 / sqrt(d_k), no mask: every word sees the whole sentence, as in an encoder).
inline ItAttention it_attention(const ItSentence& s, const ItModel& model) {
  ItAttention result;
  const attn::QKV<double> l1 = attn::project_qkv(s.X, model.W_Q1, model.W_K1, model.W_V1);
  result.layer1 = attn::attention_with_weights(l1.Q, l1.K, l1.V);
  result.X1 = s.X + result.layer1.output;
  const attn::QKV<double> l2 = attn::project_qkv(result.X1, model.W_Q2, model.W_K2, model.W_V2);
  result.layer2 = attn::attention_with_weights(l2.Q, l2.K, l2.V);
  return result;
}

/// The first document's three tokens: Q, K and V given directly (d_k = 2).
inline attn::QKV<double> three_tokens() {
  attn::QKV<double> t{Matrix(3, 2), Matrix(3, 2), Matrix(3, 2)};
  t.Q << 1, 0, 0, 1, 1, 1;
  t.K << 1, 0, 0, 1, 1, 1;
  t.V << 1, 0, 0, 1, 0.5, 0.5;
  return t;
}

/// The second document's "I love AI" NumPy example: words, X (3 x 4) and W_q, W_k, W_v (4 x 2).
struct ILoveAi {
  std::vector<std::string> words{"I", "love", "AI"};
  Matrix X{3, 4};
  Matrix W_q{4, 2};
  Matrix W_k{4, 2};
  Matrix W_v{4, 2};
  ILoveAi() {
    X << 1, 0, 1, 0,  // "I"
        0, 2, 0, 1,   // "love"
        1, 1, 1, 1;   // "AI"
    W_q << 1, 0, 0, 1, 1, 0, 0, 1;
    W_k << 0, 1, 1, 0, 0, 1, 1, 0;
    W_v << 1, 0, 0, 1, 1, 1, 0, 0;
  }
  /// The 3 x 3 attention weights, softmax(Q K^T / sqrt(2)).
  Matrix weights() const {
    const attn::QKV<double> qkv = attn::project_qkv(X, W_q, W_k, W_v);
    return attn::attention_with_weights(qkv.Q, qkv.K, qkv.V).weights;
  }
};

namespace detail {

/// A JSON number that reads back as the same double (17 significant digits); null if not finite.
inline std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out.precision(std::numeric_limits<double>::max_digits10);
  out << x;
  return out.str();
}

/// A JSON string; also escapes '<', '>' and '&' so that it is safe inside an HTML <script>.
inline std::string json_string(const std::string& text) {
  std::string quoted = "\"";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      quoted += '\\';
      quoted += c;
    } else if (u < 0x20 || c == '<' || c == '>' || c == '&') {
      static const char digits[] = "0123456789abcdef";
      quoted += "\\u00";
      quoted += digits[u >> 4];
      quoted += digits[u & 0xF];
    } else {
      quoted += c;
    }
  }
  return quoted + "\"";
}

/// A matrix as an array of row arrays; a vector as one array.
template <class Derived>
std::string json_matrix(const Eigen::MatrixBase<Derived>& M) {
  std::string text = "[";
  for (Index i = 0; i < M.rows(); ++i) {
    text += i == 0 ? "[" : ",[";
    for (Index j = 0; j < M.cols(); ++j) {
      text += (j == 0 ? "" : ",") + json_number(static_cast<double>(M(i, j)));
    }
    text += "]";
  }
  return text + "]";
}

template <class Derived>
std::string json_vector(const Eigen::MatrixBase<Derived>& v) {
  std::string text = "[";
  for (Index k = 0; k < v.size(); ++k) {
    text += (k == 0 ? "" : ",") + json_number(static_cast<double>(v(k)));
  }
  return text + "]";
}

inline std::string json_strings(const std::vector<std::string>& items) {
  std::string text = "[";
  for (std::size_t k = 0; k < items.size(); ++k)
    text += (k == 0 ? "" : ",") + json_string(items[k]);
  return text + "]";
}

}  // namespace detail

/// The note every picture of this example carries.
inline const char* illustrative_note() {
  return "Illustrative weights, not a trained model: the embeddings and projection matrices are "
         "small and set by hand so that the example tells the document's story.";
}

/// The data the page embeds, as JSON: for "tired" and "wide", the words, X, both layers' weights
/// and X1; the model's matrices and feature names; the 3-token example's `attn::trace_attention`
/// (scores, scaled, row_max, exp, row_sum, weights, output and its Q, K, V).
inline std::string page_data_json() {
  using detail::json_matrix;
  using detail::json_string;
  using detail::json_vector;
  const ItModel model = it_model();
  std::string json =
      "{\"note\":" + json_string(illustrative_note()) + ",\"library\":" +
      json_string("attn " + std::to_string(ATTN_VERSION_MAJOR) + "." +
                  std::to_string(ATTN_VERSION_MINOR) + "." + std::to_string(ATTN_VERSION_PATCH)) +
      ",\"sentences\":{";
  const std::vector<std::string> lasts{"tired", "wide"};
  for (std::size_t k = 0; k < lasts.size(); ++k) {
    const ItSentence s = it_sentence(lasts[k]);
    const ItAttention a = it_attention(s, model);
    json += (k == 0 ? "" : ",") + json_string(lasts[k]) +
            ":{\"words\":" + detail::json_strings(s.words) + ",\"X\":" + json_matrix(s.X) +
            ",\"X1\":" + json_matrix(a.X1) +
            ",\"layers\":[{\"weights\":" + json_matrix(a.layer1.weights) +
            "},{\"weights\":" + json_matrix(a.layer2.weights) + "}]}";
  }
  json += "},\"model\":{\"features\":" + detail::json_strings(feature_names()) +
          ",\"W_Q1\":" + json_matrix(model.W_Q1) + ",\"W_K1\":" + json_matrix(model.W_K1) +
          ",\"W_V1\":" + json_matrix(model.W_V1) + ",\"W_Q2\":" + json_matrix(model.W_Q2) +
          ",\"W_K2\":" + json_matrix(model.W_K2) + ",\"W_V2\":" + json_matrix(model.W_V2) + "}";
  const attn::QKV<double> t = three_tokens();
  const attn::AttentionTrace<double> trace = attn::trace_attention(t.Q, t.K, t.V);
  json += ",\"three_tokens\":{\"Q\":" + json_matrix(t.Q) + ",\"K\":" + json_matrix(t.K) +
          ",\"V\":" + json_matrix(t.V) + ",\"d_k\":" + std::to_string(t.K.cols()) +
          ",\"scale\":" + detail::json_number(1.0 / std::sqrt(static_cast<double>(t.K.cols()))) +
          ",\"scores\":" + json_matrix(trace.scores) + ",\"scaled\":" + json_matrix(trace.scaled) +
          ",\"row_max\":" + json_vector(trace.row_max) + ",\"exp\":" + json_matrix(trace.exp) +
          ",\"row_sum\":" + json_vector(trace.row_sum) +
          ",\"weights\":" + json_matrix(trace.weights) +
          ",\"output\":" + json_matrix(trace.output) + "}}";
  return json;
}

/// The start and end markers around the embedded JSON (tests look for them).
inline const char* page_data_open() {
  return "<script type=\"application/json\" id=\"attn-data\">";
}

/// The page's style sheet.
inline const char* page_css() {
  return R"CSS(
:root { --accent: 230, 97, 0; --ink: #1d1d1f; --muted: #5f6368; --line: #d9d9de; }
* { box-sizing: border-box; }
body { margin: 0; font: 16px/1.5 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
       color: var(--ink); background: #fafafa; }
main { max-width: 1120px; margin: 0 auto; padding: 18px 24px 40px; }
h1 { font-size: 26px; margin: 4px 0 6px; }
h2 { font-size: 20px; margin: 0 0 8px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 16px 20px;
          margin: 14px 0; }
.illustrative { background: #fff7e6; border: 1px solid #f0c36d; border-radius: 8px; padding: 8px 12px;
                margin: 8px 0; font-size: 14px; }
.controls { display: flex; flex-wrap: wrap; gap: 16px; align-items: center; margin: 6px 0 12px;
            font-size: 14px; color: var(--muted); }
.toggle { font: inherit; border: 1px solid var(--line); background: #fff; padding: 3px 12px;
          cursor: pointer; }
.toggle:first-of-type { border-radius: 6px 0 0 6px; }
.toggle:last-of-type { border-radius: 0 6px 6px 0; margin-left: -1px; }
.toggle[aria-pressed="true"] { background: #333; color: #fff; border-color: #333; }
.sentence { display: flex; flex-wrap: wrap; gap: 8px 6px; margin: 8px 0 4px; }
.word { font: inherit; font-size: 22px; border: 2px solid transparent; border-radius: 8px;
        padding: 4px 10px 2px; background: #f1f1f4; cursor: pointer; display: inline-flex;
        flex-direction: column; align-items: center; min-width: 56px; color: var(--ink); }
.word .weight { font-size: 12px; color: #333; font-variant-numeric: tabular-nums; min-height: 18px; }
.word.selected { border-color: #333; }
.word.most-attended { border-color: rgb(var(--accent)); box-shadow: 0 0 0 2px rgba(var(--accent), .35); }
#readout { min-height: 24px; margin: 8px 0; font-size: 15px; }
.bars { display: grid; grid-template-columns: max-content 70px 1fr; gap: 2px 10px; font-size: 13px;
        max-width: 640px; font-variant-numeric: tabular-nums; }
.bars .bar { background: rgb(var(--accent)); height: 12px; margin-top: 4px; border-radius: 2px; }
.bars .num { text-align: right; }
.explain { font-size: 14px; color: #333; }
details { font-size: 13px; margin-top: 8px; }
table.matrix { border-collapse: collapse; margin: 6px 14px 6px 0; font-variant-numeric: tabular-nums;
               font-size: 14px; display: inline-table; vertical-align: top; }
table.matrix caption { font-weight: 600; text-align: left; padding-bottom: 2px; }
table.matrix th, table.matrix td { border: 1px solid var(--line); padding: 2px 8px; text-align: right; }
table.matrix th { background: #f4f4f6; font-weight: 500; }
.step-nav { display: flex; gap: 10px; align-items: center; margin-bottom: 8px; }
.step-nav button { font: inherit; padding: 3px 12px; border-radius: 6px; border: 1px solid var(--line);
                   background: #fff; cursor: pointer; }
.step-nav button:disabled { opacity: .4; cursor: default; }
#step-title { font-weight: 600; }
)CSS";
}

/// The page's script: reads the embedded JSON, builds the clickable words and the step-through.
/// The URL hash selects the state at startup and follows every click:
/// `#word=it&last=tired&layer=2&step=0`.
inline const char* page_js() {
  return R"JS(
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
)JS";
}

/// The whole page: one self-contained HTML file (inline CSS, inline script, the data as inline
/// JSON; no network, no external resources), openable from a local file.
inline std::string attention_page_html() {
  std::string html = R"HTML(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Self-attention, click a word (attn)</title>
<style>)HTML";
  html += page_css();
  html += R"HTML(</style>
</head>
<body>
<main>
<h1>Self-attention in action</h1>
<p class="illustrative" id="illustrative"><strong>Illustrative weights, not a trained model.</strong>
The embeddings and projection matrices are small and set by hand, so that the example tells the
document&#39;s story. Every weight on this page was computed by the <span id="library">attn</span>
library when the page was generated (<code>attn-walkthrough --html</code>) and is embedded in it;
nothing is typed in.</p>

<section id="click">
<h2>Click a word</h2>
<p>Click any word to see how much attention it pays to each word. Then switch the last word between
<em>tired</em> and <em>wide</em> and look at <em>it</em> again.</p>
<div class="controls">
  <span>Last word: <button type="button" class="toggle" id="last-tired">tired</button><button
    type="button" class="toggle" id="last-wide">wide</button></span>
  <span>Layer: <button type="button" class="toggle" id="layer-1">1</button><button
    type="button" class="toggle" id="layer-2">2</button></span>
</div>
<div id="sentence" class="sentence" aria-live="polite"></div>
<p id="readout"></p>
<div id="bars" class="bars"></div>
<p class="explain">Why two layers? In one layer, <em>it</em> compares its own query with every
word&#39;s key, and switching <em>tired</em> to <em>wide</em> changes only the last word&#39;s key:
one layer could not move <em>it</em> from <em>animal</em> to <em>street</em>. Here layer 1 lets
<em>it</em> read the adjective (it attends to <em>tired</em> or <em>wide</em> and adds that
word&#39;s value to its own vector), and in layer 2 the query of <em>it</em> asks for
&ldquo;something that gets tired&rdquo; or &ldquo;something that is wide&rdquo;, which the key of
<em>animal</em> or <em>street</em> answers. Words without such features have zero queries and
attend evenly.</p>
<details><summary>The hand-set embeddings (one feature per column)</summary>
<div id="embeddings"></div></details>
</section>

<section id="steps">
<h2>Step through the 3-token example</h2>
<div class="step-nav"><button type="button" id="step-prev">&larr; Previous</button><button
  type="button" id="step-next">Next &rarr;</button><span id="step-title"></span></div>
<p id="step-text" class="explain"></p>
<div id="step-tables"></div>
<p class="explain">These numbers come from <code>attn::trace_attention</code>, which keeps every
intermediate table of the calculation.</p>
</section>
</main>
)HTML";
  html += page_data_open();
  html += page_data_json();
  html += "</script>\n<script>";
  html += page_js();
  html += "</script>\n</body>\n</html>\n";
  return html;
}

}  // namespace attn_examples

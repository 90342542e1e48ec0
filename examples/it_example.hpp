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
/// Used by `attn-walkthrough --html FILE` and by tests/render_test.cpp.
///
/// The page's HTML, style sheet and script are the files page/page.html, page/page.css and
/// page/page.js, which the build embeds into the generated header <attn_examples/page_files.hpp>
/// (page/CMakeLists.txt; link the target `attn_example_page` to use this header).

#include <attn/attn.hpp>
#include <cmath>
#include <cstddef>
#include <limits>
#include <locale>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attn_examples/page_files.hpp"  // generated from page/ at build time
#include "documents.hpp"                 // three_tokens(), for the step-through
#include "exam_traps.hpp"                // the exam-trap panel of the step-through

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

/// A matrix as an array of row arrays.
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

/// A vector as one array.
template <class Derived>
std::string json_vector(const Eigen::MatrixBase<Derived>& v) {
  std::string text = "[";
  for (Index k = 0; k < v.size(); ++k) {
    text += (k == 0 ? "" : ",") + json_number(static_cast<double>(v(k)));
  }
  return text + "]";
}

/// Strings as one array.
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
/// (scores, scaled, row_max, exp, row_sum, weights, output and its Q, K, V); and the exam traps
/// (exam_traps.hpp: the document's sentences, the 3-token and "I love AI" tables of each trap).
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
          ",\"output\":" + json_matrix(trace.output) + "}";
  const ThreeTokenTraps traps = three_token_traps();
  const ILoveAiTraps love = i_love_ai_traps();
  json += ",\"traps\":{\"sentences\":" + detail::json_strings(exam_trap_sentences()) +
          ",\"three_tokens\":{\"unscaled_weights\":" + json_matrix(traps.unscaled_weights) +
          ",\"column_weights\":" + json_matrix(traps.column_weights) +
          ",\"column_row_sums\":" + json_vector(traps.column_weights.rowwise().sum()) +
          ",\"column_output\":" + json_matrix(traps.column_output) +
          ",\"reversed_output\":" + json_matrix(traps.reversed_output) +
          ",\"average_of_queries\":" + json_matrix(traps.average_of_queries) +
          ",\"average_of_keys\":" + json_matrix(traps.average_of_keys) +
          ",\"self_masked_weights\":" + json_matrix(traps.self_masked_weights) +
          ",\"self_masked_output\":" + json_matrix(traps.self_masked_output) +
          "},\"i_love_ai\":{\"words\":" + detail::json_strings(ILoveAi().words) +
          ",\"weights\":" + json_matrix(love.weights) + ",\"output\":" + json_matrix(love.output) +
          ",\"shared_weights\":" + json_matrix(love.shared_weights) +
          ",\"shared_output\":" + json_matrix(love.shared_output) + "}}}";
  return json;
}

/// The start marker of the embedded JSON, as page/page.html writes it before `{{data}}` (tests look
/// for it; the JSON ends at the next `</script>`).
inline const char* page_data_open() {
  return "<script type=\"application/json\" id=\"attn-data\">";
}

namespace detail {

/// `page` with each marker `{{name}}` replaced by the text `fills` gives for `name`. A marker
/// alone on its line is replaced together with that line's end, since what it stands for (a
/// whole file) ends its own last line. The text put in is not searched for markers.
/// \param page   the template, e.g. page/page.html
/// \param fills  (name, text) pairs; every name must occur in `page`
/// \returns the filled page
/// \throws std::logic_error on a marker without a fill, an unclosed `{{`, or a fill that `page`
///         never asks for (page.html and this file disagree).
inline std::string fill_markers(
    std::string_view page,
    const std::vector<std::pair<std::string_view, std::string_view>>& fills) {
  std::string filled;
  std::vector<bool> used(fills.size(), false);
  std::size_t at = 0;
  for (std::size_t open = page.find("{{"); open != std::string_view::npos;
       open = page.find("{{", at)) {
    const std::size_t close = page.find("}}", open + 2);
    if (close == std::string_view::npos) throw std::logic_error("page template: unclosed '{{'");
    const std::string_view name = page.substr(open + 2, close - open - 2);
    std::size_t k = 0;
    while (k < fills.size() && fills[k].first != name) ++k;
    if (k == fills.size()) {
      throw std::logic_error("page template: no text for the marker {{" + std::string(name) + "}}");
    }
    used[k] = true;
    filled.append(page.substr(at, open - at));
    filled.append(fills[k].second);
    at = close + 2;
    const bool alone_on_its_line =
        (open == 0 || page[open - 1] == '\n') && at < page.size() && page[at] == '\n';
    if (alone_on_its_line) ++at;
  }
  filled.append(page.substr(at));
  for (std::size_t k = 0; k < fills.size(); ++k) {
    if (!used[k]) {
      throw std::logic_error("page template: no marker {{" + std::string(fills[k].first) + "}}");
    }
  }
  return filled;
}

}  // namespace detail

/// The whole page: one self-contained HTML file (inline CSS, inline script, the data as inline
/// JSON; no network, no external resources), openable from a local file. Its HTML, style sheet
/// and script are the files page/page.html, page/page.css and page/page.js, embedded at build
/// time (page/CMakeLists.txt); the script reads the JSON of `page_data_json`, builds the clickable
/// words and the step-through, and keeps the state in the URL hash
/// (`#word=it&last=tired&layer=2&step=0`).
inline std::string attention_page_html() {
  const std::string data = page_data_json();
  return detail::fill_markers(
      page_files::page_html,
      {{"page.css", page_files::page_css}, {"page.js", page_files::page_js}, {"data", data}});
}

}  // namespace attn_examples

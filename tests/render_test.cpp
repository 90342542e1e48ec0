/// Tests of attn/render.hpp (SVG and terminal heatmaps) and of the click-a-word page of
/// examples/it_example.hpp: the SVG is well-formed XML with one cell per entry and the right
/// labels; the terminal text holds the numbers, with or without colour; the page embeds the
/// library's own weights; with the page's embeddings "it" attends most to "animal" / "street".

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <attn/render.hpp>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../examples/it_example.hpp"

namespace {

using attn::Index;
using Matrix = attn::Matrix<double>;

// ---------------------------------------------------------------------------------------------
// A minimal XML checker: tags balance, attributes are quoted and unique, '&' starts a known
// entity, '<' never appears in text or attribute values, exactly one root element.
// ---------------------------------------------------------------------------------------------

struct Element {
  std::string name;
  std::map<std::string, std::string> attributes;
  std::string text;  ///< its direct character data, entities decoded
};

/// Decodes the five predefined entities and character references; throws on anything else.
std::string decode_entities(const std::string& raw) {
  std::string text;
  for (std::size_t k = 0; k < raw.size(); ++k) {
    if (raw[k] == '<') throw std::runtime_error("'<' in character data");
    if (raw[k] != '&') {
      text += raw[k];
      continue;
    }
    const std::size_t end = raw.find(';', k);
    if (end == std::string::npos) throw std::runtime_error("'&' without ';'");
    const std::string name = raw.substr(k + 1, end - k - 1);
    if (name == "amp") {
      text += '&';
    } else if (name == "lt") {
      text += '<';
    } else if (name == "gt") {
      text += '>';
    } else if (name == "quot") {
      text += '"';
    } else if (name == "apos") {
      text += '\'';
    } else if (name.size() > 1 && name[0] == '#') {
      text += '?';  // a character reference; its value does not matter here
    } else {
      throw std::runtime_error("unknown entity '&" + name + ";'");
    }
    k = end;
  }
  return text;
}

bool is_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' || c == '_' || c == ':' ||
         c == '.';
}

/// Parses `xml` into its elements in document order; throws std::runtime_error when it is not
/// well-formed (for the subset of XML the renderer writes: no DTD, no CDATA).
std::vector<Element> parse_xml(const std::string& xml) {
  std::vector<Element> elements;
  std::vector<std::size_t> open;  // indices into `elements`
  bool root_closed = false;
  std::size_t k = 0;
  const auto skip_space = [&] {
    while (k < xml.size() && std::isspace(static_cast<unsigned char>(xml[k])) != 0) ++k;
  };
  while (k < xml.size()) {
    const std::size_t lt = xml.find('<', k);
    const std::string text = xml.substr(k, lt == std::string::npos ? std::string::npos : lt - k);
    const std::string decoded = decode_entities(text);
    if (open.empty()) {
      if (decoded.find_first_not_of(" \t\r\n") != std::string::npos) {
        throw std::runtime_error("text outside the root element");
      }
    } else {
      elements[open.back()].text += decoded;
    }
    if (lt == std::string::npos) break;
    k = lt;
    if (xml.compare(k, 5, "<?xml") == 0) {
      if (k != 0) throw std::runtime_error("XML declaration not at the start");
      const std::size_t end = xml.find("?>", k);
      if (end == std::string::npos) throw std::runtime_error("unterminated declaration");
      k = end + 2;
      continue;
    }
    if (xml.compare(k, 4, "<!--") == 0) {
      const std::size_t end = xml.find("-->", k);
      if (end == std::string::npos) throw std::runtime_error("unterminated comment");
      k = end + 3;
      continue;
    }
    const bool closing = xml.compare(k, 2, "</") == 0;
    k += closing ? 2 : 1;
    const std::size_t name_start = k;
    while (k < xml.size() && is_name_char(xml[k])) ++k;
    const std::string name = xml.substr(name_start, k - name_start);
    if (name.empty()) throw std::runtime_error("a tag without a name");
    if (closing) {
      skip_space();
      if (k >= xml.size() || xml[k] != '>') throw std::runtime_error("bad closing tag " + name);
      ++k;
      if (open.empty() || elements[open.back()].name != name) {
        throw std::runtime_error(
            "</" + name + "> closes " +
            (open.empty() ? std::string("nothing") : "<" + elements[open.back()].name + ">"));
      }
      open.pop_back();
      if (open.empty()) root_closed = true;
      continue;
    }
    if (root_closed || (open.empty() && !elements.empty())) {
      throw std::runtime_error("a second root element <" + name + ">");
    }
    Element element;
    element.name = name;
    bool self_closing = false;
    for (;;) {
      skip_space();
      if (k >= xml.size()) throw std::runtime_error("unterminated tag <" + name + ">");
      if (xml[k] == '>') {
        ++k;
        break;
      }
      if (xml.compare(k, 2, "/>") == 0) {
        k += 2;
        self_closing = true;
        break;
      }
      const std::size_t attribute_start = k;
      while (k < xml.size() && is_name_char(xml[k])) ++k;
      const std::string attribute = xml.substr(attribute_start, k - attribute_start);
      if (attribute.empty() || k >= xml.size() || xml[k] != '=') {
        throw std::runtime_error("bad attribute in <" + name + ">");
      }
      ++k;
      if (k >= xml.size() || (xml[k] != '"' && xml[k] != '\'')) {
        throw std::runtime_error("unquoted attribute " + attribute);
      }
      const char quote = xml[k++];
      const std::size_t value_end = xml.find(quote, k);
      if (value_end == std::string::npos) throw std::runtime_error("unterminated attribute");
      const std::string value = decode_entities(xml.substr(k, value_end - k));
      if (!element.attributes.emplace(attribute, value).second) {
        throw std::runtime_error("duplicate attribute " + attribute + " in <" + name + ">");
      }
      k = value_end + 1;
    }
    elements.push_back(element);
    if (!self_closing) {
      open.push_back(elements.size() - 1);
    } else if (open.empty()) {
      root_closed = true;
    }
  }
  if (!open.empty()) throw std::runtime_error("<" + elements[open.back()].name + "> never closed");
  if (elements.empty()) throw std::runtime_error("no root element");
  return elements;
}

/// Whether the space-separated class list of `e` has `name`.
bool has_class(const Element& e, const std::string& name) {
  const auto it = e.attributes.find("class");
  if (it == e.attributes.end()) return false;
  const std::string padded = " " + it->second + " ";
  return padded.find(" " + name + " ") != std::string::npos;
}

std::vector<const Element*> with_class(const std::vector<Element>& elements,
                                       const std::string& name) {
  std::vector<const Element*> found;
  for (const Element& e : elements) {
    if (has_class(e, name)) found.push_back(&e);
  }
  return found;
}

std::vector<std::string> texts_of(const std::vector<const Element*>& elements) {
  std::vector<std::string> texts;
  for (const Element* e : elements) texts.push_back(e->text);
  return texts;
}

Matrix ramp(Index n, Index m) {
  Matrix M(n, m);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j)
      M(i, j) = static_cast<double>(i * m + j) / static_cast<double>(n * m);
  }
  return M;
}

// ---------------------------------------------------------------------------------------------
// The checker itself
// ---------------------------------------------------------------------------------------------

TEST(RenderXmlChecker, RejectsBrokenDocuments) {
  EXPECT_NO_THROW(parse_xml("<?xml version=\"1.0\"?>\n<a x=\"1\"><b/>t&amp;t</a>\n"));
  EXPECT_THROW(parse_xml("<a><b></a></b>"), std::runtime_error);
  EXPECT_THROW(parse_xml("<a>"), std::runtime_error);
  EXPECT_THROW(parse_xml("<a>x & y</a>"), std::runtime_error);
  EXPECT_THROW(parse_xml("<a x=1></a>"), std::runtime_error);
  EXPECT_THROW(parse_xml("<a x=\"1\" x=\"2\"></a>"), std::runtime_error);
  EXPECT_THROW(parse_xml("<a></a><b></b>"), std::runtime_error);
  EXPECT_THROW(parse_xml("<a t=\"<\"></a>"), std::runtime_error);
}

// ---------------------------------------------------------------------------------------------
// SVG
// ---------------------------------------------------------------------------------------------

TEST(RenderSvg, WellFormedWithOneCellPerEntryAndTheLabels) {
  const Matrix M = ramp(3, 4);
  const std::vector<std::string> rows{"I", "a<b", "\"q\" & 'r'"};
  const std::vector<std::string> cols{"k1", "k>2", "k&3", "caf\xC3\xA9"};
  attn::HeatmapOptions options;
  options.title = "weights <&>";
  const std::string svg = attn::heatmap_svg(M, rows, cols, options);
  std::vector<Element> elements;
  ASSERT_NO_THROW(elements = parse_xml(svg)) << svg;
  EXPECT_EQ(elements.front().name, "svg");
  EXPECT_EQ(elements.front().attributes.at("xmlns"), "http://www.w3.org/2000/svg");

  const std::vector<const Element*> cells = with_class(elements, "cell");
  ASSERT_EQ(cells.size(), 12U);
  for (std::size_t k = 0; k < cells.size(); ++k) {
    EXPECT_EQ(cells[k]->name, "rect");
    EXPECT_EQ(cells[k]->attributes.at("data-row"), std::to_string(k / 4));
    EXPECT_EQ(cells[k]->attributes.at("data-col"), std::to_string(k % 4));
    EXPECT_EQ(cells[k]->attributes.at("fill").front(), '#');
    EXPECT_FALSE(has_class(*cells[k], "masked"));
  }
  EXPECT_EQ(texts_of(with_class(elements, "row-label")), rows);
  EXPECT_EQ(texts_of(with_class(elements, "col-label")), cols);
  EXPECT_EQ(texts_of(with_class(elements, "title")), std::vector<std::string>{"weights <&>"});

  // Small: every cell prints its value, row by row.
  std::vector<std::string> expected_values;
  for (Index i = 0; i < 3; ++i) {
    for (Index j = 0; j < 4; ++j) expected_values.push_back(attn::detail::fixed_figure(M(i, j), 2));
  }
  EXPECT_EQ(texts_of(with_class(elements, "value")), expected_values);
  EXPECT_EQ(expected_values[5], "0.42");  // 5 / 12
  EXPECT_EQ(with_class(elements, "legend").size(), 1U);
}

TEST(RenderSvg, LargeTablesHaveCellsButNoValues) {
  const Matrix M = ramp(13, 13);
  std::vector<std::string> labels;
  for (int k = 0; k < 13; ++k) labels.push_back("t" + std::to_string(k));
  const std::vector<Element> elements = parse_xml(attn::heatmap_svg(M, labels, labels));
  EXPECT_EQ(with_class(elements, "cell").size(), 169U);
  EXPECT_TRUE(with_class(elements, "value").empty());
}

TEST(RenderSvg, CausalFlagAndMaskHatchTheForbiddenCells) {
  const Matrix M = ramp(3, 3);
  const std::vector<std::string> labels{"a", "b", "c"};
  attn::HeatmapOptions causal;
  causal.causal = attn::Causal::BottomRight;
  attn::HeatmapOptions mask;
  mask.mask = attn::causal_mask(3, 3);
  for (const attn::HeatmapOptions& options : {causal, mask}) {
    const std::vector<Element> elements = parse_xml(attn::heatmap_svg(M, labels, labels, options));
    const std::vector<const Element*> masked = with_class(elements, "masked");
    ASSERT_EQ(masked.size(), 3U);  // (0,1), (0,2), (1,2)
    for (const Element* e : masked) {
      EXPECT_GT(std::stoi(e->attributes.at("data-col")), std::stoi(e->attributes.at("data-row")));
      EXPECT_EQ(e->attributes.at("fill"), "url(#attn-hatch)");
    }
    EXPECT_EQ(with_class(elements, "value").size(), 6U);  // masked cells print no value
  }
}

TEST(RenderSvg, FloatInputAndNonFiniteScores) {
  attn::Matrix<float> S(2, 2);
  S << 0.5f, -std::numeric_limits<float>::infinity(), -1.0f, 2.0f;
  const std::vector<std::string> labels{"x", "y"};
  const std::vector<Element> elements = parse_xml(attn::heatmap_svg(S, labels, labels));
  EXPECT_EQ(with_class(elements, "cell").size(), 4U);
  EXPECT_EQ(with_class(elements, "cell")[1]->attributes.at("fill"), "url(#attn-hatch)");
  // Not in [0, 1]: the scale spans the finite values.
  const std::vector<std::string> legend = texts_of(with_class(elements, "legend-label"));
  EXPECT_EQ(legend, (std::vector<std::string>{"-1.00", "0.50", "2.00"}));
}

TEST(RenderSvg, ControlCharactersInLabelsStayWellFormed) {
  const Matrix M = ramp(1, 1);
  EXPECT_NO_THROW(parse_xml(attn::heatmap_svg(M, {std::string("a\x01") + "b"}, {"c\x1b[0m"})));
}

TEST(RenderSvg, ShapeErrorsNameTheCounts) {
  const Matrix M = ramp(3, 2);
  try {
    attn::heatmap_svg(M, {"a", "b"}, {"x", "y"});
    FAIL() << "expected attn::shape_error";
  } catch (const attn::shape_error& e) {
    EXPECT_NE(
        std::string(e.what()).find("heatmap_svg: row_labels has 2 labels but the matrix has 3 "
                                   "rows (the matrix is 3 x 2)"),
        std::string::npos)
        << e.what();
  }
  EXPECT_THROW(attn::heatmap_svg(M, {"a", "b", "c"}, {"x"}), attn::shape_error);
  attn::HeatmapOptions options;
  options.mask = attn::Mask::Constant(2, 2, true);
  EXPECT_THROW(attn::heatmap_svg(M, {"a", "b", "c"}, {"x", "y"}, options), attn::shape_error);
  options.mask.reset();
  options.decimals = -1;
  EXPECT_THROW(attn::heatmap_svg(M, {"a", "b", "c"}, {"x", "y"}, options), attn::shape_error);
  options.decimals = 2;
  options.low = 1.0;
  options.high = 1.0;
  EXPECT_THROW(attn::heatmap_svg(M, {"a", "b", "c"}, {"x", "y"}, options), attn::shape_error);
}

// ---------------------------------------------------------------------------------------------
// Terminal
// ---------------------------------------------------------------------------------------------

TEST(RenderTerminal, WithoutColourHoldsTheNumbers) {
  const attn_examples::ILoveAi love;
  attn::HeatmapOptions options;
  options.color = attn::ColorChoice::Never;
  const std::string text = attn::heatmap_terminal(love.weights(), love.words, love.words, options);
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
  // The document's rounded weights, row by row.
  EXPECT_NE(text.find("I    0.01  0.80  0.19"), std::string::npos) << text;
  EXPECT_NE(text.find("love 0.50  0.01  0.50"), std::string::npos) << text;
  EXPECT_NE(text.find("AI   0.05  0.19  0.77"), std::string::npos) << text;
  EXPECT_NE(text.find("I  love    AI"), std::string::npos) << text;
}

TEST(RenderTerminal, WithColourHasEscapeCodesAndStillTheNumbers) {
  const Matrix M = ramp(2, 3);
  attn::HeatmapOptions options;
  options.color = attn::ColorChoice::Always;
  const std::string text = attn::heatmap_terminal(M, {"a", "b"}, {"x", "y", "z"}, options);
  EXPECT_NE(text.find("\x1b[48;2;68;1;84m"), std::string::npos);  // viridis(0) behind the 0
  EXPECT_NE(text.find("\x1b[38;2;"), std::string::npos);
  EXPECT_NE(text.find("\x1b[0m"), std::string::npos);
  EXPECT_NE(text.find("0.83"), std::string::npos);  // 5 / 6
  std::size_t resets = 0;
  for (std::size_t k = text.find("\x1b[0m"); k != std::string::npos;
       k = text.find("\x1b[0m", k + 1)) {
    ++resets;
  }
  EXPECT_EQ(resets, 6U);  // one per cell
}

TEST(RenderTerminal, ColourDecisionIsInjectable) {
  EXPECT_TRUE(attn::color_wanted(true, nullptr));
  EXPECT_TRUE(attn::color_wanted(true, ""));
  EXPECT_FALSE(attn::color_wanted(true, "1"));
  EXPECT_FALSE(attn::color_wanted(false, nullptr));
  // Under ctest stdout is a pipe: Auto gives plain numbers.
  if (!attn::stdout_wants_color()) {
    EXPECT_EQ(attn::heatmap_terminal(ramp(2, 2), {"a", "b"}, {"a", "b"}).find('\x1b'),
              std::string::npos);
  }
}

TEST(RenderTerminal, MaskedCellsAndShapeErrors) {
  attn::HeatmapOptions options;
  options.color = attn::ColorChoice::Never;
  options.causal = attn::Causal::TopLeft;
  const std::string text = attn::heatmap_terminal(ramp(2, 2), {"a", "b"}, {"a", "b"}, options);
  EXPECT_NE(text.find("a 0.00     - "), std::string::npos) << text;
  EXPECT_THROW(attn::heatmap_terminal(ramp(2, 2), {"a"}, {"a", "b"}), attn::shape_error);
}

// ---------------------------------------------------------------------------------------------
// The click-a-word page
// ---------------------------------------------------------------------------------------------

/// The JSON the page embeds, parsed back.
nlohmann::json page_data(const std::string& html) {
  const std::string open = attn_examples::page_data_open();
  const std::size_t start = html.find(open);
  EXPECT_NE(start, std::string::npos);
  const std::size_t end = html.find("</script>", start);
  const std::string json = html.substr(start + open.size(), end - start - open.size());
  EXPECT_EQ(json.find("</"), std::string::npos);  // cannot close the <script> early
  return nlohmann::json::parse(json);
}

Matrix from_json(const nlohmann::json& rows) {
  Matrix M(static_cast<Index>(rows.size()), static_cast<Index>(rows.at(0).size()));
  for (Index i = 0; i < M.rows(); ++i) {
    for (Index j = 0; j < M.cols(); ++j) {
      M(i, j) = rows.at(static_cast<std::size_t>(i)).at(static_cast<std::size_t>(j)).get<double>();
    }
  }
  return M;
}

/// Exact equality (the page writes 17 significant digits, which read back to the same double).
void expect_identical(const Matrix& actual, const Matrix& expected, const std::string& what) {
  ASSERT_EQ(actual.rows(), expected.rows()) << what;
  ASSERT_EQ(actual.cols(), expected.cols()) << what;
  for (Index i = 0; i < actual.rows(); ++i) {
    for (Index j = 0; j < actual.cols(); ++j) {
      EXPECT_EQ(actual(i, j), expected(i, j)) << what << " at (" << i << ", " << j << ")";
    }
  }
}

TEST(RenderHtml, PageEmbedsTheLibrarysWeights) {
  const nlohmann::json data = page_data(attn_examples::attention_page_html());
  const attn_examples::ItModel model = attn_examples::it_model();
  for (const std::string last : {"tired", "wide"}) {
    const nlohmann::json& sentence = data.at("sentences").at(last);
    const attn_examples::ItSentence s = attn_examples::it_sentence(last);
    EXPECT_EQ(sentence.at("words").get<std::vector<std::string>>(), s.words);
    expect_identical(from_json(sentence.at("X")), s.X, last + ": X");
    // Both layers recomputed here with the public API, from the page's own embeddings.
    const attn::QKV<double> l1 = attn::project_qkv(s.X, model.W_Q1, model.W_K1, model.W_V1);
    const attn::Attention<double> a1 = attn::attention_with_weights(l1.Q, l1.K, l1.V);
    const Matrix X1 = s.X + a1.output;
    const attn::QKV<double> l2 = attn::project_qkv(X1, model.W_Q2, model.W_K2, model.W_V2);
    const attn::Attention<double> a2 = attn::attention_with_weights(l2.Q, l2.K, l2.V);
    expect_identical(from_json(sentence.at("layers").at(0).at("weights")), a1.weights,
                     last + ": layer 1");
    expect_identical(from_json(sentence.at("layers").at(1).at("weights")), a2.weights,
                     last + ": layer 2");
  }
  expect_identical(from_json(data.at("model").at("W_Q2")), model.W_Q2, "W_Q2");
  // The 3-token step-through: trace_attention's tables, which agree with attention_with_weights.
  const attn::QKV<double> t = attn_examples::three_tokens();
  const nlohmann::json& three = data.at("three_tokens");
  const attn::Attention<double> a = attn::attention_with_weights(t.Q, t.K, t.V);
  EXPECT_LT((from_json(three.at("weights")) - a.weights).cwiseAbs().maxCoeff(), 1e-15);
  EXPECT_LT((from_json(three.at("output")) - a.output).cwiseAbs().maxCoeff(), 1e-15);
  EXPECT_NEAR(from_json(three.at("weights"))(0, 0), 0.4011, 1e-4);  // the document's figure
  EXPECT_NEAR(from_json(three.at("scaled"))(0, 0), 0.7071, 1e-4);
}

TEST(RenderHtml, ItAttendsToAnimalWhenTiredAndToStreetWhenWide) {
  const attn_examples::ItModel model = attn_examples::it_model();
  for (const auto& [last, expected] :
       std::vector<std::pair<std::string, std::string>>{{"tired", "animal"}, {"wide", "street"}}) {
    const attn_examples::ItSentence s = attn_examples::it_sentence(last);
    const attn_examples::ItAttention a = attn_examples::it_attention(s, model);
    Index most = 0;
    a.layer2.weights.row(attn_examples::word_index(s, "it")).maxCoeff(&most);
    EXPECT_EQ(s.words[static_cast<std::size_t>(most)], expected) << "last word " << last;
    // Layer 1: "it" reads the adjective.
    a.layer1.weights.row(attn_examples::word_index(s, "it")).maxCoeff(&most);
    EXPECT_EQ(s.words[static_cast<std::size_t>(most)], last);
  }
  EXPECT_THROW(attn_examples::it_sentence("big"), std::invalid_argument);
}

TEST(RenderHtml, PageIsSelfContainedAndSaysTheWeightsAreIllustrative) {
  const std::string html = attn_examples::attention_page_html();
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0U);
  EXPECT_NE(html.find("Illustrative weights, not a trained model"), std::string::npos);
  for (const char* external : {"http:", "https:", "src=", "href=", "@import", "url("}) {
    EXPECT_EQ(html.find(external), std::string::npos) << external;
  }
  EXPECT_NE(html.find("id=\"sentence\""), std::string::npos);
  EXPECT_NE(html.find("data-most-attended"), std::string::npos);
  // Every marker of examples/page/page.html was filled, and the embedded files are all there.
  EXPECT_EQ(html.find("{{"), std::string::npos);
  EXPECT_NE(html.find(attn_examples::page_files::page_css), std::string::npos);
  EXPECT_NE(html.find(attn_examples::page_files::page_js), std::string::npos);
}

TEST(RenderHtml, PageEmbedsTheExamTraps) {
  const nlohmann::json traps = page_data(attn_examples::attention_page_html()).at("traps");
  EXPECT_EQ(traps.at("sentences").size(), 6U);
  EXPECT_NE(traps.at("sentences").at(1).get<std::string>().find("not down a column"),
            std::string::npos);
  const nlohmann::json& three = traps.at("three_tokens");
  // Recomputed here from the definitions, with plain Eigen and std::exp.
  const attn::QKV<double> t = attn_examples::three_tokens();
  const Matrix S = t.Q * t.K.transpose() / std::sqrt(2.0);
  Matrix columns = S.array().exp().matrix();
  for (Index j = 0; j < columns.cols(); ++j) columns.col(j) /= columns.col(j).sum();
  EXPECT_LT((from_json(three.at("column_weights")) - columns).cwiseAbs().maxCoeff(), 1e-15);
  EXPECT_LT((from_json(three.at("column_output")) - columns * t.V).cwiseAbs().maxCoeff(), 1e-15);
  Matrix itself = S.array().exp().matrix();
  itself.diagonal().setZero();
  for (Index i = 0; i < itself.rows(); ++i) itself.row(i) /= itself.row(i).sum();
  EXPECT_LT((from_json(three.at("self_masked_weights")) - itself).cwiseAbs().maxCoeff(), 1e-15);
  EXPECT_LT((from_json(three.at("self_masked_output")) - itself * t.V).cwiseAbs().maxCoeff(),
            1e-15);
  // The tokens reversed give the same rows, reversed.
  const Matrix reversed = from_json(three.at("reversed_output"));
  const attn::Attention<double> a = attn::attention_with_weights(t.Q, t.K, t.V);
  EXPECT_LT((reversed.colwise().reverse() - a.output).cwiseAbs().maxCoeff(), 1e-15);
  // "I love AI" with W_q reused: "I" puts 2.9% on "love" (the document's 80%).
  const nlohmann::json& love = traps.at("i_love_ai");
  EXPECT_NEAR(from_json(love.at("weights"))(0, 1), 0.7952, 1e-4);
  EXPECT_NEAR(from_json(love.at("shared_weights"))(0, 1), 0.0287, 1e-4);
}

TEST(RenderHtml, PageTemplateMarkers) {
  using attn_examples::detail::fill_markers;
  // A marker alone on its line takes the line's end with it; one inside a line does not.
  EXPECT_EQ(fill_markers("<style>\n{{css}}\n</style>", {{"css", "a {}\n"}}),
            "<style>\na {}\n</style>");
  EXPECT_EQ(fill_markers("<p>{{x}}</p>\n", {{"x", "{{y}}"}}), "<p>{{y}}</p>\n");  // not rescanned
  EXPECT_EQ(fill_markers("{{x}}\n{{x}}", {{"x", "1\n"}}), "1\n1\n");  // a file: its own line end
  EXPECT_THROW(fill_markers("{{unknown}}", {}), std::logic_error);
  EXPECT_THROW(fill_markers("{{open", {{"open", ""}}), std::logic_error);
  EXPECT_THROW(fill_markers("no markers", {{"x", "1"}}), std::logic_error);
}

}  // namespace

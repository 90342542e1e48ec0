// The ONNX `Attention` operator called the way a runtime's kernel would: the node's attributes
// and the tensors' shapes come from a model file, so the kernel first asks for the output shapes
// (`onnx::output_shapes`, which makes every check the call makes), then runs the operator, and
// turns a refused shape into the runtime's own error. Three decoding steps of a grouped-query
// node with 3-D inputs (batch, seq, heads * head_size) feed each step's present cache back as the
// next step's past. The last step's head 5 is checked against attn's single-head call.
//
//   build/examples/attn-onnx-kernel
#include <attn/attn.hpp>
#include <attn/onnx.hpp>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace onnx = attn::onnx;
using attn::Index;

std::vector<float> random_values(Index count, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<std::size_t>(count));
  for (float& x : v) x = normal(rng);
  return v;
}

std::string shape_text(const std::vector<Index>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

int main() {
  constexpr Index q_heads = 8, kv_heads = 2, head = 16;
  onnx::Attributes attributes;  // as a model's node would set them
  attributes.q_num_heads = q_heads;
  attributes.kv_num_heads = kv_heads;
  attributes.is_causal = 1;

  std::mt19937 rng(5);
  onnx::Inputs<float> in;
  in.past_key =
      onnx::Tensor<float>{{1, kv_heads, 4, head}, random_values(kv_heads * 4 * head, rng)};
  in.past_value =
      onnx::Tensor<float>{{1, kv_heads, 4, head}, random_values(kv_heads * 4 * head, rng)};
  onnx::Outputs<float> out;
  for (int step = 0; step < 3; ++step) {
    in.Q = {{1, 1, q_heads * head}, random_values(q_heads * head, rng)};
    in.K = {{1, 1, kv_heads * head}, random_values(kv_heads * head, rng)};
    in.V = {{1, 1, kv_heads * head}, random_values(kv_heads * head, rng)};
    const onnx::OutputShapes shapes = onnx::output_shapes(in, attributes);  // shape inference
    out = onnx::attention(in, attributes);
    std::printf("step %d: Y %s, present_key %s\n", step, shape_text(shapes.Y).c_str(),
                shape_text(shapes.present_key).c_str());
    in.past_key = out.present_key;  // the next step's past is this step's present
    in.past_value = out.present_value;
  }

  // Head 5 of the last step (key/value head 5 / 4 = 1) through attn's single-head call.
  const Index total = out.present_key->dim(2);
  const auto kv_head = [&](const onnx::Tensor<float>& t) {
    return Eigen::Map<const attn::Matrix<float>>(t.data.data() + 1 * total * head, total, head);
  };
  const Eigen::Map<const attn::Matrix<float>> q(in.Q.data.data() + 5 * head, 1, head);
  const attn::Matrix<float> want =
      attn::scaled_dot_product_attention(q, kv_head(*out.present_key), kv_head(*out.present_value));
  const Eigen::Map<const attn::Matrix<float>> got(out.Y.data.data() + 5 * head, 1, head);
  const float error = (got - want).cwiseAbs().maxCoeff();
  std::printf("check: head 5 differs from scaled_dot_product_attention by %.1e\n",
              static_cast<double>(error));

  // A model whose shapes do not fit: the kernel reports the library's message, nothing crashes.
  onnx::Inputs<float> hostile = in;
  hostile.Q.shape = {Index(1) << 40, Index(1) << 40, q_heads * head};
  try {
    onnx::output_shapes(hostile, attributes);
    std::printf("a hostile shape was accepted\n");
    return 1;
  } catch (const attn::shape_error& e) {
    std::printf("refused: %s\n", e.what());
  }
  return error < 1e-5f ? 0 : 1;
}

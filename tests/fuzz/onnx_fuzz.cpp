/// libFuzzer target of the ONNX adapter on shapes it did not write: the bytes choose every input's
/// rank and extents (small ones, or hostile ones: 2^20 .. INT64_MAX, negative), whether its data
/// holds as many elements as its shape says, every attribute (in and out of range), the optional
/// inputs, the outputs requested and the storage. The adapter must answer each call with its
/// outputs or a `shape_error`, never a crash, a sanitizer report or an unbounded loop, and:
/// - `output_shapes` and `attention` agree: both throw, or the outputs have the shapes it gave,
///   with as many elements as their shapes say;
/// - finite inputs with a moderate scale give a finite Y.
/// Re-run one input: ./onnx_fuzz crash-<hash> (ATTN_FUZZ_PRINT=1 prints the call first).

#include <fuzzer/FuzzedDataProvider.h>

#include <attn/onnx.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace {

using attn::Index;
namespace onnx = attn::onnx;

constexpr Index kMaxElements = 512;  // data held per input, so that a run stays fast

/// What the calls came to, printed at exit: a run that only ever meets errors tests little.
struct Counts {
  long refused = 0, computed = 0, too_large = 0;
  ~Counts() {
    std::fprintf(stderr,
                 "onnx_fuzz: %ld calls refused (shape_error), %ld computed, %ld accepted "
                 "but too large to compute here\n",
                 refused, computed, too_large);
  }
} counts;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "onnx_fuzz: %s\n", what.c_str());
  std::abort();
}

/// An extent: mostly small, sometimes one of the values a hostile model file may hold.
Index extent(FuzzedDataProvider& in) {
  static constexpr Index hostile[] = {0,
                                      1,
                                      -1,
                                      Index(1) << 20,
                                      Index(1) << 31,
                                      Index(1) << 40,
                                      Index(1) << 62,
                                      std::numeric_limits<Index>::max(),
                                      std::numeric_limits<Index>::min()};
  if (in.ConsumeIntegralInRange<int>(0, 7) != 0) return in.ConsumeIntegralInRange<Index>(0, 6);
  return hostile[in.ConsumeIntegralInRange<std::size_t>(0, std::size(hostile) - 1)];
}

/// The product of the extents when all are non-negative and it is at most kMaxElements.
std::optional<Index> small_count(const std::vector<Index>& shape) {
  Index count = 1;
  bool empty = false;
  for (const Index e : shape) {
    if (e < 0) return std::nullopt;
    if (e == 0) {
      empty = true;
      continue;
    }
    if (e > kMaxElements || count * e > kMaxElements) return std::nullopt;
    count *= e;
  }
  return empty ? 0 : count;
}

/// A value: in [-4, 4], or (rarely, when `specials`) an infinity or NaN.
template <class S>
S value(FuzzedDataProvider& in, bool specials) {
  if (specials && in.ConsumeIntegralInRange<int>(0, 31) == 0) {
    switch (in.ConsumeIntegralInRange<int>(0, 2)) {
      case 0:
        return std::numeric_limits<S>::infinity();
      case 1:
        return -std::numeric_limits<S>::infinity();
      default:
        return std::numeric_limits<S>::quiet_NaN();
    }
  }
  return static_cast<S>(in.ConsumeIntegralInRange<int>(-64, 64)) / S(16);
}

/// A tensor of the given rank: its shape from `shape` (the first `rank` extents) or drawn, its
/// data as many elements as the shape says when that is small, else (or when the bytes say so) a
/// wrong count.
template <class S>
onnx::Tensor<S> tensor(FuzzedDataProvider& in, std::vector<Index> shape, bool specials,
                       bool& finite) {
  onnx::Tensor<S> t;
  t.shape = std::move(shape);
  const std::optional<Index> count = small_count(t.shape);
  Index held = count ? *count : in.ConsumeIntegralInRange<Index>(0, 8);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) held = in.ConsumeIntegralInRange<Index>(0, 8);
  t.data.resize(static_cast<std::size_t>(held));
  for (std::size_t i = 0; i < t.data.size(); ++i) {
    if constexpr (std::is_same_v<S, bool>) {
      t.data[i] = in.ConsumeBool();
    } else {
      t.data[i] = value<S>(in, specials);
      if (!std::isfinite(t.data[i])) finite = false;
    }
  }
  return t;
}

std::vector<Index> shape_of_rank(FuzzedDataProvider& in, Index rank) {
  std::vector<Index> shape(static_cast<std::size_t>(rank));
  for (Index& e : shape) e = extent(in);
  return shape;
}

std::int64_t attribute(FuzzedDataProvider& in, std::int64_t usual_low, std::int64_t usual_high) {
  static constexpr std::int64_t hostile[] = {-2,
                                             -1,
                                             0,
                                             std::int64_t(1) << 40,
                                             std::numeric_limits<std::int64_t>::max(),
                                             std::numeric_limits<std::int64_t>::min()};
  if (in.ConsumeIntegralInRange<int>(0, 7) != 0) {
    return in.ConsumeIntegralInRange<std::int64_t>(usual_low, usual_high);
  }
  return hostile[in.ConsumeIntegralInRange<std::size_t>(0, std::size(hostile) - 1)];
}

template <class T>
void run(FuzzedDataProvider& in) {
  bool finite = true;  // every input value finite (checked for Y below)
  const bool specials = in.ConsumeBool();
  // Q, K, V: rank 3 or 4 mostly, any rank 0..5 sometimes; extents shared or drawn per input.
  const Index rank = in.ConsumeIntegralInRange<int>(0, 7) == 0
                         ? in.ConsumeIntegralInRange<Index>(0, 5)
                         : in.ConsumeIntegralInRange<Index>(3, 4);
  const std::vector<Index> base = shape_of_rank(in, rank);
  const auto near_base = [&]() {
    std::vector<Index> shape = base;
    for (Index& e : shape) {
      if (in.ConsumeIntegralInRange<int>(0, 3) == 0) e = extent(in);
    }
    return shape;
  };
  onnx::Inputs<T> inputs;
  inputs.Q = tensor<T>(in, near_base(), specials, finite);
  inputs.K = tensor<T>(in, near_base(), specials, finite);
  inputs.V = tensor<T>(in, near_base(), specials, finite);
  onnx::Attributes a;
  a.is_causal = attribute(in, 0, 1);
  a.q_num_heads = attribute(in, 0, 4);
  a.kv_num_heads = attribute(in, 0, 4);
  a.qk_matmul_output_mode = attribute(in, 0, 3);
  a.softmax_precision = in.ConsumeBool() ? 0 : attribute(in, 0, 16);
  a.left_window_size = attribute(in, -1, 6);
  a.right_window_size = attribute(in, -1, 6);
  bool moderate_scale = true;
  if (in.ConsumeBool()) {
    static constexpr double scales[] = {0.5, -0.25, 1e-38, 1e30, 1e300, 0.0};
    a.scale = scales[in.ConsumeIntegralInRange<std::size_t>(0, std::size(scales) - 1)];
    moderate_scale = std::abs(*a.scale) <= 1.0;
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    static constexpr double caps[] = {0.0, 2.5, 30.0, -1.0, 1e300};
    a.softcap = caps[in.ConsumeIntegralInRange<std::size_t>(0, std::size(caps) - 1)];
  }
  // The optional inputs.
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 1: {
      bool mask_finite = true;
      inputs.attn_mask = tensor<T>(in, shape_of_rank(in, in.ConsumeIntegralInRange<Index>(0, 5)),
                                   specials, mask_finite);
      for (const T x : inputs.attn_mask->data) {  // -inf masks a key; NaN and +inf may reach Y
        if (std::isnan(x) || x == std::numeric_limits<T>::infinity()) finite = false;
      }
      break;
    }
    case 2: {
      bool unused = true;
      inputs.attn_bool_mask = tensor<bool>(
          in, shape_of_rank(in, in.ConsumeIntegralInRange<Index>(0, 5)), false, unused);
      break;
    }
    default:
      break;
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    std::vector<Index> past = base.size() == 4 ? base : shape_of_rank(in, 4);
    past.resize(4, 1);
    if (in.ConsumeBool()) past[2] = extent(in);
    inputs.past_key = tensor<T>(in, past, specials, finite);
    if (in.ConsumeIntegralInRange<int>(0, 7) != 0) {  // else past_value is missing: an error
      std::vector<Index> past_v = past;
      if (!inputs.V.shape.empty()) past_v[3] = inputs.V.shape.back();
      if (in.ConsumeIntegralInRange<int>(0, 3) == 0) past_v = shape_of_rank(in, 4);
      inputs.past_value = tensor<T>(in, past_v, specials, finite);
    }
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    std::vector<std::int64_t> lengths(in.ConsumeIntegralInRange<std::size_t>(0, 4));
    for (auto& length : lengths) length = attribute(in, 0, 8);
    inputs.nonpad_kv_seqlen = lengths;
  }
  const onnx::OutputRequest request{in.ConsumeBool(), in.ConsumeBool()};
  static constexpr attn::KVStorage storages[] = {attn::KVStorage::Same, attn::KVStorage::Same,
                                                 attn::KVStorage::Float16,
                                                 attn::KVStorage::BFloat16, attn::KVStorage::Int8};
  const attn::KVStorage storage =
      storages[in.ConsumeIntegralInRange<std::size_t>(0, std::size(storages) - 1)];

  if (std::getenv("ATTN_FUZZ_PRINT") != nullptr) {
    std::string text = "Q (";
    for (const Index e : inputs.Q.shape) text += std::to_string(e) + " ";
    text += ") K (";
    for (const Index e : inputs.K.shape) text += std::to_string(e) + " ";
    text += ") V (";
    for (const Index e : inputs.V.shape) text += std::to_string(e) + " ";
    std::fprintf(stderr, "%s)\n", text.c_str());
  }

  std::optional<onnx::OutputShapes> shapes;
  std::string refused;
  try {
    shapes = onnx::output_shapes(inputs, a, request, storage);
  } catch (const attn::shape_error& e) {
    refused = e.what();
  }
  if (!shapes) {
    try {
      (void)onnx::attention(inputs, a, request, storage);
    } catch (const attn::shape_error&) {
      ++counts.refused;
      return;  // both refuse
    }
    fail("output_shapes refused (" + refused + ") but attention ran");
  }
  // Outputs too large to compute in a fuzzing run are left out (the shapes were still checked).
  constexpr Index cap = Index(1) << 24;
  Index elements = 0;
  for (const std::vector<Index>* shape :
       {&shapes->Y, &shapes->present_key, &shapes->present_value, &shapes->qk_matmul_output}) {
    Index count = shape->empty() ? 0 : 1;  // saturating at cap
    for (const Index e : *shape) count = std::min(count * std::min(e, cap), cap);
    elements += count;
  }
  if (elements > (Index(1) << 20)) {
    ++counts.too_large;
    return;
  }
  ++counts.computed;
  onnx::Outputs<T> out;
  try {
    out = onnx::attention(inputs, a, request, storage);
  } catch (const attn::shape_error& e) {
    fail(std::string("output_shapes accepted but attention refused: ") + e.what());
  }
  const auto check = [](const char* name, const std::vector<Index>& expected,
                        const onnx::Tensor<T>& t) {
    if (t.shape != expected) fail(std::string(name) + ": shape differs from output_shapes");
    Index count = 1;
    for (const Index e : t.shape) count *= e;
    if (count != static_cast<Index>(t.data.size())) fail(std::string(name) + ": wrong data size");
  };
  check("Y", shapes->Y, out.Y);
  if (request.present) {
    if (!out.present_key || !out.present_value) fail("present outputs missing");
    check("present_key", shapes->present_key, *out.present_key);
    check("present_value", shapes->present_value, *out.present_value);
  }
  if (request.qk_matmul_output) {
    if (!out.qk_matmul_output) fail("qk_matmul_output missing");
    check("qk_matmul_output", shapes->qk_matmul_output, *out.qk_matmul_output);
  }
  if (finite && moderate_scale) {
    for (const T y : out.Y.data) {
      if (!std::isfinite(y)) fail("finite inputs with |scale| <= 1 gave a non-finite Y");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    run<double>(in);
  } else {
    run<float>(in);
  }
  return 0;
}

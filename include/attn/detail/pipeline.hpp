#pragma once
/// \file detail/pipeline.hpp
/// The argument checks of every single-head attention call (the score rule itself is in
/// detail/score_rule.hpp).

#include <algorithm>
#include <cmath>
#include <limits>

#include "../error.hpp"
#include "../projection.hpp"
#include "../types.hpp"
#include "score_rule.hpp"
#include "stored.hpp"

namespace attn {
namespace detail {

/// Checks the operands and options of an attention call (n queries, m keys).
template <class DQ, class DK, class DV>
void check_attention(const char* function, const Eigen::MatrixBase<DQ>& Q,
                     const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                     const AttentionOptions<typename DQ::Scalar>& options) {
  require_same_scalar<DQ, DK>();
  require_same_scalar<DQ, DV>();
  require_width(function, "Q", Q);
  require_same_cols(function, "K", K, "Q", Q);
  require_same_rows(function, "V", V, "K", K);
  check_options(function, options, Q.rows(), K.rows());
}

/// `check_attention` for the calls that also take keys and values in `Eigen::half` or
/// `Eigen::bfloat16` (with queries and results in T): K and V share one scalar type, T or one of
/// those two.
template <class DQ, class DK, class DV>
void check_attention_kv(const char* function, const Eigen::MatrixBase<DQ>& Q,
                        const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                        const AttentionOptions<typename DQ::Scalar>& options) {
  using S = typename DK::Scalar;
  static_assert(std::is_same_v<S, typename DV::Scalar>, "K and V must have the same scalar type");
  static_assert(std::is_same_v<S, typename DQ::Scalar> || is_narrow_scalar_v<S>,
                "K and V must have Q's scalar type, Eigen::half or Eigen::bfloat16");
  require_width(function, "Q", Q);
  require_same_cols(function, "K", K, "Q", Q);
  require_same_rows(function, "V", V, "K", K);
  check_options(function, options, Q.rows(), K.rows());
}

}  // namespace detail
}  // namespace attn

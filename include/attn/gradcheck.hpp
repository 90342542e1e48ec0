#pragma once
/// \file gradcheck.hpp
/// A finite-difference gradient checker for any scalar loss of matrices: `numerical_gradient`
/// estimates d f / d inputs[k] entry by entry, `gradcheck` compares an analytic gradient with it
/// and names the worst entry. A testing tool, in double; not included by attn.hpp.
///
/// Method: the fourth-order central difference (the five-point stencil)
///
///     df/dx ~ (f(x - 2h) - 8 f(x - h) + 8 f(x + h) - f(x + 2h)) / (12 h),
///     h = step * max(1, |x|)   (h = step for an infinite x),
///
/// one entry at a time, all other entries at their given values. It is evaluated as
/// `(8 (f(x + h) - f(x - h)) - (f(x + 2h) - f(x - 2h))) / (12 h)`, so that equal values of f give
/// exactly 0: an infinite entry (a -inf bias that masks a key) stays itself under any finite
/// perturbation, and its numeric gradient is 0 (or NaN when f is not finite there). Its error has
/// two parts:
/// - truncation, `h^4 / 30 |f^(5)(xi)|` for some xi within 2h of x: zero for a polynomial of degree
///   at most 4 in that entry (so exact, up to rounding, for a loss linear or bilinear in its
///   inputs);
/// - rounding, about `eps |f| / h` (each f rounded by eps / 2 relative, the stencil's weights
///   summing to 18 / 12 in absolute value; eps = 2^-52), plus `eps |x| |df/dx| / h` from rounding
///   the perturbed points x + c h, plus whatever error f's own evaluation carries, divided by h.
/// The default h = 1e-3 is near the step that balances the two, eps^(1/5) ~ 7e-4: for f and its
/// derivatives of order 1, both parts are about 1e-13 to 1e-12, far below the default tolerance
/// (rtol 1e-7, atol 1e-9), which leaves room for the rounding of a loss computed through many
/// operations. An f evaluated in float (or through a float path) needs a larger step and looser
/// tolerances: its rounding, about 6e-8 |f| / h, dominates.
///
/// Usage, with a loss of two matrices and a sink logit (a 1 x 1 matrix):
///
///     const auto loss = [&](const std::vector<attn::Matrix<double>>& in) { ... return L; };
///     const attn::GradcheckResult r = attn::gradcheck(loss, {X, W, sink}, {dX, dW, dsink});
///     EXPECT_TRUE(r) << r.message;

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "error.hpp"
#include "types.hpp"

namespace attn {

/// The step and the tolerances of `gradcheck`.
struct GradcheckOptions {
  double step = 1e-3;  ///< h, scaled by max(1, |x|) per entry; finite and > 0
  /// An entry passes when |analytic - numeric| <= atol + rtol |numeric|; both finite and >= 0.
  double rtol = 1e-7;
  double atol = 1e-9;  ///< see rtol
};

/// What `gradcheck` found: whether every entry passed, and the worst entry (the largest error
/// relative to its allowance), which it reports also when all pass.
struct GradcheckResult {
  /// Whether every entry passed.
  bool passed = true;
  double worst_error = 0;  ///< max over entries of |a - n| / (atol + rtol |n|)  (<= 1 passes)
  std::size_t input = 0;   ///< the worst entry: which input, row, column, both values
  /// The worst entry's row in its input.
  Index row = 0, col = 0;
  /// The worst entry's analytic derivative (the one given).
  double analytic = 0, numeric = 0;
  /// \var col
  /// The worst entry's column in its input.
  /// \var numeric
  /// The worst entry's numeric derivative (the central difference).

  std::string message;  ///< human-readable: names input/row/col/values (for gtest output)
  /// Whether every entry passed.
  /// \returns `passed`
  explicit operator bool() const { return passed; }
};

namespace detail {

/// Requires a finite step > 0.
/// \throws shape_error naming `function` and the step.
inline void require_gradcheck_step(const char* function, double step) {
  if (!(std::isfinite(step) && step > 0.0)) {
    fail(function, "step must be finite and > 0, got ", step);
  }
}

}  // namespace detail

/// d f / d inputs[k] for every k, by the fourth-order central difference (see the file comment):
/// `(f(x - 2h) - 8 f(x - h) + 8 f(x + h) - f(x + 2h)) / (12 h)` with `h = step * max(1, |x|)`, one
/// entry at a time (an infinite entry gets h = step and, f not changing, gradient 0). The inputs
/// are copied once; each entry of the copy is perturbed in place and then restored exactly (to
/// its original bits), so f always sees the given inputs with at most one entry changed.
/// \param f       callable as `double(const std::vector<Matrix<double>>& inputs)`: the loss
/// \param inputs  the point: any number of matrices of any shapes (a scalar as 1 x 1)
/// \param step    h before scaling, finite and > 0
/// \returns one matrix per input, of its shape: the estimated gradient.
/// \throws shape_error if step is not finite and positive; whatever f throws.
/// \note 4 calls of f per entry of the inputs; one copy of the inputs plus the result.
template <class F>
std::vector<Matrix<double>> numerical_gradient(F&& f, const std::vector<Matrix<double>>& inputs,
                                               double step = 1e-3) {
  detail::require_gradcheck_step("numerical_gradient", step);
  std::vector<Matrix<double>> x = inputs;
  std::vector<Matrix<double>> gradient;
  gradient.reserve(x.size());
  for (std::size_t k = 0; k < x.size(); ++k) {
    gradient.emplace_back(x[k].rows(), x[k].cols());
    for (Index i = 0; i < x[k].rows(); ++i) {
      for (Index j = 0; j < x[k].cols(); ++j) {
        const double x_ij = x[k](i, j);
        const double h = std::isfinite(x_ij) ? step * std::max(1.0, std::abs(x_ij)) : step;
        const auto f_at = [&](double c) {  // f with entry (i, j) of input k at x_ij + c h
          x[k](i, j) = x_ij + c * h;
          return static_cast<double>(f(std::as_const(x)));
        };
        const double minus_2h = f_at(-2.0);
        const double minus_h = f_at(-1.0);
        const double plus_h = f_at(1.0);
        const double plus_2h = f_at(2.0);
        x[k](i, j) = x_ij;
        gradient[k](i, j) = (8.0 * (plus_h - minus_h) - (plus_2h - minus_2h)) / (12.0 * h);
      }
    }
  }
  return gradient;
}

/// Compares an analytic gradient with `numerical_gradient(f, inputs, options.step)`, entry by
/// entry: an entry passes when `|analytic - numeric| <= atol + rtol |numeric|` (NaN never passes).
/// \param f         callable as `double(const std::vector<Matrix<double>>& inputs)`: the loss
/// \param inputs    the point: any number of matrices (a scalar as 1 x 1)
/// \param analytic  one matrix per input, of its shape: the gradient under test
/// \param options   step, rtol, atol
/// \returns whether every entry passed, the worst entry (input, row, col, both values, its
///          error relative to its allowance) and a message naming them for test output.
/// \throws shape_error if analytic does not have one matrix of each input's shape, or an option
///         is out of range (step not finite and > 0, rtol or atol not finite and >= 0); whatever f
///         throws.
/// \note As `numerical_gradient`: 4 calls of f per entry.
template <class F>
GradcheckResult gradcheck(F&& f, const std::vector<Matrix<double>>& inputs,
                          const std::vector<Matrix<double>>& analytic,
                          const GradcheckOptions& options = {}) {
  constexpr const char* function = "gradcheck";
  detail::require_gradcheck_step(function, options.step);
  if (!(std::isfinite(options.rtol) && options.rtol >= 0.0 && std::isfinite(options.atol) &&
        options.atol >= 0.0)) {
    detail::fail(function, "rtol and atol must be finite and >= 0, got rtol = ", options.rtol,
                 " and atol = ", options.atol);
  }
  if (analytic.size() != inputs.size()) {
    detail::fail(function, "analytic has ", analytic.size(), " matrices but inputs has ",
                 inputs.size(), " (one gradient per input)");
  }
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    if (analytic[k].rows() != inputs[k].rows() || analytic[k].cols() != inputs[k].cols()) {
      detail::fail(function, "analytic[", k, "] is ", detail::shape_of(analytic[k]), " but inputs[",
                   k, "] is ", detail::shape_of(inputs[k]), " (a gradient has its input's shape)");
    }
  }
  const std::vector<Matrix<double>> numeric = numerical_gradient(f, inputs, options.step);

  GradcheckResult result;
  double worst = -1.0;  // below any entry's, so that the first entry is taken
  Index failures = 0;
  Index entries = 0;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    for (Index i = 0; i < inputs[k].rows(); ++i) {
      for (Index j = 0; j < inputs[k].cols(); ++j) {
        const double a = analytic[k](i, j);
        const double n = numeric[k](i, j);
        const double difference = std::abs(a - n);
        const double allowance = options.atol + options.rtol * std::abs(n);
        const bool pass = difference <= allowance;  // false for NaN
        double ratio = std::numeric_limits<double>::infinity();
        if (pass) {
          ratio = allowance > 0.0 ? std::min(difference / allowance, 1.0) : 0.0;
        } else if (allowance > 0.0 && std::isfinite(difference)) {
          ratio = std::max(difference / allowance, 1.0);  // > 1 (up to its rounding)
        }
        ++entries;
        if (!pass) ++failures;
        if (ratio > worst) {
          worst = ratio;
          result.input = k;
          result.row = i;
          result.col = j;
          result.analytic = a;
          result.numeric = n;
        }
      }
    }
  }
  result.passed = failures == 0;
  result.worst_error = std::max(worst, 0.0);

  std::ostringstream message;  // the two values in full, the rest to 6 digits
  const auto exact = [](double value) {
    std::ostringstream out;
    out.precision(std::numeric_limits<double>::max_digits10);
    out << value;
    return out.str();
  };
  message << "gradcheck " << (result.passed ? "passed" : "FAILED") << ": ";
  if (entries == 0) {
    message << "no entries to check";
  } else {
    message << failures << " of " << entries << " entries fail; worst at input " << result.input
            << " (" << detail::shape_of(inputs[result.input]) << "), row " << result.row << ", col "
            << result.col << ": analytic " << exact(result.analytic) << ", numeric "
            << exact(result.numeric) << ", |difference| "
            << std::abs(result.analytic - result.numeric) << ", allowed "
            << options.atol + options.rtol * std::abs(result.numeric) << " (atol " << options.atol
            << " + rtol " << options.rtol << " |numeric|), worst_error " << result.worst_error
            << " (<= 1 passes; step " << options.step << ")";
  }
  result.message = message.str();
  return result;
}

}  // namespace attn

#pragma once
/// \file attn.hpp
/// The umbrella header: `#include <attn/attn.hpp>` brings the whole library, each part of which
/// also has a header of its own. Its comment is the reference's main page.
///
/// \mainpage API reference
///
/// `attn` is a header-only C++17 library on Eigen 3.4: self-attention exact enough to reproduce a
/// textbook by hand. This reference is generated from the doc comments of the public headers
/// (`cmake --build build --target attn_docs`); docs/API.md is the guide to the same names, and
/// docs/conventions.md states the rules every call follows.
///
/// \section glossary Glossary of dimension names
///
/// One name per dimension, in every signature and comment (the glossary of docs/design.md):
/// - `n`: queries, the rows of Q and of the output
/// - `m`: keys and values, the rows of K and V (a cache's `size()`)
/// - `d_in`: width of the embeddings X that a projection takes
/// - `d_k`: width of one query or key head
/// - `d_v`: width of one value head and of one head's output
/// - `d`: one head's width where `d_k = d_v`, or the width RoPE rotates
/// - `heads`: query heads
/// - `kv_heads`: key/value heads (fewer than `heads` for grouped-query attention)
/// - `group`: query heads per key/value head, `heads / kv_heads`; query head h reads key/value head
///   `h / group`
/// - `batch`: sequences of a batch (index `b`)
/// - `d_model`: width of the layer's input and output (`MultiHeadConfig::embed_dim`)
/// - `head_dim`: `d_model / heads`, the layer's `d_k` and `d_v`
/// - `kdim`, `vdim`: widths of the layer's key and value inputs (PyTorch's names)
/// - `d_rot`: features RoPE rotates (`RopeOptions::rotary_dim`)
/// - `w`, `r`: left and right window (`window`, `window_right`)
/// - `P`, `N`, `M`: ranks of a ring; queries and keys of the whole sequence
/// - `n_r`, `m_r`: queries and keys held by rank r
///
/// Shapes are written `n x d_k` for a matrix and `(heads, n, d_k)` for a row-major tensor.
///
/// \section conventions Conventions
///
/// One row per token; `Q = X W_Q` with `W_Q` of shape (d_in, d_k); boolean masks mean `true` = may
/// attend; a query that may attend nothing gets zero weights and a zero output. A failed check
/// throws `attn::shape_error` (unless another type is named); every check stays on in release
/// builds.
///
/// \section headers Headers
///
/// The umbrella header brings the library only. Four headers are included on their own:
/// `<attn/render.hpp>` (pictures of attention tables: SVG and terminal heatmaps, which need
/// `<cstdio>`, `<locale>` and the platform's `isatty`), `<attn/onnx.hpp>` (the ONNX `Attention`
/// operator), `<attn/gradcheck.hpp>` (a gradient checker for tests) and `<attn/distributed.hpp>`
/// (`ring_attention` across MPI processes).

/// \namespace attn
/// Every public name of the library. The namespace `attn::detail` holds the internals, which are
/// not part of the API and are left out of this reference.

#include "attention.hpp"
#include "backward.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "heads.hpp"
#include "kv_cache.hpp"
#include "kv_store.hpp"
#include "mask.hpp"
#include "multi_head.hpp"
#include "paged_kv_cache.hpp"
#include "positional.hpp"
#include "projection.hpp"
#include "scores.hpp"
#include "simd.hpp"
#include "softmax.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"
#include "variant.hpp"
#include "varlen.hpp"
#include "version.hpp"

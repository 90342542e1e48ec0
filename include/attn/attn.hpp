#pragma once
/// \file attn.hpp
/// `attn`: self-attention on Eigen, exact enough to reproduce a textbook by hand.
///
/// Glossary of dimension names used throughout the documentation:
/// - `n`        number of queries (rows of Q and of the output)
/// - `m`        number of keys and values (rows of K and V)
/// - `d_in`     width of the token embeddings X
/// - `d_k`      width of queries and keys
/// - `d_v`      width of values and of the output
/// - `heads`    query heads; `kv_heads` key/value heads (fewer for grouped-query attention)
///
/// Conventions: one row per token; `Q = X W_Q` with `W_Q` of shape (d_in, d_k); boolean masks mean
/// `true` = may attend; a query that may attend nothing gets zero weights and a zero output.
///
/// This header brings the library only. Pictures of attention tables (SVG and terminal heatmaps,
/// which need `<cstdio>`, `<locale>` and the platform's `isatty`) are one include away:
/// `#include <attn/render.hpp>`.

#include "attention.hpp"
#include "backward.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "heads.hpp"
#include "kv_cache.hpp"
#include "kv_store.hpp"
#include "mask.hpp"
#include "multi_head.hpp"
#include "positional.hpp"
#include "projection.hpp"
#include "scores.hpp"
#include "simd.hpp"
#include "softmax.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"
#include "version.hpp"

#!/usr/bin/env python3
"""Writes rope_yarn.json: YaRN-scaled rotary position embedding (Peng, Quesnelle, Fan and Shippole
2023, "YaRN: Efficient Context Window Extension of Large Language Models", as Hugging Face
transformers computes rope_type "yarn" with its default truncate = True), evaluated in float64
directly from the formula, independently of the C++ code it tests.

With d = d_rot rotated features, base b, factor s, trained context length L:
    f_i       = b^(-2i/d), i = 0 .. d/2 - 1              (extrapolated frequencies)
    corr(r)   = d ln(L / (2 pi r)) / (2 ln b)             (the pair turning r times over L)
    low       = max(floor(corr(beta_fast)), 0)
    high      = min(ceil(corr(beta_slow)), d - 1)         (+ 0.001 when equal to low)
    ramp_i    = clip((i - low) / (high - low), 0, 1),  w_i = 1 - ramp_i
    freq_i    = f_i / s * (1 - w_i) + f_i * w_i
    mscale    = 0.1 ln s + 1                              (the default attention factor)
Row r of X (position offset + r) has pair i rotated by theta = position * freq_i,
(a, b) -> mscale (a cos - b sin, a sin + b cos); features past d_rot pass through unchanged.
Pairs: "half" = (i, i + d_rot/2), "interleaved" = (2i, 2i + 1).

Usage (NumPy only; the system interpreter has it):
    /usr/bin/python3 tests/data/make_yarn.py          # rewrites tests/data/rope_yarn.json
"""

import json
import math
import os

import numpy as np

N_ROWS = 6
D = 16
PARTIAL_ROTARY_DIM = 12
BASE = 10000.0
FACTOR = 4.0
ORIGINAL_MAX_POSITIONS = 32
BETA_FAST = 32.0
BETA_SLOW = 1.0
OFFSET = 29  # positions 29 .. 34: inside and past L
SEED = 20230831


def yarn_frequencies(d_rot):
    """The blended frequencies of the d_rot / 2 pairs, and (low, high)."""
    i = np.arange(d_rot // 2, dtype=np.float64)
    extrapolated = BASE ** (-2.0 * i / d_rot)
    interpolated = extrapolated / FACTOR

    def correction_dim(rotations):
        return d_rot * math.log(ORIGINAL_MAX_POSITIONS / (2.0 * math.pi * rotations)) / (
            2.0 * math.log(BASE))

    low = max(math.floor(correction_dim(BETA_FAST)), 0)
    high = min(math.ceil(correction_dim(BETA_SLOW)), d_rot - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    w = 1.0 - ramp  # extrapolation weight
    return interpolated * (1.0 - w) + extrapolated * w, low, high


def attention_factor():
    return 0.1 * math.log(FACTOR) + 1.0


def yarn_rope(X, style, d_rot):
    freq, _, _ = yarn_frequencies(d_rot)
    mscale = attention_factor()
    half = d_rot // 2
    Y = X.copy()
    for r in range(X.shape[0]):
        theta = float(OFFSET + r) * freq
        c = mscale * np.cos(theta)
        s = mscale * np.sin(theta)
        if style == "half":
            a_idx = np.arange(half)
            b_idx = a_idx + half
        else:
            a_idx = 2 * np.arange(half)
            b_idx = a_idx + 1
        a = X[r, a_idx]
        b = X[r, b_idx]
        Y[r, a_idx] = a * c - b * s
        Y[r, b_idx] = a * s + b * c
    return Y


def rows(M):
    return [[float(v) for v in row] for row in np.atleast_2d(M)]


def main():
    rng = np.random.default_rng(SEED)
    # Multiples of 1/64 in [-2, 2]: exact in float32 as well.
    X = rng.integers(-128, 129, size=(N_ROWS, D)).astype(np.float64) / 64.0
    freq, low, high = yarn_frequencies(D)
    freq_partial, _, _ = yarn_frequencies(PARTIAL_ROTARY_DIM)
    case = {
        "name": "rope_yarn",
        "description": (
            "YaRN rotary position embedding (Peng et al. 2023; Hugging Face rope_type yarn), "
            f"d = {D}, base {BASE:g}, factor s = {FACTOR:g}, original max positions "
            f"L = {ORIGINAL_MAX_POSITIONS}, beta_fast {BETA_FAST:g}, beta_slow {BETA_SLOW:g}, "
            f"default attention factor 0.1 ln s + 1, positions start at offset {OFFSET}; "
            f"correction range low = {low}, high = {high}; Y_half_rotary_dim_12 rotates only "
            f"the first {PARTIAL_ROTARY_DIM} features (d_rot = {PARTIAL_ROTARY_DIM} in the "
            "formula)"),
        "generator": f"tests/data/make_yarn.py, NumPy {np.__version__}, float64, from the formula",
        "params": {
            "base": BASE,
            "offset": OFFSET,
            "yarn_factor": FACTOR,
            "yarn_original_max_positions": ORIGINAL_MAX_POSITIONS,
            "yarn_beta_fast": BETA_FAST,
            "yarn_beta_slow": BETA_SLOW,
            "rotary_dim_partial": PARTIAL_ROTARY_DIM,
        },
        "inputs": {"X": rows(X)},
        "expected": {
            "frequencies": rows(freq),
            "frequencies_rotary_dim_12": rows(freq_partial),
            "attention_factor": [[attention_factor()]],
            "Y_half": rows(yarn_rope(X, "half", D)),
            "Y_interleaved": rows(yarn_rope(X, "interleaved", D)),
            "Y_half_rotary_dim_12": rows(yarn_rope(X, "half", PARTIAL_ROTARY_DIM)),
        },
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rope_yarn.json")
    with open(path, "w") as out:
        json.dump(case, out, separators=(",", ":"))
        out.write("\n")
    print(f"wrote {path}: low = {low}, high = {high}, frequencies = {freq}")


if __name__ == "__main__":
    main()

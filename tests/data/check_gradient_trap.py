#!/usr/bin/env python3
"""Recomputes the walkthrough's Part 6 trap table (examples/walkthrough/part6_gradients.cpp) with
NumPy, independently of attn, and prints the figures tests/check_walkthrough.cmake expects.

The measurement: for d_k = 16, 32, ..., 1024, Q and K are 64 x d_k with N(0, 1) entries, so each
raw score Q_i . K_j has variance d_k. P = softmax of each row of S, with S = Q K^T / sqrt(d_k)
("scaled") or S = Q K^T ("unscaled"). For the loss L = sum(G o P), G a fixed 64 x 64 N(0, 1) table,
dL/dP = G, and the gradient at the softmax's input is dS = P o (G - rowsum(G o P)) (the softmax's
Jacobian diag(p) - p p^T applied to each row of G). Per row: its largest weight and ||dS_i||;
the table gives the medians over the 64 rows; the summary adds ||dS||_F over the whole table and
the count of rows whose largest weight exceeds 0.99.

The random numbers are the C++ program's: splitmix64 (Steele, Lea and Flood 2014) from seed 6,
uniforms u = ((z >> 11) + 1) 2^-53 in (0, 1], one normal per two uniforms by Box-Muller,
sqrt(-2 ln u1) cos(2 pi u2); drawn in this order: G (64 x 64), then for each d_k Q and K
(64 x d_k each), every matrix row by row.

Usage (NumPy only; the system interpreter has it):
    /usr/bin/python3 tests/data/check_gradient_trap.py
It prints the table as the walkthrough does, then the CMake expectations to paste into
tests/check_walkthrough.cmake. It fails when a printed figure lies so close to a rounding boundary
that float rounding in either program could change it.
"""

import math
import sys

import numpy as np

SEED = 6
TOKENS = 64
DIMENSIONS = [16, 32, 64, 128, 256, 512, 1024]
MASK64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self):
        return ((self.next() >> 11) + 1) * 2.0**-53

    def normal(self):
        radius = math.sqrt(-2.0 * math.log(self.uniform()))
        return radius * math.cos(2.0 * math.pi * self.uniform())

    def normal_matrix(self, rows, cols):
        return np.array([[self.normal() for _ in range(cols)] for _ in range(rows)])


def softmax_rows(S):
    E = np.exp(S - S.max(axis=1, keepdims=True))
    return E / E.sum(axis=1, keepdims=True)


def measure(P, G):
    dS = P * (G - (G * P).sum(axis=1, keepdims=True))
    largest = P.max(axis=1)
    return {
        "weight": float(np.median(largest)),
        "gradient": float(np.median(np.linalg.norm(dS, axis=1))),
        "table": float(np.linalg.norm(dS)),
        "one_hot": int((largest > 0.99).sum()),
        "largest": largest,
    }


close_calls = []


def checked(text, value, exact_text):
    """`text` (the figure as printed); notes when `value` lies within 1e-9 (relative) of the next
    rounding boundary, where the two programs' last-bit differences could print it differently."""
    for nudge in (1 + 1e-9, 1 - 1e-9):
        if exact_text(value * nudge) != text:
            close_calls.append(f"{text} ({value!r})")
    return text


def four(x):
    return checked(f"{x:.4f}", x, lambda v: f"{v:.4f}")


def sci(x):
    return checked(f"{x:.2e}", x, lambda v: f"{v:.2e}")


def main():
    random = SplitMix64(SEED)
    G = random.normal_matrix(TOKENS, TOKENS)
    rows = []
    for d_k in DIMENSIONS:
        Q = random.normal_matrix(TOKENS, d_k)
        K = random.normal_matrix(TOKENS, d_k)
        S = Q @ K.T
        scaled = measure(softmax_rows(S / math.sqrt(d_k)), G)
        unscaled = measure(softmax_rows(S), G)
        for side in (scaled, unscaled):  # the 0.99 threshold must not be a close call either
            if np.any(np.abs(side["largest"] - 0.99) < 1e-9):
                close_calls.append(f"a largest weight of 0.99 at d_k = {d_k}")
        rows.append((d_k, scaled, unscaled))

    print("d_k  max weight scaled  unscaled  grad norm scaled  unscaled")
    expectations = []
    for d_k, s, u in rows:
        figures = [str(d_k), four(s["weight"]), four(u["weight"]), sci(s["gradient"]),
                   sci(u["gradient"])]
        print("  ".join(figures))
        expectations.append(f'expect_row("trap d_k = {d_k}" ' +
                            " ".join(f'"{f}"' for f in figures) + ")")
    first_d, first_s, first_u = rows[0]
    last_d, last_s, last_u = rows[-1]
    ratio = first_u["gradient"] / last_u["gradient"]
    most_scaled = max(s["one_hot"] for _, s, _ in rows)
    ratio_text = checked(f"{ratio:.0f}", ratio, lambda v: f"{v:.0f}")
    summary = [
        ("trap: weights go one-hot",
         f"(largest weight {four(first_u['weight'])} -> {four(last_u['weight'])})"),
        ("trap: gradients vanish",
         f"({sci(first_u['gradient'])} -> {sci(last_u['gradient'])}, {ratio_text} times smaller)"),
        ("trap: one-hot rows, unscaled",
         f"unscaled: {first_u['one_hot']} of {TOKENS} at d_k = {first_d}, "
         f"{last_u['one_hot']} of {TOKENS} at d_k = {last_d};"),
        ("trap: one-hot rows, scaled",
         f"scaled: 0 of {TOKENS} at every d_k" if most_scaled == 0
         else f"scaled: at most {most_scaled} of {TOKENS}"),
        ("trap: whole-table norm",
         f"(unscaled {four(first_u['table'])} -> {four(last_u['table'])}, "
         f"scaled {four(first_s['table'])} -> {four(last_s['table'])})"),
    ]
    print()
    for _, text in summary:
        print(text)
    print("\n# CMake expectations (tests/check_walkthrough.cmake):")
    for line in expectations:
        print(line)
    for name, text in summary:
        print(f'expect("{name}" "{text}")')
    if close_calls:
        print("\nclose to a rounding boundary:", ", ".join(close_calls), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

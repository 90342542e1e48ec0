#!/usr/bin/env python3
"""Recomputes the walkthrough's Part 7 (the first document's exam traps,
examples/walkthrough/part7_exam_traps.cpp and examples/exam_traps.hpp) with NumPy, independently of
attn, and prints the figures tests/check_walkthrough.cmake and tests/browser_check.cmake expect.

Inputs are the documents' own: the first document's 3 tokens (Q = K = [[1, 0], [0, 1], [1, 1]],
V = [[1, 0], [0, 1], [0.5, 0.5]], d_k = 2) and the second document's "I love AI" (X 3 x 4, W_q,
W_k, W_v 4 x 2). Every trap is computed from its definition:
  1. weights without the 1/sqrt(d_k) factor: softmax of each row of Q K^T;
  2. softmax down each column of Q K^T / sqrt(2), and the row sums of that table;
  3. the 3 tokens in the order 3, 2, 1: the outputs;
  4. "I love AI": the weights applied to Q, to K and to V;
  5. "I love AI" with W_q used for Q, K and V;
  6. the 3 tokens with each token's own key masked out (its score -inf).

Usage (NumPy only; the system interpreter has it):
    /usr/bin/python3 tests/data/check_exam_traps.py
It fails when a printed figure lies so close to a rounding boundary that float rounding in either
program could change it.
"""

import sys

import numpy as np


def softmax_rows(S):
    e = np.exp(S - S.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def four(x):
    """x with 4 decimals; refuses figures within 1e-9 of a rounding boundary."""
    scaled = abs(x) * 1e4
    if abs(scaled - np.floor(scaled) - 0.5) < 1e-9:
        sys.exit(f"check_exam_traps.py: {x!r} is too close to a rounding boundary")
    text = f"{x:.4f}"
    return "0.0000" if text == "-0.0000" else text


def weight(x):
    return "0" if x == 0 else four(x)


def row(v, figure=four):
    return "[" + ", ".join(figure(float(x)) for x in v) + "]"


def main():
    Q = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    K = Q.copy()
    V = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    scale = 1.0 / np.sqrt(2.0)
    S = Q @ K.T * scale
    P = softmax_rows(S)
    out = P @ V

    print("Trap 1: weights of Q K^T (no scaling)")
    unscaled = softmax_rows(Q @ K.T)
    for i in range(3):
        print("  row", i + 1, row(unscaled[i]))

    print("Trap 2: softmax down each column; row sums; the 'output' of row 3")
    columns = softmax_rows(S.T).T
    for i in range(3):
        print("  row", i + 1, row(columns[i]), four(columns[i].sum()))
    print("  column sums", row(columns.sum(axis=0)))
    print("  row 3 output", row((columns @ V)[2]))

    print("Trap 3: the tokens in the order 3, 2, 1")
    r = [2, 1, 0]
    reversed_out = softmax_rows(Q[r] @ K[r].T * scale) @ V[r]
    print("  " + ", ".join(row(reversed_out[i]) for i in range(3)))

    X = np.array([[1.0, 0, 1, 0], [0, 2, 0, 1], [1, 1, 1, 1]])
    W_q = np.array([[1.0, 0], [0, 1], [1, 0], [0, 1]])
    W_k = np.array([[0.0, 1], [1, 0], [0, 1], [1, 0]])
    W_v = np.array([[1.0, 0], [0, 1], [1, 1], [0, 0]])
    q, k, v = X @ W_q, X @ W_k, X @ W_v
    P2 = softmax_rows(q @ k.T * scale)
    words = ["I", "love", "AI"]
    print("Trap 4: 'I love AI', weights . Q, weights . K, weights . V")
    for i in range(3):
        print("  " + words[i], row((P2 @ q)[i]), row((P2 @ k)[i]), row((P2 @ v)[i]))

    print("Trap 5: 'I love AI' with W_q for Q, K and V: weights, output")
    Ps = softmax_rows(q @ q.T * scale)
    for i in range(3):
        print("  " + words[i], row(Ps[i]), row((Ps @ q)[i]))
    print("  diagonal", row(np.diag(Ps)), "; the document's", row(np.diag(P2)))
    print(f"  I on love: {round(100 * P2[0, 1])}% -> {round(100 * Ps[0, 1])}%;"
          f" I on itself {round(100 * Ps[0, 0])}%")

    print("Trap 6: diagonal; weights and outputs with the diagonal masked")
    print("  diagonal", row(np.diag(P)))
    M = S.copy()
    np.fill_diagonal(M, -np.inf)
    Pm = softmax_rows(M)
    for i in range(3):
        print("  row", i + 1, "weights", row(Pm[i], weight), "output", row((Pm @ V)[i]),
              "with itself", row(out[i]))


if __name__ == "__main__":
    main()

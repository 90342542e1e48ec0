#!/usr/bin/env python3
"""Writes tests/data/mha_grad_*.json: gradients of torch.nn.MultiheadAttention (PyTorch 1.13,
float64) for MultiHeadAttention::backward.

Each case draws every input and parameter as a multiple of 1/64 (exact in float32 too), runs the
layer with batch_first=True and dropout 0, and takes loss = sum(output * dO) for a given dO of
multiples of 1/64. `expected` holds the output and the gradient of every input and parameter, in
PyTorch's own layout, named after the tensors: d_query, d_key, d_value (query, key and value are
separate leaf tensors even when they hold the same values), grad_in_proj_weight (3E x E) or
grad_q/k/v_proj_weight (kdim/vdim != E), grad_in_proj_bias (3E), grad_out_proj_weight (E x E),
grad_out_proj_bias (E), grad_bias_k and grad_bias_v (E, add_bias_kv).

`inputs` follows the mha_*.json conventions: W_Q ... W_O in the X-side layout (W_Q = q_proj^T),
torch_* in PyTorch's, b_Q ... b_O, bias_k, bias_v and dO, key_valid as 0/1 with 1 = a real key
(PyTorch's key_padding_mask is its negation); a causal case masks key j > i (n == m: top-left and
bottom-right alignment agree).

Run from the repository root (the environment variable works around OpenBLAS's CPU detection on
some machines):

    OPENBLAS_CORETYPE=SkylakeX /usr/bin/python3 tests/data/make_mha_grad.py
"""

import json
import os

import numpy as np
import torch


def grid(rng, shape, bound):
    """Uniform multiples of 1/64 in [-bound, bound]."""
    steps = int(bound * 64)
    return rng.randint(-steps, steps + 1, size=shape).astype(np.float64) / 64.0


def to_list(t):
    return t.detach().numpy().tolist() if isinstance(t, torch.Tensor) else t.tolist()


def make_case(name, description, seed, batch, n, m, embed_dim, num_heads, kdim, vdim, bias,
              add_bias_kv, add_zero_attn, causal, key_valid):
    rng = np.random.RandomState(seed)
    E = embed_dim
    mha = torch.nn.MultiheadAttention(E, num_heads, dropout=0.0, bias=bias,
                                      add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                                      kdim=kdim, vdim=vdim, batch_first=True,
                                      dtype=torch.float64)
    same = mha._qkv_same_embed_dim
    W = {"Q": grid(rng, (E, E), 0.5), "K": grid(rng, (kdim, E), 0.5),
         "V": grid(rng, (vdim, E), 0.5), "O": grid(rng, (E, E), 0.5)}  # X-side: y = x W + b
    b = {k: grid(rng, (E,), 0.5) for k in "QKVO"} if bias else {}
    extra = {k: grid(rng, (E,), 1.0) for k in ("bias_k", "bias_v")} if add_bias_kv else {}
    with torch.no_grad():
        if same:
            mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate([W["Q"].T, W["K"].T,
                                                                      W["V"].T])))
        else:
            mha.q_proj_weight.copy_(torch.from_numpy(W["Q"].T.copy()))
            mha.k_proj_weight.copy_(torch.from_numpy(W["K"].T.copy()))
            mha.v_proj_weight.copy_(torch.from_numpy(W["V"].T.copy()))
        mha.out_proj.weight.copy_(torch.from_numpy(W["O"].T.copy()))
        if bias:
            mha.in_proj_bias.copy_(torch.from_numpy(np.concatenate([b["Q"], b["K"], b["V"]])))
            mha.out_proj.bias.copy_(torch.from_numpy(b["O"]))
        if add_bias_kv:
            mha.bias_k.copy_(torch.from_numpy(extra["bias_k"]).view(1, 1, E))
            mha.bias_v.copy_(torch.from_numpy(extra["bias_v"]).view(1, 1, E))

    x_query = grid(rng, (batch, n, E), 2.0)
    if kdim == E and vdim == E and n == m:  # self-attention: one sequence in three roles
        x_key, x_value = x_query.copy(), x_query.copy()
    else:
        x_key, x_value = grid(rng, (batch, m, kdim), 2.0), grid(rng, (batch, m, vdim), 2.0)
    dO = grid(rng, (batch, n, E), 1.0)
    query, key, value = (torch.tensor(a, requires_grad=True) for a in (x_query, x_key, x_value))
    padding = torch.from_numpy(~np.array(key_valid, dtype=bool))
    attn_mask = torch.triu(torch.ones(n, m, dtype=torch.bool), diagonal=1) if causal else None
    output, _ = mha(query, key, value, key_padding_mask=padding, attn_mask=attn_mask,
                    need_weights=False)
    (output * torch.from_numpy(dO)).sum().backward()

    inputs = {"query": x_query.tolist(), "key": x_key.tolist(), "value": x_value.tolist()}
    inputs.update({"W_" + k: v.tolist() for k, v in W.items()})
    inputs["torch_out_proj_weight"] = W["O"].T.tolist()
    if same:
        inputs["torch_in_proj_weight"] = to_list(mha.in_proj_weight)
    inputs.update({"b_" + k: v.tolist() for k, v in b.items()})
    inputs.update({k: v.tolist() for k, v in extra.items()})
    inputs["key_valid"] = [[1.0 if v else 0.0 for v in row] for row in key_valid]
    inputs["dO"] = dO.tolist()

    expected = {"output": to_list(output), "d_query": to_list(query.grad),
                "d_key": to_list(key.grad), "d_value": to_list(value.grad),
                "grad_out_proj_weight": to_list(mha.out_proj.weight.grad)}
    if same:
        expected["grad_in_proj_weight"] = to_list(mha.in_proj_weight.grad)
    else:
        for k in "qkv":
            expected["grad_%s_proj_weight" % k] = to_list(getattr(mha, k + "_proj_weight").grad)
    if bias:
        expected["grad_in_proj_bias"] = to_list(mha.in_proj_bias.grad)
        expected["grad_out_proj_bias"] = to_list(mha.out_proj.bias.grad)
    if add_bias_kv:
        expected["grad_bias_k"] = to_list(mha.bias_k.grad.view(E))
        expected["grad_bias_v"] = to_list(mha.bias_v.grad.view(E))

    case = {
        "name": name,
        "description": description,
        "generator": "PyTorch %s, float64 (tests/data/make_mha_grad.py)" % torch.__version__,
        "params": {"embed_dim": E, "num_heads": num_heads, "kdim": kdim, "vdim": vdim,
                   "bias": bias, "add_bias_kv": add_bias_kv, "add_zero_attn": add_zero_attn,
                   "causal": "bottom_right" if causal else "none",
                   "parameter_count": sum(p.numel() for p in mha.parameters())},
        "inputs": inputs,
        "expected": expected,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".json")
    with open(path, "w") as f:
        json.dump(case, f)
        f.write("\n")
    print("wrote", path)


def main():
    torch.set_default_dtype(torch.float64)
    make_case("mha_grad_causal_padding",
              "gradients of sum(output * dO): causal self-attention, batch 2, trailing key "
              "padding in item 1, biases",
              seed=1213, batch=2, n=5, m=5, embed_dim=12, num_heads=3, kdim=12, vdim=12,
              bias=True, add_bias_kv=False, add_zero_attn=False, causal=True,
              key_valid=[[True] * 5, [True, True, True, False, False]])
    make_case("mha_grad_cross_bias_kv",
              "gradients of sum(output * dO): cross-attention with kdim 6 and vdim 10 != "
              "embed_dim 8, add_bias_kv and add_zero_attn, key padding in item 1, biases",
              seed=1214, batch=2, n=3, m=4, embed_dim=8, num_heads=2, kdim=6, vdim=10,
              bias=True, add_bias_kv=True, add_zero_attn=True, causal=False,
              key_valid=[[True] * 4, [False, True, True, False]])


if __name__ == "__main__":
    main()

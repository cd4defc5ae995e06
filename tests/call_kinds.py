"""Argument sets for the call-test property tests: one valid call and its ways of being wrong.

``variant(kind, x, r, w, s)`` turns a valid ``(hidden_states [4, H], residual, weight, scale)``
into the named variant; the call's combined test (tests/op/test_call_safety.py) is held to
``check_call`` on these.
"""

from __future__ import annotations

from typing import Any

import torch

KINDS = ["ok", "view_alias", "overlap", "disjoint", "dtype", "res_dtype", "w_dtype", "shape", "res_shape",
         "res_3d", "w_shape", "strided", "transposed", "too_many", "zero_rows", "meta", "w_in_x",
         "new_weight", "no_scale", "extra_scale", "scale_in_x", "new_scale", "leaf_grad", "not_tensor",
         "w_none", "res_none", "x_neg", "res_neg", "w_neg", "scale_neg"]  # fmt: skip


def variant(kind: str, x: Any, r: Any, w: Any, s: Any) -> tuple[Any, Any, Any, Any]:
    h = x.shape[1]
    buf = torch.randn(8, h)
    table = {
        "ok": lambda: (x, r, w, s),
        "view_alias": lambda: (x, x.view(4, h), w, s),
        "overlap": lambda: (buf[0:4], buf[2:6], w, s),
        "disjoint": lambda: (buf[0:4], buf[4:8], w, s),
        "dtype": lambda: (x.double(), r, w, s),
        "res_dtype": lambda: (x, r.half(), w, s),
        "w_dtype": lambda: (x, r, w.half(), s),
        "shape": lambda: (x[:, :4].contiguous(), r, w, s),
        "res_shape": lambda: (x, r[:2], w, s),
        "res_3d": lambda: (x, r.view(4, 1, h), w, s),
        "w_shape": lambda: (x, r, w[:4], s),
        "strided": lambda: (torch.randn(4, 2 * h)[:, :h], r, w, s),
        "transposed": lambda: (torch.randn(h, 4).t(), r, w, s),
        "too_many": lambda: (torch.randn(9, h), torch.randn(9, h), w, s),
        "zero_rows": lambda: (torch.randn(0, h), torch.randn(0, h), w, s),
        "meta": lambda: (torch.empty(4, h, device="meta"), r, w, s),
        "w_in_x": lambda: (x, r, x[0], s),
        "new_weight": lambda: (x, r, w.clone(), s),
        "no_scale": lambda: (x, r, w, None),
        "extra_scale": lambda: (x, r, w, torch.ones(1)),
        "scale_in_x": lambda: (x, r, w, x.view(-1)[:1]),
        "new_scale": lambda: (x, r, w, None if s is None else s.clone()),
        "leaf_grad": lambda: (torch.randn(4, h, requires_grad=True), r, w, s),
        "not_tensor": lambda: (x.tolist(), r, w, s),
        "w_none": lambda: (x, r, None, s),
        "res_none": lambda: (x, None, w, s),
        # Lazy negations (torch._neg_view; z.conj().imag is another): the memory is not the value.
        "x_neg": lambda: (torch._neg_view(x.clone()), r, w, s),
        "res_neg": lambda: (x, torch._neg_view(r), w, s),
        "w_neg": lambda: (x, r, torch._neg_view(w), s),
        "scale_neg": lambda: (x, r, w, torch._neg_view(torch.ones(1)) if s is None else torch._neg_view(s)),
    }
    return table[kind]()

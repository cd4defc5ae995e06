"""An op cannot be copied or pickled (issue 41, item 8): ``copy.copy``, ``copy.deepcopy`` and
``pickle`` raise one clear ``TypeError``, and the original op is untouched afterwards."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import arnorm

H = 16


def _op() -> arnorm.AllReduceNorm:
    return arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=8,
        device="cpu", backend="reference",
    )  # fmt: skip


@pytest.mark.parametrize(
    "how",
    [copy.copy, copy.deepcopy, pickle.dumps, lambda op: pickle.dumps(op, protocol=0)],
    ids=["copy", "deepcopy", "pickle", "pickle-protocol-0"],
)
def test_copying_or_pickling_an_op_is_one_clear_error_and_leaves_it_working(how):
    op = _op()
    x, r, w = torch.randn(3, H), torch.randn(3, H), torch.rand(H)
    want = op(x.clone(), r.clone(), w)
    with pytest.raises(TypeError, match=r"^op: an AllReduceNorm cannot be copied or pickled \(needs "):
        how(op)
    got = op(x.clone(), r.clone(), w)
    assert torch.equal(got.normed, want.normed) and torch.equal(got.residual, want.residual)
    assert op.backend_for(3) == "reference"
    op.close()


def test_a_model_holding_an_op_refuses_deepcopy_clearly():
    """Engines deep-copy modules: the error names the op, not a RecursionError deep inside."""
    holder = torch.nn.Module()
    holder.op = _op()  # type: ignore[assignment]
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy(holder)
    holder.op.close()

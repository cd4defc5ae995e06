"""arnorm.testing.registered: backends given in code, for one block, beside the installed ones."""

from __future__ import annotations

import pytest
import torch

import arnorm
from arnorm._reference import ReferenceBackend
from arnorm.plugin import BackendSpec, Capabilities
from arnorm.testing import registered


class InCode(ReferenceBackend):
    name = "in_code"


SPEC = BackendSpec(
    name="in_code",
    priority=-100,
    capabilities=Capabilities(platforms=frozenset({"cpu"})),
    loader=f"{__name__}:InCode",
)


def _names() -> set[str]:
    return {i.name for i in arnorm.backends()}


def test_registered_for_the_block_only():
    before = _names()
    assert "in_code" not in before
    with registered(SPEC):
        assert _names() == before | {"in_code"}
        info = {i.name: i for i in arnorm.backends()}["in_code"]
        assert (info.status, info.plugin) == ("available", "<code>")
    assert _names() == before


def test_the_registry_comes_back_after_an_exception():
    before = _names()
    with pytest.raises(RuntimeError), registered(SPEC):
        raise RuntimeError("inside")
    assert _names() == before


def test_anything_but_a_spec_is_refused():
    with pytest.raises(TypeError, match=r"specs: str \(needs arnorm.plugin.BackendSpec\)"), registered("x"):
        pass


def test_an_op_selects_it_by_name():
    with registered(SPEC):
        op = arnorm.AllReduceNorm(
            arnorm.LOCAL,
            hidden_size=64,
            dtype=torch.bfloat16,
            max_tokens=4,
            device="cpu",
            backend="in_code",
            norm=arnorm.RMSNorm(),
        )
        with op:
            assert op.backend == "in_code"

"""A plugin cannot break or impersonate the core (issue 12.4); argument and setting errors are clear."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import arnorm
from arnorm._errors import ArnormWarning
from arnorm.plugin import BackendSpec, Capabilities
from arnorm.registry._discovery import Registry

import fake_backends

CPU = Capabilities(platforms=frozenset({"cpu"}))


def make(**kw):
    base = dict(hidden_size=8, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4)
    base.update(kw)
    return arnorm.AllReduceNorm(arnorm.LOCAL, **base)


class ExitingProbe(fake_backends.AllReduceBackend):
    name = "exiting"

    @classmethod
    def probe(cls, problem):
        raise SystemExit(3)


class SlowProbe(fake_backends.AllReduceBackend):
    name = "slow"

    @classmethod
    def probe(cls, problem):
        time.sleep(3)
        return ()


class CountingProbe(fake_backends.AllReduceBackend):
    name = "counting"
    calls = 0

    @classmethod
    def probe(cls, problem):
        CountingProbe.calls += 1
        return ()


class NoCheckTokens:
    name = "partial"

    @classmethod
    def probe(cls, problem):
        return ()

    @classmethod
    def create(cls, problem, comm, settings):
        return cls()

    def __call__(self, *args):
        raise AssertionError("never called")

    def close(self):
        pass


for _cls in (ExitingProbe, SlowProbe, CountingProbe, NoCheckTokens):
    setattr(fake_backends, _cls.__name__, _cls)


def test_a_hook_raising_system_exit_marks_only_that_plugin_broken():
    """SystemExit from plugin code is caught like any exception; the registry survives."""
    reg = Registry()

    def exiting_hook():
        raise SystemExit("bye")

    with pytest.warns(ArnormWarning, match="SystemExit"):
        reg.add_from_hook("quitter", exiting_hook)
    assert reg.get("quitter").status == "broken"


def test_keyboard_interrupt_from_a_hook_is_not_swallowed():
    """Ctrl-C during discovery still stops the program."""
    reg = Registry()

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        reg.add_from_hook("ctrl_c", interrupted)


def test_a_probe_raising_system_exit_is_a_broken_verdict(clean_env):
    """A probe that exits the interpreter rejects its backend instead of killing the process."""
    fake_backends.install(fake_backends.spec("exiting", 50, "ExitingProbe"))
    with make() as op:
        verdict = op.explain().verdict("exiting")
        assert op.backend == "reference" and verdict.status == "broken"
        assert verdict.reasons[0].startswith("probe: raised SystemExit: 3")


def test_a_probe_that_does_not_answer_is_rejected_after_the_timeout(clean_env):
    """ARNORM_PROBE_TIMEOUT bounds a probe; the reason says so and points at create() for slow work."""
    clean_env.setenv("ARNORM_PROBE_TIMEOUT", "0.2")
    fake_backends.install(fake_backends.spec("slow", 50, "SlowProbe"))
    start = time.monotonic()
    with make() as op:
        assert op.backend == "reference"
        (reason,) = op.explain().verdict("slow").reasons
    assert time.monotonic() - start < 2.5
    assert reason.startswith(
        "probe: no answer in 0.2 s (needs a probe that returns within ARNORM_PROBE_TIMEOUT"
    )


def test_probe_results_are_cached_and_lower_backends_are_not_probed(clean_env):
    """An identical problem is probed once per process; below a backend serving every count, none is."""
    CountingProbe.calls = 0
    fake_backends.install(
        fake_backends.spec("counting", 50, "CountingProbe"), fake_backends.spec("exiting", 40, "ExitingProbe")
    )
    for _ in range(3):
        with make() as op:
            assert op.backend == "counting"
            assert op.explain().verdict("exiting").status == "unprobed"
    assert CountingProbe.calls == 1


def test_the_probe_cache_is_bounded(clean_env, monkeypatch):
    """Many distinct problems keep at most CACHE_SIZE probe results, the newest ones."""
    from arnorm.registry import _probe

    monkeypatch.setattr(_probe, "CACHE_SIZE", 4)
    _probe.clear_probe_cache()
    fake_backends.install(fake_backends.spec("counting", 50, "CountingProbe"))
    for h in range(8, 8 + 6 * 8, 8):
        make(hidden_size=h).close()
    assert len(_probe._cache) == 4
    assert [key[2].hidden_size for key in _probe._cache] == [24, 32, 40, 48]


def test_a_class_missing_a_protocol_method_is_broken_at_load(clean_env):
    """The protocol is checked at load: a missing check_tokens is a reason, not a crash at the first call."""
    fake_backends.install(fake_backends.spec("partial", 50, "NoCheckTokens"))
    with make() as op:
        verdict = op.explain().verdict("partial")
    assert verdict.status == "broken"
    assert verdict.reasons == (
        "protocol: no check_tokens() (needs every method of arnorm.plugin.FusedAllReduceNorm)",
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"priority": True}, r"priority: True \(needs an int\)"),
        ({"priority": "10"}, r"priority: '10' \(needs an int\)"),
        ({"name": "Bad-Name"}, r"name: 'Bad-Name' \(needs a lower-case letter"),
        ({"loader": "no_colon"}, r"loader: 'no_colon' \(needs 'package.module:ClassName'\)"),
        (
            {"capabilities": {"platforms": ["cpu"]}},
            r"capabilities: dict \(needs arnorm.plugin.Capabilities\)",
        ),
    ],
)
def test_descriptor_fields_are_validated(fields, message):
    """A malformed BackendSpec fails when built, naming the field."""
    base = {"name": "ok", "priority": 1, "capabilities": CPU, "loader": "m:C"}
    base.update(fields)
    with pytest.raises((TypeError, ValueError), match=message):
        BackendSpec(**base)


def test_a_foreign_plugin_cannot_take_a_builtin_name():
    """A distribution other than arnorm registering 'reference' is broken; the built-in stays."""
    from arnorm.registry import _builtin

    reg = Registry()
    reg.add_from_hook("arnorm", _builtin.arnorm_backends, "arnorm")
    impostor = BackendSpec(name="reference", priority=999, capabilities=CPU, loader="evil:Backend")
    with pytest.warns(ArnormWarning, match="reserved"):
        reg.add_from_hook("aaa", lambda: [impostor], "evil-dist")
    assert reg.get("reference").spec.loader == "arnorm._reference:ReferenceBackend"
    assert reg.get("reference@aaa").status == "broken"


def test_a_foreign_plugin_loaded_first_still_cannot_take_a_builtin_name():
    """Order does not matter: a reserved name is refused to a foreign distribution that comes first."""
    reg = Registry()
    impostor = BackendSpec(name="triton", priority=999, capabilities=CPU, loader="evil:Backend")
    with pytest.warns(ArnormWarning, match="reserved"):
        reg.add_from_hook("aaa", lambda: [impostor], "evil-dist")
    assert reg.get("triton") is None and reg.get("triton@aaa").status == "broken"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_group": "world"}, r"tp_group: str 'world' \(needs"),
        ({"tp_group": None}, r"tp_group: None, and torch.distributed is not initialized"),
        ({"config": {"backend": "reference"}}, r"config: dict \(needs arnorm.Config"),
        ({"backend": 123}, r"backend: 123 \(needs a backend name"),
        ({"norm": arnorm.RMSNorm(1e-6), "eps_true": True}, r"eps: True \(needs a positive finite float"),
    ],
)
def test_wrong_argument_types_are_arnorm_errors_naming_the_argument(clean_env, kwargs, message):
    """group='world', config={...}, backend=123, eps=True: InvalidInputError naming the argument."""
    kwargs = dict(kwargs)
    group = kwargs.pop("tp_group", arnorm.LOCAL)
    with pytest.raises((arnorm.InvalidInputError, arnorm.ConfigError), match=message):
        if kwargs.pop("eps_true", False):
            arnorm.RMSNorm(True)  # type: ignore[arg-type]
        base = dict(hidden_size=8, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4)
        base.update(kwargs)
        arnorm.AllReduceNorm(group, **base)


def test_lower_case_variables_are_ignored_with_a_warning(clean_env):
    """arnorm_backend=... is not honoured under a name the messages would not show; it warns instead."""
    from arnorm import _environment
    from arnorm.registry._load import load_config

    _environment._warned.clear()
    clean_env.setenv("arnorm_backend", "reference")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config = load_config()
    assert config.backend == ()
    assert any("arnorm_backend" in str(w.message) for w in seen)


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_a_probe_timeout_that_cannot_work_is_a_config_error(clean_env, value):
    """NaN, negative, zero or infinite ARNORM_PROBE_TIMEOUT is rejected, naming the variable."""
    from arnorm.registry._load import load_config

    clean_env.setenv("ARNORM_PROBE_TIMEOUT", value)
    with pytest.raises(arnorm.ConfigError, match="ARNORM_PROBE_TIMEOUT"):
        load_config()


def test_explain_after_close_says_closed(clean_env):
    """explain() on a closed op still answers, and says the op is closed."""
    op = make()
    op.close()
    text = str(op.explain())
    assert op.explain().closed and "[closed]" in text

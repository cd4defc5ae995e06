"""Config: environment variables one to one, code over environment."""

from __future__ import annotations

import pytest

from arnorm import Config, ConfigError, InvalidInputError
from arnorm.registry._select import Preference


def test_env_lists_are_parsed(clean_env):
    """ARNORM_BACKEND and ARNORM_DISABLE take comma lists, blanks ignored, order kept."""
    clean_env.setenv("ARNORM_BACKEND", " triton , reference,")
    clean_env.setenv("ARNORM_DISABLE", "flashinfer")
    c = Config()
    assert c.backend == ("triton", "reference") and c.disable == ("flashinfer",)


def test_every_field_has_its_variable(clean_env):
    """Each core Config field but ``settings`` (code only) is set by ARNORM_<FIELD>."""
    values = {
        "backend": "x", "disable": "y", "check_calls": "1", "probe_timeout": "2.5",
        "peer_timeout": "30", "batch_invariant": "1", "vllm": "0", "vllm_pass": "take",
    }  # fmt: skip
    for field, value in values.items():
        clean_env.setenv(f"ARNORM_{field.upper()}", value)
    c = Config()
    assert set(values) | {"settings"} == set(Config.model_fields)
    assert (c.backend, c.disable, c.check_calls, c.probe_timeout) == (("x",), ("y",), True, 2.5)
    assert c.batch_invariant is True and c.vllm is False
    assert c.peer_timeout == 30.0 and c.vllm_pass == "take"


def test_vllm_pass_names_its_three_policies(clean_env):
    assert Config().vllm_pass == "after"
    clean_env.setenv("ARNORM_VLLM_PASS", "always")
    with pytest.raises(
        ConfigError, match=r"ARNORM_VLLM_PASS: 'always' \(input should be 'after', 'take' or 'off'\)"
    ):
        Config()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e10"])
def test_peer_timeout_out_of_range_is_a_config_error(clean_env, value):
    """peer_timeout: a positive number of seconds up to a day, named in the error."""
    clean_env.setenv("ARNORM_PEER_TIMEOUT", value)
    with pytest.raises(ConfigError, match=r"ARNORM_PEER_TIMEOUT"):
        Config()


def test_backend_fields_left_the_core_config(clean_env):
    """triton_exact and flashinfer_* are backend settings now; Config rejects them as fields."""
    with pytest.raises(ConfigError, match=r"Config.triton_exact"):
        Config(triton_exact=True)  # type: ignore[call-arg]


def test_precedence_argument_config_env_auto(clean_env):
    """backend= beats Config set in code, which beats ARNORM_BACKEND, which beats auto."""
    assert Preference.resolve(None, Config()).source == "auto"
    clean_env.setenv("ARNORM_BACKEND", "triton")
    assert Preference.resolve(None, Config()) == Preference(("triton",), "ARNORM_BACKEND")
    assert Preference.resolve(None, Config(backend="reference")) == Preference(
        ("reference",), "Config.backend"
    )
    assert Preference.resolve(["a", "b"], Config(backend="reference")) == Preference(("a", "b"), "argument")


def test_empty_backend_argument_is_rejected(clean_env):
    """backend='' is a mistake, not auto mode."""
    with pytest.raises(InvalidInputError, match="backend: '' "):
        Preference.resolve("", Config())


def test_unknown_field_is_rejected():
    """A misspelt field fails loudly, as a ConfigError naming it, instead of being ignored."""
    with pytest.raises(ConfigError, match=r"^Config.backends: not a setting \(needs one of: backend, "):
        Config(backends="x")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("variable", "value", "needs"),
    [
        ("ARNORM_CHECK_CALLS", "maybe", "a boolean: 1/0, true/false, yes/no or on/off"),
        ("ARNORM_PROBE_TIMEOUT", "abc", "a number"),
    ],
)
def test_malformed_values_say_what_is_needed(clean_env, variable, value, needs):
    """A value pydantic cannot parse is told in arnorm's grammar, with the values accepted."""
    clean_env.setenv(variable, value)
    with pytest.raises(ConfigError) as err:
        Config()
    assert str(err.value) == f"{variable}: {value!r} (needs {needs})"


def test_a_validators_own_needs_is_kept():
    """A field validator's message in arnorm's grammar gives the error its "(needs ...)" part."""
    with pytest.raises(ConfigError) as err:
        Config(backend=5)  # type: ignore[arg-type]
    assert str(err.value) == "Config.backend: 5 (needs a comma-separated string or a list of names)"


@pytest.mark.parametrize(
    ("field", "value"), [("probe_timeout", 0), ("probe_timeout", -1), ("check_calls", "maybe")]
)
def test_bad_values_in_code_are_config_errors(field, value):
    """Config() with a bad value raises arnorm.ConfigError (not pydantic's ValidationError)."""
    with pytest.raises(ConfigError, match=rf"Config.{field}: "):
        Config(**{field: value})


def test_malformed_variable_is_a_config_error_naming_it(clean_env):
    """A bad ARNORM_* value raises ConfigError naming the variable and its value."""
    from arnorm import ConfigError
    from arnorm.registry._load import load_config

    clean_env.setenv("ARNORM_CHECK_CALLS", "maybe")
    with pytest.raises(ConfigError, match=r"ARNORM_CHECK_CALLS: 'maybe' \("):
        load_config()


def test_misspelt_variable_warns(clean_env):
    """An ARNORM_* variable that is no setting is reported instead of ignored."""
    from arnorm.registry._load import load_config

    clean_env.setenv("ARNORM_BACKENDS", "triton")
    with pytest.warns(
        UserWarning, match=r"ARNORM_BACKENDS: not an arnorm setting \(needs one of ARNORM_BACKEND"
    ):
        load_config()


def test_the_peer_timeout_of_a_config_not_yet_checked(clean_env):
    """Construction opens agreement before it checks ``config``: a Config's own timeout, else the
    environment's, else (a malformed variable, reported later through the agreement) the default."""
    from arnorm._config import DEFAULT_PEER_TIMEOUT, peer_timeout

    assert peer_timeout(Config(peer_timeout=3)) == 3
    clean_env.setenv("ARNORM_PEER_TIMEOUT", "7")
    assert peer_timeout(None) == peer_timeout("not a config") == 7
    clean_env.setenv("ARNORM_PEER_TIMEOUT", "soon")
    assert peer_timeout(None) == DEFAULT_PEER_TIMEOUT == Config.model_fields["peer_timeout"].default


def test_a_config_sets_the_problems_batch_invariance():
    """The one place a Config field becomes a Problem field, for ops and the CLI alike."""
    from arnorm._problem import Problem

    problem = Problem(1, 64, "float32", 1e-6, 0.0, None, None, 8, True, True, "cpu", "cpu")
    assert Config(batch_invariant=True).configured(problem).batch_invariant
    assert not Config().configured(problem).batch_invariant

"""Config: environment variables one to one, code over environment."""

from __future__ import annotations

import pytest

from arnorm import Config, InvalidInputError
from arnorm._select import Preference


def test_env_lists_are_parsed(clean_env):
    """ARNORM_BACKEND and ARNORM_DISABLE take comma lists, blanks ignored, order kept."""
    clean_env.setenv("ARNORM_BACKEND", " triton , reference,")
    clean_env.setenv("ARNORM_DISABLE", "flashinfer")
    clean_env.setenv("ARNORM_TRITON_EXACT", "1")
    c = Config()
    assert c.backend == ("triton", "reference") and c.disable == ("flashinfer",) and c.triton_exact


def test_every_field_has_its_variable(clean_env):
    """Each Config field is set by ARNORM_<FIELD>."""
    values = {
        "backend": "x",
        "disable": "y",
        "triton_exact": "true",
        "flashinfer_mnnvl": "true",
        "flashinfer_max_size_mb": "3.5",
        "flashinfer_shared_gpu": "1",
    }
    for field, value in values.items():
        clean_env.setenv(f"ARNORM_{field.upper()}", value)
    c = Config()
    assert set(values) == set(Config.model_fields)
    assert (c.backend, c.disable, c.triton_exact, c.flashinfer_mnnvl, c.flashinfer_max_size_mb) == (
        ("x",),
        ("y",),
        True,
        True,
        3.5,
    )
    assert c.flashinfer_shared_gpu


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
    """A misspelt field fails loudly instead of being ignored."""
    import pydantic

    with pytest.raises(pydantic.ValidationError):
        Config(backends="x")  # type: ignore[call-arg]


def test_malformed_variable_is_a_config_error_naming_it(clean_env):
    """A bad ARNORM_* value raises ConfigError naming the variable and its value."""
    from arnorm import ConfigError
    from arnorm._config import load_config

    clean_env.setenv("ARNORM_TRITON_EXACT", "maybe")
    with pytest.raises(ConfigError, match=r"ARNORM_TRITON_EXACT: 'maybe' \("):
        load_config()


def test_misspelt_variable_warns(clean_env):
    """An ARNORM_* variable that is no setting is reported instead of ignored."""
    from arnorm._config import load_config

    clean_env.setenv("ARNORM_BACKENDS", "triton")
    with pytest.warns(
        UserWarning, match=r"ARNORM_BACKENDS: not an arnorm setting \(needs one of ARNORM_BACKEND"
    ):
        load_config()

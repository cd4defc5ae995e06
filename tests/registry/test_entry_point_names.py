"""Backend and entry-point names (issue 41, items 11 and 12): a foreign package's entry point named
like a built-in plugin never replaces the built-in backend and is reported naming the package; a
name with control characters is refused (``ARNORM_BACKEND``, ``backend=``) or printed escaped
(``arnorm backends``), never forging a row of a table or reaching a terminal raw."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

MODULE = textwrap.dedent(
    """
    from arnorm.plugin import BackendSpec, Capabilities, hookimpl

    @hookimpl
    def arnorm_backends():
        caps = Capabilities(platforms={"cpu"})
        return [BackendSpec(name="shadow", priority=-5, capabilities=caps, loader="shadow_mod:Nope")]
    """
)


def make_distribution(root: pathlib.Path, package: str, entry_point: str) -> pathlib.Path:
    """An installed-form distribution (a ``.dist-info`` and the module it names) under ``root``."""
    info = root / f"{package}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[arnorm.backends]\n{entry_point} = shadow_mod\n")
    (root / "shadow_mod.py").write_text(MODULE)
    return root


def run(code: str, path: pathlib.Path, *args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    env.pop("ARNORM_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_a_foreign_entry_point_named_like_a_builtin_leaves_the_builtin_and_names_its_package(tmp_path, name):
    code = """
        import sys, warnings, torch, arnorm
        name = sys.argv[1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            infos = {i.name: i for i in arnorm.backends()}
        print(infos[name].status, infos[name].plugin)
        impostor = infos.get(name + "@shadowpkg")
        print(impostor.status if impostor else "-", "|", impostor.reason if impostor else "-")
        print(sum("shadowpkg" in str(w.message) for w in caught))
        kw = dict(hidden_size=16, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4)
        with arnorm.AllReduceNorm(arnorm.LOCAL, device="cpu", backend="reference", **kw) as op:
            print(op.backend)
    """
    lines = run(code, make_distribution(tmp_path, "shadowpkg", name), name)
    builtin = "available" if name == "reference" else lines[0].split()[0]
    assert lines[0] == f"{builtin} {name}"  # the built-in entry, untouched
    assert lines[1] == (
        f"broken | plugin: entry point {name!r} of package 'shadowpkg' takes the name of arnorm's built-in "
        "plugin (needs another entry-point name)"
    )
    assert lines[2] == "1"  # one warning, naming the package
    assert lines[3] == "reference"  # CPU builds still work


def test_arnorm_backends_prints_an_entry_point_name_with_escape_codes_escaped(tmp_path):
    """A terminal escape sequence in an entry-point name reaches the terminal as text."""
    evil = "x\x1b[2J\x1b[31mred"
    make_distribution(tmp_path, "evilpkg", evil)
    (tmp_path / "shadow_mod.py").write_text("raise ImportError('no')\n")
    code = """
        import sys
        from arnorm.cli import main
        sys.exit(main(["backends"]))
    """
    lines = run(code, tmp_path)
    text = "\\n".join(lines)
    assert "\x1b" not in text
    (row,) = [line for line in lines if line.startswith("x\\x1b")]
    assert row.startswith("x\\x1b[2J\\x1b[31mred ") and "broken" in row, row


FORGED = "nosuch\nreference    0         selected       -"


def test_a_newline_in_arnorm_backend_is_refused_before_it_reaches_a_table(clean_env):
    import torch

    import arnorm

    clean_env.setenv("ARNORM_BACKEND", FORGED)
    kw = dict(hidden_size=16, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4, device="cpu")
    with pytest.raises(arnorm.ConfigError) as caught:
        arnorm.AllReduceNorm(arnorm.LOCAL, **kw)
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith("ARNORM_BACKEND: 'nosuch\\nreference ") and "(needs backend names" in message
    clean_env.delenv("ARNORM_BACKEND")
    with pytest.raises(arnorm.InvalidInputError, match=r"^backend: 'nosuch\\nreference ") as caught:
        arnorm.AllReduceNorm(arnorm.LOCAL, backend=FORGED, **kw)
    assert "\n" not in str(caught.value)


def test_arnorm_explain_refuses_a_forged_arnorm_backend_in_one_line(tmp_path):
    env = {**os.environ, "ARNORM_BACKEND": FORGED}
    code = "import sys; from arnorm.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["explain", "--tp", "2", "--hidden", "64", "--device", "cpu"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("arnorm explain: error: ARNORM_BACKEND: 'nosuch\\nreference "), line

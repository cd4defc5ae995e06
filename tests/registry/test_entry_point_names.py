"""Entry-point names (issue 41, item 11): a foreign package's entry point named like a built-in
plugin never replaces the built-in backend and is reported naming the package."""

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

"""Plugin discovery through entry points: cheap descriptors, broken and missing plugins."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import arnorm
from arnorm.plugin import BackendSpec, Capabilities
from arnorm.registry._discovery import CORE_DISTRIBUTION, ArnormWarning, Registry


def test_reference_registers_through_its_entry_point():
    """The in-tree reference backend is found like any plugin, with its version."""
    info = {i.name: i for i in arnorm.backends()}["reference"]
    assert info.status == "available" and info.priority == 0 and info.version == arnorm.__version__


def test_missing_requirement_is_not_installed_with_the_fix():
    """A spec whose module is absent is 'not installed' and names the pip command."""
    reg = Registry()
    reg.add(
        BackendSpec(
            name="gone",
            priority=5,
            capabilities=Capabilities(platforms={"cuda"}),
            loader="nowhere:X",
            requires=("no_such_module_xyz",),
            extra="gone",
        )
    )
    info = reg.get("gone")
    assert info.status == "not_installed"
    assert info.reason == "not installed: no_such_module_xyz (needs pip install 'arnorm[gone]')"


def test_hook_that_raises_is_broken_and_warns():
    """A plugin hook that raises is listed as broken with its exception; the rest survive."""
    reg = Registry()

    def bad_hook():
        raise RuntimeError("boom")

    with pytest.warns(ArnormWarning, match="boom"):
        reg.add_from_hook("badplugin", bad_hook)
    assert reg.get("badplugin").status == "broken"
    assert reg.get("badplugin").reason == "plugin: RuntimeError: boom (needs a working plugin)"


def test_hook_returning_garbage_is_broken():
    """A hook must return BackendSpec objects; anything else marks the plugin broken."""
    reg = Registry()
    with pytest.warns(ArnormWarning):
        reg.add_from_hook("odd", lambda: ["not a spec"])
    assert reg.get("odd").status == "broken"


def test_a_name_two_plugins_claim_serves_neither():
    """Two third-party plugins claiming one name (which loads first is only entry-point order) leave it
    broken, naming both, so ARNORM_BACKEND=<name> cannot run the other package's code; a third claim
    is named too."""
    reg = Registry()
    spec = BackendSpec(name="dup", priority=1, capabilities=Capabilities(platforms={"cpu"}), loader="a:B")
    reg.add(spec, plugin="mine", distribution="mine")
    with pytest.warns(
        ArnormWarning,
        match=r"backend 'dup' is not used: name: 'dup' claimed by plugins 'mine' \(package mine\) ",
    ):
        reg.add(spec, plugin="aaa", distribution="aaa")
    info = reg.get("dup")
    assert info.status == "broken" and info.reason == (
        "name: 'dup' claimed by plugins 'mine' (package mine) and 'aaa' (package aaa) (needs one plugin per "
        "name: uninstall one)"
    )
    with pytest.warns(ArnormWarning, match=r"\(package aaa\) and 'zzz' \(package zzz\)"):
        reg.add(spec, plugin="zzz", distribution="zzz")
    assert reg.get("dup").status == "broken"


def test_a_reserved_name_is_refused_once_with_its_fix():
    """A foreign plugin claiming a built-in name is broken with one "(needs ...)": the name to change."""
    reg = Registry()
    spec = BackendSpec(name="triton", priority=1, capabilities=Capabilities(platforms={"cpu"}), loader="a:B")
    with pytest.warns(ArnormWarning, match="reserved"):
        reg.add(spec, plugin="mine", distribution="mine")
    assert reg.get("triton@mine").reason == (
        "plugin: name 'triton' is reserved for arnorm's built-in backend (needs another name)"
    )


def test_arnorm_keeps_its_own_names():
    """A name arnorm's own distribution registered stays arnorm's; the other claim alone is broken."""
    reg = Registry()
    spec = BackendSpec(name="ours", priority=1, capabilities=Capabilities(platforms={"cpu"}), loader="a:B")
    reg.add(spec, plugin="arnorm", distribution=CORE_DISTRIBUTION)
    with pytest.warns(ArnormWarning, match="already registered by arnorm's own plugin 'arnorm'"):
        reg.add(spec, plugin="other", distribution="other")
    assert reg.get("ours").status == "available" and reg.get("ours@other").status == "broken"


def test_loading_is_lazy():
    """Discovery never imports a backend's implementation module."""
    code = (
        "import sys, arnorm\n"
        "arnorm.backends()\n"
        "heavy = ('torch', 'triton', 'flashinfer', 'aiter', 'numpy')\n"
        "print([m for m in sys.modules if m.split('.')[0] in heavy or m.endswith('._backend')])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_broken_distribution_on_sys_path_does_not_break_the_core():
    """The broken distribution in tests/plugins/broken is listed as broken, loudly, and breaks nothing."""
    plugin_dir = pathlib.Path(__file__).parents[1] / "plugins" / "broken"
    code = textwrap.dedent(
        """
        import warnings, torch, arnorm
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            infos = {i.name: i for i in arnorm.backends()}
        warned = sum("'broken'" in str(x.message) for x in w)
        print(infos["broken"].status, "|", infos["broken"].reason, "|", warned)
        kw = dict(hidden_size=16, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4)
        op = arnorm.AllReduceNorm(arnorm.LOCAL, backend="reference", **kw)
        print(op.explain().rejections().get("broken", ("-",))[0])
        """
    )
    env = {"PYTHONPATH": str(plugin_dir)}

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, **env}
    ).stdout.splitlines()
    assert out[0] == "broken | plugin: ImportError: compiled for another torch (needs a working plugin) | 1"
    assert out[1] == "-"  # a strict choice never even looks at the broken plugin

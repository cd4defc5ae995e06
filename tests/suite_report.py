"""Run conformance suites in a pytest subprocess and read every test's outcome from its JUnit XML.

The conformance tests (tests/testing/test_conformance_suite.py, tests/faults/test_faults_conformance.py)
write their suites and the planted backends' entry points into a temporary folder, then read what
the suite said about each backend from here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def suite_report(
    root: Path, suites: str, files: dict[str, str], paths: list[str], select: str | None = None
) -> dict[str, tuple[str, str]]:
    """``{"TestClass.test_name[param]": (outcome, message)}`` from one pytest run of ``suites``
    (written to ``root`` with ``files``), ``paths`` put on PYTHONPATH, ``select`` its ``-k``."""
    (root / "test_suites.py").write_text(suites)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARNORM_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), *paths, env.get("PYTHONPATH", "")) if p)
    xml = root / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root)]
    cmd += [*(["-k", select] if select else []), f"--junitxml={xml}", str(root / "test_suites.py")]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert xml.exists(), f"pytest wrote no report (exit {proc.returncode}):\n{tail}"
    out = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "") + "\n" + (node.text or "")
        out[name] = (outcome, message)
    return out

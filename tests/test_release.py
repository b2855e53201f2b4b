"""Release hygiene: one version everywhere, and a wheel that builds with every module in it."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import sparseserve_hf

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_the_same_in_the_metadata_the_package_and_the_changelog():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert sparseserve_hf.__version__ == version
    first = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert first is not None and first.group(1) == version  # the newest entry comes first


def test_the_wheel_builds_and_holds_every_module(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("sparseserve_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "src"
    modules = {str(p.relative_to(package)) for p in (package / "sparseserve_hf").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert any(name.endswith("entry_points.txt") for name in names)  # the `sparseserve-hf` command

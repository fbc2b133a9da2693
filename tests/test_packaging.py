"""Every sub-package in the source tree is listed in pyproject.toml, so a non-editable
`pip install .` ships it (an editable install finds unlisted folders and hides the gap)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI runs 3.11)

ROOT = Path(__file__).resolve().parent.parent


def _declared() -> tuple[set[str], dict[str, str]]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(tool["packages"]), tool.get("package-dir", {})


def _folder(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools takes a package from: its own package-dir entry, or its nearest
    mapped parent's folder plus the rest of the dotted name."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in package_dir:
            return ROOT / package_dir[head] / Path(*parts[i:])
    return ROOT / Path(*parts)


def test_every_source_package_is_declared():
    declared, package_dir = _declared()
    roots = {
        name: _folder(name, package_dir)
        for name in declared
        if "." not in name or name in package_dir
    }
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            found.add(".".join((name, *rel.parts)) if rel.parts else name)
    missing = sorted(found - declared)
    assert not missing, (
        f"sub-packages missing from pyproject.toml [tool.setuptools] packages: {missing}"
    )


def test_every_declared_package_exists():
    declared, package_dir = _declared()
    absent = [
        p for p in sorted(declared) if not (_folder(p, package_dir) / "__init__.py").is_file()
    ]
    assert not absent, f"pyproject.toml lists packages with no __init__.py: {absent}"

"""The wheel's package list covers the source tree: an editable install finds every module on disk, a wheel only
what pyproject.toml names, so a package left off the list works in development and fails for every user."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> tuple[list[str], dict[str, str]]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return tool["packages"], tool["package-dir"]


def _on_disk(package_dir: dict[str, str]) -> set[str]:
    """Every directory with an __init__.py under a mapped root, as the dotted name the wheel would give it."""
    found = set()
    for name, directory in package_dir.items():
        root = ROOT / directory
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(root).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_python_package_on_disk_is_in_the_wheel():
    packages, package_dir = _declared()
    missing = sorted(_on_disk(package_dir) - set(packages))
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}: a wheel would ship without them"


def test_every_declared_package_exists():
    packages, package_dir = _declared()
    roots = sorted(package_dir, key=len, reverse=True)
    for package in packages:
        root = next(r for r in roots if package == r or package.startswith(r + "."))
        path = ROOT / package_dir[root] / Path(*package[len(root):].lstrip(".").split(".") if package != root else ())
        assert path.is_dir(), f"{package} is declared but {path} does not exist"

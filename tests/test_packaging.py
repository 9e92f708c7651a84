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


def test_the_wheel_carries_every_file_of_the_tree(tmp_path):
    """A wheel built from this tree holds every file under opdcache/ and cli/ (the demo's shipped models included),
    so what works from a checkout works from a release."""
    import subprocess
    import sys
    import zipfile

    import shutil

    _, package_dir = _declared()
    source = tmp_path / "source"  # a clean copy: setuptools would also ship whatever a stale build/lib holds
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    for directory in set(package_dir.values()):
        shutil.copytree(ROOT / directory, source / directory, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("opdcache-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for name, directory in package_dir.items():
        root = ROOT / directory
        for path in root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                rel = path.relative_to(root)
                if name == "opdcache" and rel.parts[0] in package_dir.get("opdcache.cli", "").split("/"):
                    continue
                expected.add("/".join((*name.split("."), *rel.parts)))
    missing = sorted(expected - shipped)
    assert not missing, f"the wheel lacks {len(missing)} files of the tree, e.g. {missing[:5]}"
    assert any(n.startswith("opdcache/demo/weights/teacher_pairs/") for n in shipped)


def test_the_dependency_check_lists_what_pyproject_requires():
    from packaging.requirements import Requirement

    from opdcache.dependencies import REQUIRED

    declared = [Requirement(r).name for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    assert declared == list(REQUIRED)


@pytest.mark.parametrize("hidden", ["jsonschema", "typer", "yaml"])
def test_a_required_package_missing_is_one_line_naming_its_install(hidden, tmp_path):
    """The console script's path (importing opdcache.cli.main, then main) with one required module unimportable."""
    import subprocess
    import sys

    code = f"import sys; sys.modules[{hidden!r}] = None; from opdcache.cli.main import main; main(['info', {str(tmp_path)!r}])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    distribution = {"yaml": "pyyaml"}.get(hidden, hidden)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install {distribution}" in lines[0] and "Traceback" not in run.stderr, run.stderr


def test_a_required_package_lost_while_running_is_one_line(monkeypatch, capsys):
    """A required module that fails to import inside a command (the check passed, the package broke later)."""
    from opdcache.cli import main as cli_main

    def lost(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'jsonschema'", name="jsonschema")

    monkeypatch.setattr(cli_main, "_register", lambda: None)
    monkeypatch.setattr(cli_main, "app", lost)
    with pytest.raises(SystemExit) as exit_:
        cli_main.main(["info", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install jsonschema" in err[0]

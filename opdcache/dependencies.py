"""opdcache's required packages, checked before a command runs: a package missing from the environment is one line
naming the pip install, never a traceback from deep inside the first module that imports it.

``REQUIRED`` maps each distribution that pyproject.toml's ``dependencies`` names to the module it installs (a test
holds the two lists equal). The check asks the import system where each module would load from and imports nothing.
"""

from __future__ import annotations

import importlib.util

from opdcache.errors import MissingDependencyError

REQUIRED = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "pyarrow": "pyarrow",
    "datasets": "datasets",
    "huggingface-hub": "huggingface_hub",
    "typer": "typer",
    "numpy": "numpy",
    "pyyaml": "yaml",
    "tqdm": "tqdm",
    "jsonschema": "jsonschema",
    "matplotlib": "matplotlib",
    "fsspec": "fsspec",
    "universal_pathlib": "upath",
    "aiohttp": "aiohttp",
}
"""Distribution name (as pip installs it) -> the top-level module it provides."""


def missing() -> list[str]:
    """The required distributions whose module cannot be found, in declaration order."""
    absent = []
    for distribution, module in REQUIRED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken package, or a module left in sys.modules without a spec
            found = False
        if not found:
            absent.append(distribution)
    return absent


def check_installed() -> None:
    """Refuse to run with a required package missing, naming the pip install that brings it back."""
    absent = missing()
    if absent:
        names = " ".join(absent)
        raise MissingDependencyError(f"opdcache needs {', '.join(absent)}, not installed in this environment: "
                                     f"pip install {names} (or reinstall opdcache)")


def exit_if_missing() -> None:
    """The command line's first check, before typer or torch loads: print the one line and leave with exit 2."""
    try:
        check_installed()
    except MissingDependencyError as exc:
        import sys

        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def distribution_of(module: str) -> str | None:
    """The required distribution that provides ``module`` (a dotted name), or None if it is not one of opdcache's."""
    top = module.split(".")[0]
    return next((d for d, m in REQUIRED.items() if m == top), None)

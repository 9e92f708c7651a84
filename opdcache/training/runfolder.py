"""The run folder (``--out``) as untrusted input: users take run folders from others (a shared checkpoint, a pulled run,
an async run directory), so what ``train`` and ``async`` read from it is read by the cache's rules, and what they write
there cannot be redirected.

- **Reads**: a regular file (never a link) under the folder's real root, at most a stated number of bytes, JSON parsed
  within :mod:`opdcache.untrusted`'s limits (duplicate keys, depth, number sizes), jsonl line by line.
- **Writes**: a folder is written under a fresh name created here (``os.mkdir`` fails on anything already there,
  a planted link included), then renamed onto its final name; a file goes through :func:`opdcache.storage.staged`
  (an ``O_EXCL | O_NOFOLLOW`` temporary, then a rename, which replaces a planted link instead of following it).
- A link at any name the run reads or writes (``checkpoint``, ``model``, ``metrics.jsonl``, ``tensorboard``, the
  checkpoint's temporaries) is refused in one line before anything loads: a run folder's files must be its own.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from opdcache.errors import RunFolderError

OWNED = ("checkpoint", "model", "metrics.jsonl", "config.json", "tensorboard", "wandb", "mlflow.db", "mlruns")
"""The names a run writes directly under its folder (besides the checkpoint's temporaries, ``.checkpoint.*``)."""
TEMPORARY_PREFIXES = (".checkpoint.", ".model.")
MAX_STATE_BYTES = 16 << 20  # a trainer state holds the settings, the loader's position and one dict per param group
MAX_METRICS_BYTES = 256 << 20  # metrics.jsonl: about 1 KB a step, so 250,000 steps


def _link_problem(out: Path, path: Path) -> str | None:
    if path.is_symlink():
        return f"{path} is a link (to {os.readlink(path)})"
    try:
        if not path.resolve().is_relative_to(out.resolve()):
            return f"{path} lies outside {out} once links are followed"
    except (OSError, RuntimeError):
        return f"{path} cannot be resolved (a link loop?)"
    return None


def _refuse(problem: str) -> RunFolderError:
    return RunFolderError(f"{problem}; a run folder's files must be its own (never links, never outside it): remove it, "
                          "or train into a new --out")


def check_folder(out: Path, owned: tuple[str, ...] = OWNED) -> None:
    """Refuse a link at any name the run reads or writes under ``out`` (``owned`` and the checkpoint's temporaries),
    and any link or non-regular file inside ``checkpoint/``: before the student loads, so nothing is read or written
    through them."""
    out = Path(out)
    if out.is_symlink() or not out.is_dir():
        return  # --out itself is the user's choice (a link to a bigger disk is fine); a missing one is created
    names = [out / n for n in owned] + [p for p in out.iterdir() if p.name.startswith(TEMPORARY_PREFIXES)]
    for path in names:
        if (problem := _link_problem(out, path)) is not None and (path.exists() or path.is_symlink()):
            raise _refuse(problem)
    for tree in [out / "checkpoint"] + [p for p in names if p.name.startswith(TEMPORARY_PREFIXES)]:
        if not tree.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(tree, followlinks=False):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                if path.is_symlink():
                    raise _refuse(f"{path} is a link (to {os.readlink(path)})")
                if not (path.is_dir() or path.is_file()):
                    raise _refuse(f"{path} is not a regular file")


def regular_file(out: Path, path: Path, limit: int) -> int:
    """The size of ``path``, a regular file of the run folder ``out`` (no link on the way, at most ``limit`` bytes);
    else a RunFolderError naming it."""
    out, path = Path(out), Path(path)
    for probe in [path, *path.parents]:
        if probe == out or not probe.is_relative_to(out):
            break
        if probe.is_symlink():
            raise _refuse(f"{probe} is a link (to {os.readlink(probe)})")
    if (problem := _link_problem(out, path)) is not None:
        raise _refuse(problem)
    if not path.is_file():
        raise _refuse(f"{path} is not a regular file")
    size = path.stat().st_size
    if size > limit:
        raise RunFolderError(f"{path}: {size:,} bytes, over the {limit >> 20} MiB such a file may take; the run folder is "
                             "damaged or hostile: train into a new --out")
    return size


def read_json(out: Path, path: Path, limit: int = MAX_STATE_BYTES):
    """The JSON value of a run-folder file, within :mod:`opdcache.untrusted`'s limits; one line naming it otherwise."""
    from opdcache.untrusted import loads

    regular_file(out, path, limit)
    return loads(Path(path).read_bytes(), str(path), RunFolderError)


def fresh_dir(out: Path, prefix: str) -> Path:
    """A new, empty folder ``out/<prefix><pid>-<random>``, created here: nothing planted at the name is written into."""
    path = Path(out) / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(path)  # fails on anything already there, a link included
    return path


@contextlib.contextmanager
def writing(tmp: Path, what: str):
    """Writing ``what`` into the fresh folder ``tmp``: on any failure the folder is removed (nothing half-written is
    left), and a write error of a library that is no OSError (safetensors' ``SafetensorError`` on a full disk) is
    raised as one, which the CLI reports in one line (the path, its permissions, the free disk space)."""
    import shutil

    try:
        yield
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if type(exc).__module__.split(".")[0] == "safetensors" or type(exc).__name__ == "SafetensorError":
            raise OSError(f"writing {what} into {tmp.parent}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__}") from None
        raise


def place_dir(tmp: Path, final: Path) -> None:
    """Move the folder ``tmp`` (written whole) onto ``final``: the folder there before, if any, is renamed aside and
    removed afterwards; a link at ``final`` is refused (:func:`check_folder` refused it before the run; this holds if
    one appeared since)."""
    import shutil

    if final.is_symlink():
        raise _refuse(f"{final} is a link (to {os.readlink(final)})")
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def open_append(path: Path):
    """``path`` opened for appending text, never through a link (``O_NOFOLLOW``)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return os.fdopen(fd, "a")


def read_jsonl(out: Path, path: Path, limit: int, valid, what: str, fix: str) -> list[dict]:
    """The entries of a run-folder jsonl file (none when it is absent): each line a JSON object that ``valid`` accepts,
    read within ``limit`` bytes and the JSON limits. A last line cut by a crash ends the file (everything before it is
    whole); any other line that is not ``what`` is refused in one line naming it, ending with ``fix``."""
    from opdcache.untrusted import loads

    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return []
    regular_file(out, path, limit)
    lines = path.read_bytes().splitlines()
    entries = []
    for i, line in enumerate(lines):
        try:
            entry = loads(line, f"{path} line {i + 1}", RunFolderError)
        except RunFolderError:
            if i == len(lines) - 1:
                break  # a line cut by a crash
            entry = None
        if not isinstance(entry, dict) or not valid(entry):
            raise RunFolderError(f"{path}: line {i + 1} is not {what}; the run folder is damaged: {fix}")
        entries.append(entry)
    return entries


def metrics_lines(out: Path) -> list[dict]:
    """The entries of ``out/metrics.jsonl``: JSON objects with a non-negative integer step (:func:`read_jsonl`)."""
    def valid(entry: dict) -> bool:
        step = entry.get("step")
        return isinstance(step, int) and not isinstance(step, bool) and step >= 0

    return read_jsonl(out, Path(out) / "metrics.jsonl", MAX_METRICS_BYTES, valid,
                      "a step's metrics (a JSON object with a non-negative integer step)", "train into a new --out")

"""One long-lived child that runs the installed CLI's ``main`` for each probe of the hostile suites.

Each probe was a fresh ``python -m opdcache.cli.main`` child: 3 s of importing torch and pyarrow before 1-5 s of work,
over some sixty probes. Here one child imports them once (its resident memory then is the baseline) and runs each
probe's command line in turn through the same ``main`` the console script calls, with the probe's environment and
working directory, its output (fd 1 and 2, so C-level writes too) captured to a file, stdin at /dev/null, the
address-space cap of the child (RLIMIT_AS, set by the parent before exec) and its peak resident memory reset before the
probe (``/proc/self/clear_refs``) and read after it (VmHWM): each probe's peak, as the separate child's rusage gave it.
An exception that escapes ``main`` is printed as the traceback the console script would print, exit code 1.

Requests come as one JSON line each on the pipe whose descriptor is the first argument, answers go out on the second,
so a probe's own output cannot mix with them.
"""

import json
import os
import sys
import traceback

import pyarrow.parquet  # noqa: F401  (the baseline's imports: those of a bare CLI child that will load a cache)
import torch  # noqa: F401

from opdcache.cli.main import main


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset the peak resident memory to the current one; False where the kernel refuses (then each probe needs a child
    of its own for its peak to be its own)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _probe(args: list[str], env: dict, cwd: str, out_path: str) -> int:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what the console script would print before exiting 1
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return code


def serve() -> None:
    requests, answers = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    answers.write(json.dumps({"baseline": _status("VmHWM"), "resettable": _reset_peak()}) + "\n")
    answers.flush()
    for line in requests:
        req = json.loads(line)
        _reset_peak()
        code = _probe(req["args"], req["env"], req["cwd"], req["out"])
        answers.write(json.dumps({"code": code, "peak": _status("VmHWM"), "vm": _status("VmSize")}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()

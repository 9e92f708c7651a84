"""The ``opdcache`` command: a thin Typer adapter over the library.

Each command lives in its own module and calls one library function. Library errors become one-line
messages here, with exit codes 0 (ok), 1 (a check failed -- validate's and pull's findings on a damaged cache, audit's,
check-consistency's and mismatch-report's verdicts -- or the run failed: a stage stopped, the network, the storage),
2 (bad usage or input, and a damaged cache given to any other command). Tracebacks never show
local variables (they may hold tokens or data).
"""

from __future__ import annotations

import os
import sys

from opdcache.threads import prepare_environment

prepare_environment()  # before anything imports torch: OpenMP reads its wait policy once, when it loads

from opdcache.dependencies import distribution_of, exit_if_missing  # noqa: E402

exit_if_missing()  # before typer loads: a required package missing is one line naming its pip install

import typer  # noqa: E402

from opdcache.cli.options import with_config_file
from opdcache.errors import ManifestError, OpdcacheError, SchemaError, USAGE_ERRORS

app = typer.Typer(
    name="opdcache", no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False, rich_markup_mode=None,
    help="Offline on-policy distillation caches: build, score, check, share, and train from them. Every command also "
         "takes --config FILE (YAML, the flags' names; the flags given override it) and --print-config (print the "
         "resolved settings as YAML and exit).",
)

DATA_ERRORS = (SchemaError, ManifestError)  # a damaged or hostile cache
VERDICT_COMMANDS = ("validate", "pull")  # a damaged cache is what these commands report (exit 1); to any other it is bad input (2)


INTERRUPTED = "interrupted: finished shards and checkpoints are kept; rerun the same command to resume"

_registered = False


@app.callback()
def _options(threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: OPDCACHE_THREADS, else the CPUs this process may use).", show_default=False)) -> None:
    """Offline on-policy distillation caches: build, score, check, share, and train from them."""
    import os

    if threads is not None:
        from opdcache.threads import ENV, pick

        pick(threads)  # refuses a bad value here, in one line
        os.environ[ENV] = str(threads)  # read by every stage, in this process and the ones it starts


def _register() -> None:
    global _registered
    if _registered:
        return
    from opdcache.cli import asyncopd, audit, consistency, demo, evaluate, export, generate, hub, info, mismatch, plan, score, train, validate

    for module in (demo, generate, score, plan, train, evaluate, asyncopd, validate, info, hub, consistency, mismatch, audit, export):
        module.register(app)
    _registered = True


_STORAGE_MODULES = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp", "fsspec", "adlfs", "azure")


def _storage_failure(exc: Exception) -> str | None:
    """One line for an object-store or disk failure (credentials, endpoint, permissions, disk full), else None."""
    module = type(exc).__module__.split(".")[0]
    if module not in _STORAGE_MODULES and not isinstance(exc, OSError):
        return None
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    hint = ("check the URL, the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS), "
            "AWS_ENDPOINT_URL for S3-compatible stores, and the network" if module in _STORAGE_MODULES
            else "check the path, its permissions and the free disk space")
    return f"storage: {type(exc).__name__}: {first}; {hint}, then rerun the same command (finished shards are kept)"


def _click_exception_types() -> tuple[type, ...]:
    """Click's exception classes, from click and from typer's vendored copy (typer >= 0.29 raises its own)."""
    types = []
    for module in ("click.exceptions", "typer._click.exceptions"):
        try:
            types.append(__import__(module, fromlist=["ClickException"]).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def _usage_line(exc: Exception, argv: list[str] | None = None) -> str:
    """One line for a command-line usage error: what is wrong and where to read the usage (the command's own help when
    the error comes before click knows the command, e.g. an option missing its value)."""
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command_path", None) or "opdcache"
    if command == "opdcache":
        named = next((a for a in (sys.argv[1:] if argv is None else argv) if a in app_commands()), None)
        if named:
            command = f"opdcache {named}"
    if type(exc).__name__ == "NoArgsIsHelpError":  # the message is the whole help page
        if command == "opdcache":
            names = ", ".join(sorted(app_commands()))
            return f"usage: opdcache COMMAND [OPTIONS]; commands: {names}; see `opdcache --help`"
        return f"usage: {command} needs arguments; see `{command} --help`"
    message = " ".join(str(exc.format_message()).split()).rstrip(".")
    return f"error: {message}; see `{command} --help`"


def _command(argv: list[str] | None) -> str | None:
    """The command this invocation runs (the first argument that names one)."""
    return next((a for a in (sys.argv[1:] if argv is None else argv) if a in app_commands()), None)


def app_commands() -> list[str]:
    return [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]


def _exit(code: int) -> None:
    """Leave with ``code``. A torchrun worker leaves without interpreter shutdown (flushing its output first): the
    process group is destroyed by then, but gloo's worker threads can still free tensors of FSDP's last collectives
    while Python tears down, which aborts the rank ("terminate called without an active exception") and fails a run
    whose work is already on disk."""
    if int(os.environ.get("WORLD_SIZE") or 1) > 1 and "torch.distributed" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


MAX_ERROR_CHARS = 2000  # an error quoting a hostile value (a 100 MB string in a manifest) is cut, never echoed whole


def _one_line(message: str) -> str:
    if len(message) <= MAX_ERROR_CHARS:
        return message
    return message[:MAX_ERROR_CHARS] + f"... ({len(message) - MAX_ERROR_CHARS:,} more characters cut)"


def _config_applied(argv: list[str] | None) -> list[str] | None:
    """``argv`` with a command's ``--config FILE`` settings put before its flags (cli/options.with_config_file), for the
    commands without a ``--config`` of their own; None after ``--print-config`` printed the resolved settings."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--config" or a.startswith("--config=") or a == "--print-config" for a in args):
        return args
    name = _command(args)
    if name is None:
        return args
    command = typer.main.get_command(app).commands[name]
    if any(p.name == "config" for p in command.params):
        return args  # the command reads its own --config (train: its settings dataclass)
    at = args.index(name)
    rest = with_config_file(command, args[at + 1:])
    return None if rest is None else args[: at + 1] + rest


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        argv = _config_applied(argv)
        if argv is None:
            _exit(0)
        code = app(args=argv, standalone_mode=False)  # click returns a typer.Exit's code here
    except OpdcacheError as exc:
        typer.echo(f"error: {_one_line(str(exc))}", err=True)
        bad_input = isinstance(exc, USAGE_ERRORS) or (isinstance(exc, DATA_ERRORS) and _command(argv) not in VERDICT_COMMANDS)
        _exit(2 if bad_input else 1)
    except typer.Exit as exc:
        _exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    except ModuleNotFoundError as exc:
        distribution = distribution_of(exc.name or "")
        if distribution is None:
            raise
        typer.echo(f"error: opdcache needs {distribution}, which this environment cannot import ({exc}): "
                   f"pip install {distribution} (or reinstall opdcache)", err=True)
        _exit(2)
    except Exception as exc:
        if isinstance(exc, _click_exception_types()):
            typer.echo(_usage_line(exc, argv), err=True)
            _exit(2)
        line = _storage_failure(exc)
        if line is None:
            raise
        typer.echo(f"error: {line}", err=True)
        _exit(1)
    if code == 130:  # typer turns Ctrl-C into Exit(130); whatever a stage finished is already on disk under its final name
        typer.echo(INTERRUPTED, err=True)
    _exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

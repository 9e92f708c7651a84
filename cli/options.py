"""Option and argument types shared by several commands, defined once; and the options of a settings dataclass, whose
help is the field's own docstring (:class:`Fields`)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path
from typing import Annotated, Optional

import typer

_NO_DEFAULT = object()
STATES_DEFAULT = re.compile(r"\bdefault\s*[:=]|\(default\b|\bdefaults? (is|to)\b|\bby default\b", re.IGNORECASE)
"""A docstring that states its field's default in words ("(default: none)", "by default ..."); one that only mentions
the word ("the default engine") still gets "Default: X." added."""


@functools.cache
def _source(module: str) -> ast.Module:
    """A library module's syntax tree, read from its source: building the commands imports neither torch nor the library
    (finding a submodule's spec would import its parent packages)."""
    top, *rest = module.split(".")
    path = Path(importlib.util.find_spec(top).origin).parent.joinpath(*rest)
    return ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())


def literal(module: str, name: str) -> object:
    """The value of a module-level constant assigned a literal (``NAME = {...}``), read from the module's source."""
    node = next(n for n in _source(module).body if isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == [name])
    return ast.literal_eval(node.value)


@functools.cache
def _field_docs(module: str, cls: str) -> dict[str, tuple[str, object]]:
    """Each field of the dataclass ``cls`` of ``module``: (its docstring on one line, its literal default or
    _NO_DEFAULT), read from the module's source."""
    body = next(n for n in _source(module).body if isinstance(n, ast.ClassDef) and n.name == cls).body
    docs = {}
    for stmt, after in zip(body, body[1:] + [None]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
        try:
            default = ast.literal_eval(stmt.value) if stmt.value is not None else _NO_DEFAULT
        except ValueError:  # a factory or an expression: the docstring says what it is
            default = _NO_DEFAULT
        docs[stmt.target.id] = (" ".join(str(doc).split()), default)
    return docs


def _said(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


class Fields:
    """The options of a settings dataclass's fields: ``--name`` (underscores as dashes) with the field's docstring as
    its help, so that a setting is described once, where it is declared, and a command cannot drift from it."""

    def __init__(self, module: str, cls: str) -> None:
        self.module, self.cls = module, cls

    def doc(self, name: str) -> str:
        """The field's docstring on one line (KeyError for a name the dataclass does not declare)."""
        return _field_docs(self.module, self.cls)[name][0]

    def default(self, name: str) -> object:
        return _field_docs(self.module, self.cls)[name][1]

    def option(self, name: str, *flags: str, note: str = "", state_default: bool = True, defaults: dict | None = None,
               **kwargs) -> typer.models.OptionInfo:
        """``typer.Option`` for field ``name``: its flags (default ``--name``, or ``--name/--no-name`` for a field that
        defaults to a bool) and help, the docstring then ``note``. With ``state_default`` (an option that defaults to
        None, so that the dataclass or a file of settings supplies the value) the field's default, or ``defaults[name]``
        where the command's differs, is added to the help unless the docstring says it; without, Typer shows the
        command's own default."""
        help = " ".join(part for part in (self.doc(name), note) if part)
        if state_default:
            default = (defaults or {}).get(name, self.default(name))
            if default is not _NO_DEFAULT and not STATES_DEFAULT.search(help):
                help += f" Default: {_said(default)}."
        if not flags:
            flag = "--" + name.replace("_", "-")
            flags = (f"{flag}/--no-{flag[2:]}",) if isinstance(self.default(name), bool) else (flag,)
        return typer.Option(*flags, help=help, show_default=not state_default, **kwargs)


E = Fields("opdcache.backends", "EngineConfig")
S = Fields("opdcache.backends.base", "SamplingConfig")
P = Fields("opdcache.inputs.prompts", "PromptConfig")
G = Fields("opdcache.teacher.rollouts", "GenerateJob")

CachePath = Annotated[str, typer.Argument(metavar="CACHE", help="Cache: the folder holding opdcache.json, or a URL (s3://bucket/prefix, gs://..., hf://datasets/org/name).", show_default=False)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only problems and the final line.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
Token = Annotated[Optional[str], typer.Option("--token", help="Hub token; defaults to HF_TOKEN or your `hf auth login`. Never printed.", show_default=False)]
Revision = Annotated[Optional[str], typer.Option("--revision", help="Hub branch or commit. Default: none (main).")]
NumWorkers = Annotated[Optional[int], typer.Option("--num-workers", help="Workers sharing the job (default: SLURM array size, torchrun WORLD_SIZE, or 1).", show_default=False)]
WorkerIndex = Annotated[Optional[int], typer.Option("--worker-index", help="This worker's index in [0, num-workers) (default: SLURM array index, torchrun RANK, or 0).", show_default=False)]

Executor = Annotated[str, typer.Option("--executor", help="local (this process; --num-workers/--worker-index for Slurm or torchrun) or ray (--workers tasks on a Ray cluster).")]
RayAddress = Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else a local cluster).", show_default=False)]
RayWorkers = Annotated[int, typer.Option("--workers", help="--executor ray: tasks, each with its own engine and whole shards.")]
GpusPerWorker = Annotated[float, typer.Option("--gpus-per-worker", help="--executor ray: GPUs each task reserves.")]
CpusPerWorker = Annotated[float, typer.Option("--cpus-per-worker", help="--executor ray: CPUs each task reserves; it runs that many torch threads.")]

# ---- models and engines
ModelPath = Annotated[str, typer.Option("--model", help="Model: a local Hugging Face directory or a Hub id org/name[@revision] (offline from the Hub cache with HF_HUB_OFFLINE=1).", show_default=False)]
TeacherModel = Annotated[str, typer.Option("--teacher", help="Teacher: a local Hugging Face directory or a Hub id org/name[@revision].", show_default=False)]
ModelRevision = Annotated[Optional[str], typer.Option("--revision", help="Hub branch, tag or commit of the model (or org/name@revision). Default: none (the main branch, resolved to its commit).", show_default=False)]
Backend = Annotated[str, E.option("backend", state_default=False, note=f"One of: {', '.join(literal('opdcache.backends', 'ENGINES'))}.")]
Dtype = Annotated[str, E.option("dtype", state_default=False)]
Device = Annotated[str, E.option("device", state_default=False)]
Quantize = Annotated[Optional[str], E.option("quantize")]
Exact = Annotated[bool, E.option("exact", "--exact", state_default=False)]
InjectMismatch = Annotated[Optional[str], E.option("inject", "--inject-mismatch")]
Deterministic = Annotated[bool, E.option("deterministic", "--deterministic", state_default=False)]
TensorParallel = Annotated[int, E.option("tensor_parallel_size", state_default=False)]
GenerateBatch = Annotated[int, E.option("generate_batch_size", "--batch-size", state_default=False)]
ScoreBatchTokens = Annotated[Optional[int], E.option("max_batch_tokens")]
GpuMemory = Annotated[float, E.option("gpu_memory_utilization", state_default=False)]
ServerUrl = Annotated[Optional[str], E.option("server_url")]
ServerKind = Annotated[str, E.option("server_kind", state_default=False)]
ServerConcurrency = Annotated[Optional[int], E.option("server_concurrency")]
ApiKey = Annotated[Optional[str], E.option("api_key")]

NumShards = Annotated[int, G.option("num_shards", state_default=False)]
Progress = Annotated[Optional[bool], typer.Option("--progress/--no-progress", help="Progress bars (default: only on a terminal).", show_default=False)]

# ---- prompts
Prompts = Annotated[Path, P.option("path", "--prompts", state_default=False)]
PromptField = Annotated[str, P.option("prompt_field", state_default=False)]
MessagesField = Annotated[Optional[str], P.option("messages_field")]
AnswerField = Annotated[str, P.option("answer_field", state_default=False)]
ChatTemplate = Annotated[bool, P.option("chat_template", state_default=False)]
Strict = Annotated[bool, P.option("strict", "--strict", state_default=False)]
SystemPrompt = Annotated[Optional[str], P.option("system_prompt")]
ChatTemplateKwargs = Annotated[Optional[str], P.option("chat_template_kwargs", note="A JSON object on the command line.")]
PromptSplit = Annotated[str, P.option("split", "--prompt-split", state_default=False)]
Limit = Annotated[Optional[int], P.option("limit")]
Reward = Annotated[Optional[str], G.option("reward")]
CreditTruncated = Annotated[bool, G.option("credit_truncated", "--credit-truncated", state_default=False)]

# ---- sampling
Samples = Annotated[int, S.option("samples", state_default=False)]
Temperature = Annotated[float, S.option("temperature", state_default=False)]
TopP = Annotated[float, S.option("top_p", state_default=False)]
MaxNewTokens = Annotated[int, S.option("max_new_tokens", state_default=False)]
Seed = Annotated[int, typer.Option("--seed", help="Random seed.")]


def announce_threads() -> None:
    """Pick torch's CPU threads (opdcache/threads.py); say what was picked and why on a terminal (in logs and pipes the
    manifest's `compute` record says it, and an error stays the one line on stderr)."""
    import sys

    from opdcache.threads import configure

    line = configure()
    if sys.stderr.isatty():
        typer.echo(line, err=True)



MAX_CONFIG_BYTES = 1 << 20  # a file of settings is a few hundred bytes; more is not one


def read_config(path: Path, what: str) -> dict:
    """The settings of a ``--config`` YAML file, as a mapping of field names (``what`` names the fields in messages).
    Refused in one line, before anything loads: a path that is not a regular file, a file over 1 MiB, text that is not
    YAML (with its line), a document that is not a mapping, a key given twice (YAML would keep the last silently)."""
    import yaml

    from opdcache.errors import ConfigError

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: {'no such file' if not path.exists() else 'not a regular file'}; "
                          f"give a YAML file of {what}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config {path} holds {path.stat().st_size:,} bytes, more than a settings file's "
                          f"{MAX_CONFIG_BYTES:,}; give a YAML file of {what}")

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node):
        seen = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if key in seen:
                raise ConfigError(f"--config {path}, line {key_node.start_mark.line + 1}: {key!r} is given twice "
                                  f"(first on line {seen[key]}); keep one")
            seen[key] = key_node.start_mark.line + 1
        return loader.construct_mapping(node)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path} is not UTF-8 text; give a YAML file of {what}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not YAML"
        raise ConfigError(f"--config {path}{where}: {problem}; give a YAML file of {what}") from None
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise ConfigError(f"--config {path} must hold a mapping of {what} (name: value lines), got a {type(values).__name__}")
    return values


SECRET_SETTINGS = {"api_key", "token", "hf_token", "password", "secret"}
"""Settings a printed or saved config never shows."""
PER_PROCESS_SETTINGS = {"num_workers", "worker_index", "config", "print_config"}
"""Settings of one process of a job, not of the stage: left out of the settings saved beside a table."""
PATH_SETTINGS = {"model", "teacher", "prompts", "out", "cache", "sft_teacher"}
"""Settings that name a local path or a Hub id / URL: saved as absolute paths where they name a local one."""


def resolved_settings(params: dict, drop: set = frozenset()) -> str:
    """A command's resolved parameters (click's ``ctx.params``) as ``--config`` YAML: secrets left out or redacted,
    paths as text."""
    import yaml

    def plain(v):
        return str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v

    shown = {k: ("<redacted>" if v is not None and k in SECRET_SETTINGS else plain(v)) for k, v in params.items() if k not in drop}
    return yaml.safe_dump(shown, sort_keys=False, default_flow_style=False).rstrip() + "\n"


def save_stage_settings(params: dict, cache, *table: str) -> None:
    """Write a command's resolved settings (its context's ``params``) beside the table it wrote (``STAGE_SETTINGS``),
    secrets and per-process settings left out, so that ``--config <table>/settings.yaml`` reruns the stage."""
    import os

    from opdcache import storage
    from opdcache.format.cache import STAGE_SETTINGS

    def absolute(v):  # a local path the stage read or wrote, from wherever it is rerun (a Hub id or URL stays)
        return os.path.abspath(v) if isinstance(v, (str, Path)) and "://" not in str(v) and os.path.exists(v) else v

    params = {k: absolute(v) if k in PATH_SETTINGS else v for k, v in params.items()}
    storage.write_text_atomic(storage.as_path(cache).joinpath(*table, STAGE_SETTINGS),
                              resolved_settings(params, PER_PROCESS_SETTINGS | SECRET_SETTINGS))


def with_config_file(command, argv: list[str]) -> list[str] | None:
    """``argv`` (the arguments after the command's name) with the settings of its ``--config FILE`` put in front, so
    that the flags given override the file, for a command without a ``--config`` of its own; None when ``argv`` holds
    ``--print-config`` (the resolved settings are printed as YAML, and nothing runs). A key names a setting by its
    parameter name or its flag (``top_k``, ``top-k``); one that names none, or a value its flag refuses, is one line
    naming the key. ``command``: the click command."""
    from opdcache.errors import ConfigError

    argv = list(argv)
    printing = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    path, rest = None, []
    it = iter(range(len(argv)))
    for i in it:
        if argv[i] == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
            next(it, None)
        elif argv[i].startswith("--config="):
            path = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
    if path is None and not printing:
        return argv
    params = {p.name: p for p in command.params if p.name != "help"}
    values = read_config(Path(path), f"`{command.name}` settings (its flags' names)") if path else {}
    ctx = command.make_context(command.name, list(rest), resilient_parsing=True)
    given = {name for name in params if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}
    positional: dict[str, str] = {}
    options: list[str] = []
    for key, value in values.items():
        name = key.replace("-", "_")
        param = params.get(name)
        if param is None:
            known = ", ".join(sorted(n.replace("_", "-") for n, p in params.items() if not getattr(p, "hidden", False)))
            raise ConfigError(f"--config {path}: {key!r} names no setting of `opdcache {command.name}`; its settings are {known}")
        if name in given or value is None:
            continue
        try:
            value = param.process_value(ctx, value)
        except Exception as exc:  # noqa: BLE001 (click's BadParameter, from click or typer's copy of it)
            raise ConfigError(f"--config {path}: {key}: {getattr(exc, 'message', str(exc))}") from None
        if param.param_type_name == "argument":
            positional[name] = str(value)
        elif getattr(param, "multiple", False):
            for item in value:
                options += [param.opts[0], str(item)]
        elif getattr(param, "is_flag", False):
            switch = param.opts[0] if value else (param.secondary_opts[0] if param.secondary_opts else None)
            if switch is not None:
                options.append(switch)
        else:
            options += [param.opts[0], str(value)]
    ordered = [positional[n] for n in params if n in positional]  # the file's positionals, in the command's order
    merged = ordered + options + rest
    if not printing:
        return merged
    import typer

    ctx = command.make_context(command.name, merged)
    typer.echo(resolved_settings(ctx.params).rstrip())
    return None



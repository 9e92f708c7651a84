"""Every command's help reads at 80 columns: no option name truncated, no <bool> beside switches, every option
described, and the defaults the help states for `train` are TrainConfig's."""

import os
import re
import subprocess
import sys

import pytest
import typer

from opdcache.cli.main import _register, app

_register()
COMMAND = typer.main.get_command(app)
NAMES = sorted(COMMAND.commands)


def _help(*args) -> str:
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    proc = subprocess.run([sys.executable, "-m", "opdcache.cli.main", *args, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("name", NAMES)
def test_help_at_80_columns(name):
    text = _help(name)
    assert "<bool>" not in text and "…" not in text
    wide = [l for l in text.splitlines() if len(l) > 80]
    assert not wide, wide
    for param in COMMAND.commands[name].params:
        if param.param_type_name == "option" and not param.hidden:
            assert (param.help or "").strip(), f"{name} {param.opts[0]} has no description"
            for opt in param.opts:
                assert opt in text, f"{name}: {opt} missing from the help"


def test_the_top_level_help_lists_every_command():
    text = _help()
    assert all(name in text for name in NAMES)


def _options(name):
    return {p.name: p for p in COMMAND.commands[name].params if p.param_type_name == "option" and not p.hidden}


STATES_DEFAULT = re.compile(r"\bdefaults?\s*[:=]|\(default\b|\bdefaults? (is|to)\b|\bby default\b", re.IGNORECASE)
"""A help text that states a default: "Default: X.", "(default: ...)", "by default ..."; the bare word ("the default
engine") is not one (such a field's default was hidden from its help)."""


def _stated_default(help: str) -> str | None:
    """The default the help states as "Default: X." at its end; None where the docstring says it in words."""
    match = re.search(r"Default: ([^ ]+?)\.?$", help)
    assert match or STATES_DEFAULT.search(help), help
    return match.group(1) if match else None


def _said(value) -> str:
    return "none" if value is None else ("on" if value else "off") if isinstance(value, bool) else str(value)


def test_each_setting_is_described_once_where_it_is_declared():
    """train's options that set a TrainConfig (or Corrections) field, and async's that set its learner's or its own
    fields, have as help that field's docstring, whitespace aside (found in the class's source), and state the default
    the settings object really has (async: its learner's, where they differ from train's)."""
    import dataclasses
    import inspect

    from opdcache.asyncopd.config import LEARNER_SETTINGS, AsyncConfig, learner
    from opdcache.training.losses import Corrections
    from opdcache.training.trainconfig import TrainConfig

    def source(cls):
        return " ".join(inspect.getsource(cls).replace('"""', " ").split())

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) + dataclasses.fields(Corrections)}
    checked = 0
    for name, param in _options("train").items():
        if name not in defaults:
            continue
        cls = Corrections if name in {f.name for f in dataclasses.fields(Corrections)} else TrainConfig
        first = param.help.split(". ")[0]
        assert first in source(cls), (name, first)
        if defaults[name] is not dataclasses.MISSING and _stated_default(param.help) is not None:
            assert _stated_default(param.help) == _said(defaults[name]), name
        checked += 1
    assert checked >= 40
    run = learner("m")
    own = {f.name: f.default for f in dataclasses.fields(AsyncConfig)}
    for name, param in _options("async").items():
        if name in own and own[name] is not dataclasses.MISSING:
            assert param.help.split(". ")[0] in source(AsyncConfig), name
            assert _stated_default(param.help) in (_said(own[name]), None), name
        elif name in LEARNER_SETTINGS:
            assert param.help.split(". ")[0] in source(TrainConfig), name
            if name != "model":
                assert _stated_default(param.help) in (_said(getattr(run, name)), None), name
            checked += 1
    assert checked >= 40 + 12


def test_info_fits_80_columns(hf_cache, capsys):
    from opdcache.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["info", str(hf_cache)])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "rollouts" in out
    assert not [l for l in out.splitlines() if len(l) > 80 and str(hf_cache) not in l]


def test_every_option_of_every_command_states_its_default_or_that_it_is_required():
    """`train --help` gave no default for 18 of 37 options; the other commands for 29. An option is silent
    when its help says neither a default nor required, Typer shows no default for it, and it is not marked required
    (Typer prints "[required]")."""
    from typer.core import TyperArgument
    from typer.main import get_command

    from opdcache.cli import main as m

    m._register()
    silent = [f"{name} {p.opts[0]}" for name, cmd in get_command(m.app).commands.items() for p in cmd.params
              if not isinstance(p, TyperArgument) and not p.required and not getattr(p, "hidden", False) and p.name != "help"
              and not STATES_DEFAULT.search(p.help or "") and "required" not in (p.help or "").lower()
              and not (p.show_default and p.default is not None)]
    assert silent == []


SHARED = {  # the option types several commands share (cli/options.py) -> the settings dataclass that declares them
    "EngineConfig": ("Backend", "Dtype", "Device", "Quantize", "Exact", "InjectMismatch", "Deterministic", "TensorParallel",
                     "GenerateBatch", "ScoreBatchTokens", "GpuMemory"),
    "SamplingConfig": ("Samples", "Temperature", "TopP", "MaxNewTokens"),
    "PromptConfig": ("Prompts", "PromptField", "MessagesField", "AnswerField", "ChatTemplate", "Strict", "SystemPrompt",
                     "ChatTemplateKwargs", "PromptSplit", "Limit"),
    "GenerateJob": ("Reward", "CreditTruncated", "NumShards"),
}


def test_the_engine_sampling_and_prompt_options_are_their_settings_docstrings():
    """The option types build-sft, build-rollouts, score-teacher, async and the rest share are declared by the settings
    dataclass the commands build (EngineConfig, SamplingConfig, PromptConfig, GenerateJob): each one's help begins with
    its field's docstring (found in the class's source), and build-rollouts shows that help."""
    import inspect
    import typing

    from opdcache.backends import EngineConfig
    from opdcache.backends.base import SamplingConfig
    from opdcache.cli import options as O
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob

    sources = {cls.__name__: " ".join(inspect.getsource(cls).replace('"""', " ").replace("\\\\", "\\").split())
               for cls in (EngineConfig, SamplingConfig, PromptConfig, GenerateJob)}  # the source escapes \boxed
    shown = {p.opts[0]: p.help for p in COMMAND.commands["build-rollouts"].params if p.param_type_name == "option"}
    for cls, names in SHARED.items():
        for name in names:
            info = typing.get_args(getattr(O, name))[1]
            first = info.help.split(". ")[0]
            assert first in sources[cls], (name, first)
            flag = next(d for d in (info.default, *info.param_decls) if isinstance(d, str) and d.startswith("--")).split("/")[0]
            if flag in shown:
                assert shown[flag] == info.help, name


def test_score_teachers_store_options_are_scorejobs_docstrings():
    """score-teacher's own options (the stores' settings, --prompts, --name) have ScoreJob's field docstrings as help."""
    import dataclasses
    import inspect

    from opdcache.teacher.scoring import ScoreJob

    source = " ".join(inspect.getsource(ScoreJob).replace('"""', " ").split())
    fields = {f.name for f in dataclasses.fields(ScoreJob)}
    checked = 0
    for param in COMMAND.commands["score-teacher"].params:
        field = "slug" if param.name == "name" else param.name
        if param.param_type_name == "option" and field in fields and field not in ("teacher", "revision", "num_workers", "worker_index", "progress"):  # shared types
            assert param.help.split(". ")[0] in source, param.opts[0]
            checked += 1
    assert checked >= 13


def test_a_docstring_that_only_uses_the_word_default_still_gets_its_default_printed():
    """--teacher-weights' docstring says "default equal" of the weights: the option's own default (none) is printed too;
    a docstring that states its default ("(default: ...)") is left as it is."""
    from opdcache.cli.options import Fields, P

    weights = Fields("opdcache.training.trainconfig", "TrainConfig").option("teacher_weights").help
    assert "default equal" in weights and weights.endswith("Default: none."), weights
    messages = P.option("messages_field").help
    assert "(default: none" in messages and "Default:" not in messages, messages


CONFIG_FILE_ONLY = {"corrections": "a nested setting: each of its fields is a flag of its own (--tis-cap, --reject-k, ...)"}
"""TrainConfig fields that are no flag of `train`, each with its reason."""


def test_every_training_setting_is_a_flag_or_config_file_only_with_a_reason():
    """9 of TrainConfig's 49 fields had no flag (and an error message named --topk-support, which did not exist)."""
    import dataclasses

    from opdcache.training.losses import Corrections
    from opdcache.training.trainconfig import TrainConfig

    flags = {p.name for p in COMMAND.commands["train"].params}
    unreachable = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in flags and f.name not in CONFIG_FILE_ONLY]
    assert unreachable == []
    assert [f.name for f in dataclasses.fields(Corrections) if f.name not in flags] == []
    assert all(CONFIG_FILE_ONLY.values())
    assert "--topk-support" in _help("train")


STAGE_FILE_ONLY = {
    ("async", "AsyncConfig"): {"learner": "a nested setting: its fields are flags (LEARNER_SETTINGS)",
                               "sampling": "a nested setting: its fields are flags (--temperature, --top-p, ...)",
                               "gpus_per_stage": "the flag --gpus takes the three numbers"},
    ("build-rollouts", "GenerateJob"): {"kind": "the command is the kind (build-sft or build-rollouts)",
                                        "sampling": "a nested setting: its fields are flags", "engine": "a nested setting: its fields are flags",
                                        "keep": "build-sft's (--keep): rollouts keep every sample",
                                        "finalize": "the Ray driver's: its workers leave the manifest to it"},
    ("score-teacher", "ScoreJob"): {"stores": "the flag --store", "slug": "the flag --name", "engine": "a nested setting: its fields are flags",
                                    "svd_seed": "library only (ScoreJob): the svd calibration draw's seed, whose default every table so far used",
                                    "finalize": "the Ray driver's: its workers leave the manifest to it",
                                    "prepare_only": "the Ray driver's: side files before the workers start"},
    ("build-sft", "GenerateJob"): {"model": "the flag --teacher (the model that samples is the SFT teacher)",
                                   "kind": "the command is the kind (build-sft or build-rollouts)",
                                   "sampling": "a nested setting: its fields are flags", "engine": "a nested setting: its fields are flags",
                                   "sft_teacher": "build-rollouts' (the rollouts' SFT lineage); an SFT cache's teacher is --teacher",
                                   "finalize": "the Ray driver's: its workers leave the manifest to it"},
    ("audit", "AuditConfig"): {"server": "a nested setting: the flags --server-url, --server-kind, --api-key"},
    ("eval", "EvalJob"): {"sampling": "a nested setting: its fields are flags", "engine": "a nested setting: its fields are flags",
                          "examples": "library only: how many judged responses the report keeps (the CLI's report prints 3)"},
    ("sft", "SFTConfig"): {},
    ("plan", "PlanConfig"): {"students": "the flag --student, repeatable"},
}
"""Each stage's settings dataclass fields that are no flag of its command, each with its reason."""


@pytest.mark.parametrize("command, config", sorted(STAGE_FILE_ONLY), ids=[c for c, _ in sorted(STAGE_FILE_ONLY)])
def test_every_stage_setting_is_a_flag_or_listed_with_a_reason(command, config):
    import dataclasses
    import importlib

    module = {"AsyncConfig": "opdcache.asyncopd.config", "GenerateJob": "opdcache.teacher.rollouts",
              "ScoreJob": "opdcache.teacher.scoring", "AuditConfig": "opdcache.teacher.audit",
              "EvalJob": "opdcache.evaluation.evaluate", "SFTConfig": "opdcache.training.sft", "PlanConfig": "opdcache.teacher.plan"}[config]
    cls = getattr(importlib.import_module(module), config)
    flags = {p.name for p in COMMAND.commands[command].params}
    listed = STAGE_FILE_ONLY[(command, config)]
    assert [f.name for f in dataclasses.fields(cls) if f.name not in flags and f.name not in listed] == []
    assert set(listed) <= {f.name for f in dataclasses.fields(cls)} and all(listed.values())
    assert not set(listed) & flags  # a listed setting is not a flag after all: the list is stale
    if config == "AsyncConfig":
        from opdcache.asyncopd.config import LEARNER_SETTINGS

        assert [n for n in LEARNER_SETTINGS if n not in flags and n != "model"] == []

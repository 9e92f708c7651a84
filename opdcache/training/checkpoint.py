"""Training checkpoints: one format for the offline, online and async learners.

A checkpoint is a directory ``<out>/checkpoint/`` holding the model (``save_pretrained``: safetensors + config), the
optimizer's tensors (``optimizer.safetensors``, keyed ``<parameter index>.<state name>``, plus the torch RNG state) and
``trainer_state.json`` (step, optimizer param groups, the run's settings, the batch source's position, and the
fingerprints of what it was trained from: the student and the cache's tables). No pickle.

Crash safety: a new checkpoint is written whole under a fresh ``.checkpoint.tmp-<pid>-<random>`` (``trainer_state.json``
last: its presence marks the directory complete), then the old one is renamed aside to ``.checkpoint.old-<pid>-<random>``,
the new one renamed into place and the old one removed. A crash can stop this sequence anywhere; :func:`newest_complete`
looks at every candidate (``checkpoint``, ``.checkpoint.tmp-*``, ``.checkpoint.old-*``), takes the complete one with the
highest step, moves it into place and removes the rest, so a resume never restarts from step 1 beside a good checkpoint
and never leaves a temporary directory behind.

A checkpoint is untrusted input (a run folder taken from someone else; :mod:`opdcache.training.runfolder`): the trainer
state is read within limits and checked against its schema (steps are non-negative integers, no later than the settings
it records allow); the optimizer is built from this run's settings, never from the file's hyper-parameters (the file
supplies only the moments, each named by a parameter of the student and of its shape); the weights are read from the
safetensors files by name and shape (no model is built from the checkpoint's config); the RNG state must be torch's.
A setting a checkpoint predates takes the field's default, reported once, so an upgrade resumes older checkpoints.
"""

from __future__ import annotations

import json
import sys
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path

import torch

from opdcache.errors import ConfigError, RunFolderError
from opdcache.training import runfolder

STATE_FILE = "trainer_state.json"
IGNORED_ON_RESUME = {"stop_after", "steps", "progress", "checkpoint_every", "tensorboard", "num_loader_workers", "save_dtype", "pack",
                     "out", "report_to", "save", "eval_every", "eval_prompts", "eval_reward", "eval_samples", "eval_temperature",
                     "eval_max_new_tokens"}
"""Settings a resumed run may change: they decide when to stop, what to print, how often to save, where the run folder
is (a run folder moved or pulled resumes) and how the same rows are laid out for the forward (``pack``: the same losses
to float32's rounding), not the numbers."""
OPTIMIZER_STATE = {"step": (), "exp_avg": None, "exp_avg_sq": None}
"""AdamW's per-parameter state: a scalar step and two moments of the parameter's shape (None: the parameter's)."""


def _step_of(path: Path) -> int | None:
    """The step of a complete checkpoint; None for one without its state file (a save stopped before its end). A
    state file is written whole or not at all, so one that is there but unreadable is refused, never skipped."""
    if not (path / STATE_FILE).exists() and not (path / STATE_FILE).is_symlink():
        return None
    return read_state(path.parent, path)["step"]


def _candidates(out: Path) -> list[Path]:
    return [p for p in [out / "checkpoint", *out.glob(".checkpoint.tmp-*"), *out.glob(".checkpoint.old-*")]
            if p.is_dir() and not p.is_symlink()]


def _newest(out: Path) -> Path | None:
    """The complete checkpoint with the highest step (on a tie, the one in place), found without moving anything."""
    complete = [(step, p.name == "checkpoint", p) for p in _candidates(out) if (step := _step_of(p)) is not None]
    return max(complete, key=lambda c: c[:2])[2] if complete else None


def newest_complete(out: Path) -> Path | None:
    """The newest complete checkpoint under ``out``, moved to ``out/checkpoint``; every other candidate is removed."""
    import shutil

    runfolder.check_folder(out)
    final = out / "checkpoint"
    candidates = _candidates(out)
    if not candidates:
        return None
    best = _newest(out)
    for p in candidates:
        if p != best and p != final:
            shutil.rmtree(p, ignore_errors=True)
    if best is None:
        shutil.rmtree(final, ignore_errors=True)
        return None
    if best != final:
        shutil.rmtree(final, ignore_errors=True)
        best.rename(final)
    return final


def _nonnegative_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_state(out: Path, ckpt: Path) -> dict:
    """``trainer_state.json`` of ``ckpt``, read by the run folder's rules and checked against its schema."""
    state = runfolder.read_json(out, ckpt / STATE_FILE)
    where = ckpt / STATE_FILE

    def bad(what: str) -> RunFolderError:
        return RunFolderError(f"{where}: {what}; the checkpoint is damaged or was not written by opdcache: train into a new --out")

    if not isinstance(state, dict):
        raise bad("not a JSON object")
    if not _nonnegative_int(state.get("step")):
        raise bad(f"step is {state.get('step')!r}, not a non-negative integer")
    config = state.get("config")
    if not isinstance(config, dict):
        raise bad("its settings (config) are not a JSON object")
    if _nonnegative_int(config.get("steps")) and state["step"] > config["steps"]:
        raise bad(f"step {state['step']:,} is past the {config['steps']:,} steps its own settings ask for")
    if not isinstance(state.get("param_groups"), list) or not all(isinstance(g, dict) for g in state["param_groups"]):
        raise bad("param_groups is not a list of JSON objects")
    if state.get("loader") is not None and not isinstance(state["loader"], dict):
        raise bad("the batch source's position (loader) is not a JSON object")
    loader = state.get("loader") or {}
    for key, value in loader.items():
        if isinstance(value, (int, float)) and not _nonnegative_int(value):
            raise bad(f"the batch source's {key} is {value!r}, not a non-negative integer")
    if state.get("trained_from") is not None and not isinstance(state["trained_from"], dict):
        raise bad("trained_from is not a JSON object")
    return state


def _full_state(trainer) -> tuple[dict | None, dict[str, torch.Tensor], list[dict]]:
    """(model state dict, or None to save the live model; optimizer tensors keyed '<parameter index>.<name>';
    param groups). Under FSDP every rank must call it: the full tensors are gathered to rank 0's CPU."""
    names = {n: i for i, (n, _) in enumerate(trainer.model.named_parameters())}
    model_sd = None
    if trainer.cfg.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = {k.removeprefix("model."): v for k, v in get_model_state_dict(trainer.forward, options=options).items()}
        optim = get_optimizer_state_dict(trainer.forward, trainer.opt, options=options)
        per_param = {names[fqn.removeprefix("model.")]: st for fqn, st in optim.get("state", {}).items()}
    else:
        index = {id(p): i for i, p in enumerate(trainer.model.parameters())}
        per_param = {index[id(p)]: st for p, st in trainer.opt.state.items()}
    tensors = {f"{i}.{k}": v.detach().cpu().contiguous() if torch.is_tensor(v) else torch.tensor(v)
               for i, st in per_param.items() for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.opt.param_groups]
    return model_sd, tensors, groups


def full_model_state(trainer) -> dict | None:
    """The whole model's state on rank 0's CPU under FSDP (every rank calls it), None otherwise (save the live model)."""
    if not trainer.cfg.fsdp:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k.removeprefix("model."): v for k, v in get_model_state_dict(trainer.forward, options=options).items()}


def trained_from(trainer) -> dict:
    """Fingerprints of what a run trains from: the student it started from and the cache's tables (their config
    fingerprints), so a resume beside another student or cache at the same paths is refused."""
    from opdcache.inputs.fingerprint import model_fingerprint

    record = {"student": model_fingerprint(trainer.model_path)}
    if trainer.cfg.cache is not None and not trainer.cfg.online:
        from opdcache.format.cache import Cache

        try:
            tables = Cache(trainer.cfg.cache).manifest["tables"]
        except (OSError, ValueError):
            tables = {}  # an async run's cache, still growing: its batches carry their own identity
        record["cache"] = {name: t.get("config_fingerprint") for name, t in sorted(tables.items()) if isinstance(t, dict)}
    return record


def save(trainer) -> dict | None:
    """Write ``checkpoint/`` atomically (rank 0); every rank calls it. Returns the full model state (FSDP) for reuse."""
    from safetensors.torch import save_file

    from opdcache.storage import write_text_atomic

    if not trainer.cfg.fsdp and trainer.rank != 0:
        return None
    model_sd, tensors, groups = _full_state(trainer)
    if trainer.rank != 0:
        return None
    out = trainer.cfg.out
    runfolder.check_folder(out)
    tmp = runfolder.fresh_dir(out, ".checkpoint.tmp-")
    with runfolder.writing(tmp, "the checkpoint"):
        if getattr(trainer, "lora", False):  # a LoRA student: its adapters only (the base is --model's, by fingerprint)
            from opdcache.training.lora import ADAPTER_FILE, adapter_state

            save_file(adapter_state(trainer.model), str(tmp / ADAPTER_FILE))
        else:
            trainer.model.save_pretrained(tmp / "model", state_dict=model_sd)
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        state = {"step": trainer.step, "param_groups": groups, "config": json.loads(json.dumps(asdict(trainer.cfg), default=str)),
                 "loader": trainer.source.state_dict(), "trained_from": trained_from(trainer)}
        write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=2))  # last: marks the directory complete
    runfolder.place_dir(tmp, out / "checkpoint")
    return model_sd


def setting_defaults(cfg) -> dict:
    """Each setting's default (the fields of the dataclass or dataclass instance ``cfg``), in the JSON form a
    checkpoint or a run record holds (a field without one: absent)."""
    out = {}
    for f in fields(cfg):
        if f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING:
            value = f.default_factory()
        else:
            continue
        out[f.name] = json.loads(json.dumps(asdict(value) if is_dataclass(value) else value, default=str))
    return out


def settings_diff(saved: dict, mine: dict, defaults: dict | None = None) -> tuple[list[str], list[str]]:
    """('name: old -> new' for every setting that differs and matters on resume, 'name = default' for every setting
    the checkpoint predates: it was written before the setting existed, which then takes its default). A setting the
    checkpoint records that this version no longer has is not a difference (it was removed)."""
    defaults = defaults or {}
    predates = sorted(k for k in mine if k not in saved and k in defaults and k not in IGNORED_ON_RESUME)
    old = {**{k: defaults[k] for k in predates}, **saved}
    keys = sorted(k for k in mine if k not in IGNORED_ON_RESUME and mine.get(k) != old.get(k))
    return [f"{k}: {old.get(k)!r} -> {mine.get(k)!r}" for k in keys], [f"{k} = {defaults[k]!r}" for k in predates]


def _same_settings(ckpt: Path, state: dict, cfg, report: bool = False) -> None:
    diff, predates = settings_diff(state["config"], json.loads(json.dumps(asdict(cfg), default=str)), setting_defaults(cfg))
    if diff:
        raise ConfigError(f"{ckpt} was written with different settings ({', '.join(diff)}); use the original settings to resume, "
                          "or a new --out")
    if predates and report:
        print(f"resume: {ckpt} predates the settings {', '.join(predates)}: it was trained with their defaults", file=sys.stderr)


def prior_run(cfg) -> int | None:
    """What ``cfg.out`` already holds, before anything loads: a link where the run reads or writes, a damaged trainer
    state and a checkpoint written with other settings are refused in one line; the step of a run that already did
    what ``cfg`` asks is returned (its checkpoint complete, at ``cfg.steps`` or beyond, and the final model beside it
    in the dtype asked for); else None (nothing there, or a run to resume). Reads only: every rank of a distributed run
    may ask at once."""
    if cfg.out.exists() and not cfg.out.is_dir():
        raise ConfigError(f"--out {cfg.out} is a file, not a folder: give the folder that holds (or will hold) the run's "
                          "checkpoint/, model/ and metrics.jsonl")
    runfolder.check_folder(cfg.out)
    ckpt = _newest(cfg.out)
    if ckpt is None:
        return None
    state = read_state(cfg.out, ckpt)
    _same_settings(ckpt, state, cfg)
    step = state["step"]
    config_path = cfg.out / "model" / "config.json"
    if cfg.lora_rank and cfg.save != "merged":  # a PEFT adapter folder
        config_path = cfg.out / "model" / "adapter_config.json"
    if not config_path.is_file():
        return None  # no final model yet: the run resumes and saves it
    try:
        model_dtype = runfolder.read_json(cfg.out, config_path).get("dtype")
    except (RunFolderError, AttributeError):
        return None  # a final model that is not ours: the run resumes and saves it anew
    if cfg.checkpoint != "full" or step < cfg.steps or ckpt.name != "checkpoint":
        return None
    if cfg.save_dtype != "auto" and config_path.name == "config.json" and model_dtype != cfg.save_dtype:
        return None  # the same run, its final model wanted in another dtype: resumed, and saved again
    return step


def _bad_checkpoint(path, what: str) -> RunFolderError:
    return RunFolderError(f"{path}: {what}; the checkpoint is damaged or belongs to another student: train into a new --out")


def _read_tensors(out: Path, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors file, its header checked within limits before anything is read."""
    from safetensors.torch import load_file

    from opdcache.untrusted import safetensors_problem

    size = runfolder.regular_file(out, path, 1 << 62)
    problem = safetensors_problem(path, size, ())
    if problem is not None:
        raise _bad_checkpoint(path, problem)
    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 (safetensors raises SafetensorError, OSError, ValueError)
        raise _bad_checkpoint(path, f"unreadable ({type(exc).__name__}: {str(exc)[:200]})") from None


def _model_weights(out: Path, folder: Path, expected: dict[str, torch.Tensor], aliases: dict[str, list[str]],
                   files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's weights by the student's parameter names: every name the student has (tied weights may be
    stored once), no other, each of the student's shape, finite, cast to the student's dtype. ``files``: the
    safetensors files to read (default: every one in ``folder``)."""
    if files is None:
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    files = [f for f in files if f.is_file() or f.is_symlink()]
    if not files:
        raise _bad_checkpoint(folder, "holds no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in _read_tensors(out, path).items():
            want = expected.get(name)
            if want is None:
                raise _bad_checkpoint(path, f"holds a tensor {name[:200]!r} the student does not have")
            if tuple(tensor.shape) != tuple(want.shape):
                raise _bad_checkpoint(path, f"tensor {name!r} is {list(tensor.shape)}, the student's is {list(want.shape)}")
            if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
                raise _bad_checkpoint(path, f"tensor {name!r} is not finite floating-point values")
            weights[name] = tensor.to(want.dtype)
    missing = [n for n in expected if not any(a in weights for a in aliases.get(n, [n]))]
    if missing:
        raise _bad_checkpoint(folder, f"lacks {len(missing)} of the student's tensors ({', '.join(missing[:3])}...)")
    return weights


def _optimizer_state(path: Path, tensors: dict[str, torch.Tensor], params: list[torch.Tensor]) -> dict[int, dict]:
    """The optimizer tensors by parameter index, each named as AdamW names its state and of its parameter's shape."""
    per_param: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("rng."):
            continue
        i, _, name = key.partition(".")
        if not i.isdigit() or int(i) >= len(params) or name not in OPTIMIZER_STATE:
            raise _bad_checkpoint(path, f"holds {key[:200]!r}, which is no optimizer state of the student's "
                                  f"{len(params)} parameters ({', '.join(OPTIMIZER_STATE)})")
        shape = OPTIMIZER_STATE[name] if OPTIMIZER_STATE[name] is not None else tuple(params[int(i)].shape)
        if tuple(value.shape) != shape or not value.is_floating_point() or not bool(torch.isfinite(value).all()):
            raise _bad_checkpoint(path, f"{key!r} is {list(value.shape)} {str(value.dtype).replace('torch.', '')}, "
                                  f"finite floats of shape {list(shape)} expected")
        per_param.setdefault(int(i), {})[name] = value
    incomplete = [i for i, st in per_param.items() if set(st) != set(OPTIMIZER_STATE)]
    if incomplete:
        raise _bad_checkpoint(path, f"parameter {incomplete[0]}'s state lacks {sorted(set(OPTIMIZER_STATE) - set(per_param[incomplete[0]]))}")
    rng = tensors.get("rng.torch")
    mine = torch.get_rng_state()
    if rng is None or rng.dtype != mine.dtype or rng.shape != mine.shape:
        raise _bad_checkpoint(path, "holds no torch RNG state of torch's shape (rng.torch)")
    return per_param


def resume(trainer) -> bool:
    """Load the newest complete checkpoint into the trainer (model, optimizer moments, RNG, step, source position),
    each checked against the student and this run's settings first."""
    out = trainer.cfg.out
    ckpt = newest_complete(out) if trainer.rank == 0 or not trainer.ddp else out / "checkpoint"
    if trainer.ddp:
        torch.distributed.barrier()  # rank 0 may have just moved a checkpoint into place
        ckpt = out / "checkpoint"
    if ckpt is None or not (ckpt / STATE_FILE).is_file():
        return False
    state = read_state(out, ckpt)
    _same_settings(ckpt, state, trainer.cfg, report=trainer.rank == 0)
    recorded, mine = state.get("trained_from") or {}, trained_from(trainer)
    changed = [k for k in ("student", "cache") if k in recorded and recorded[k] != mine.get(k)]
    if changed:
        raise RunFolderError(f"{ckpt} was trained from another {' and '.join(changed)} than this run's (its fingerprints "
                             "differ); resume beside what it was trained from, or train into a new --out")
    if getattr(trainer, "lora", False):  # the adapters only, by the student's trainable parameters' names and shapes
        from opdcache.training.lora import ADAPTER_FILE

        expected = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
        weights = _model_weights(out, ckpt, expected, {}, files=[ckpt / ADAPTER_FILE])
    else:
        expected = trainer.model.state_dict()
        tied: dict[int, list[str]] = {}
        for name, p in trainer.model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        weights = _model_weights(out, ckpt / "model", expected, {n: names for names in tied.values() for n in names})
    tensors = _read_tensors(out, ckpt / "optimizer.safetensors")
    params = list(trainer.model.parameters())
    per_param = _optimizer_state(ckpt / "optimizer.safetensors", tensors, params)
    if trainer.cfg.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        names = [f"model.{n}" for n, _ in trainer.model.named_parameters()]
        set_model_state_dict(trainer.forward, {f"model.{k}": v for k, v in weights.items()}, options=options)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.opt.param_groups]  # this run's settings
        optim = {"state": {names[i]: st for i, st in per_param.items()},
                 "param_groups": [{**g, "params": names} for g in groups]}
        set_optimizer_state_dict(trainer.forward, trainer.opt, optim, options=options)
    else:
        trainer.model.load_state_dict(weights, strict=False)  # tied weights stored once: _model_weights checked the rest
        for i, st in per_param.items():
            trainer.opt.state[params[i]].update({k: v.to(trainer.device) if k != "step" else v for k, v in st.items()})
    torch.set_rng_state(tensors["rng.torch"])
    trainer.step = state["step"]
    if state["loader"] is not None:
        trainer.source.load_state_dict(state["loader"])
    return True

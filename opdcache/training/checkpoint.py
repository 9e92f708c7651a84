"""Training checkpoints: one format for the offline, online and async learners.

A checkpoint is a directory ``<out>/checkpoint/`` holding the model (``save_pretrained``: safetensors + config), the
optimizer's tensors (``optimizer.safetensors``, keyed ``<parameter index>.<state name>``, plus the torch RNG state) and
``trainer_state.json`` (step, optimizer param groups, the run's settings, the batch source's position). No pickle.

Crash safety: a new checkpoint is written whole under ``.checkpoint.tmp-<pid>`` (``trainer_state.json`` last: its
presence marks the directory complete), then the old one is renamed aside to ``.checkpoint.old-<pid>``, the new one
renamed into place and the old one removed. A crash can stop this sequence anywhere; :func:`newest_complete` looks at
every candidate (``checkpoint``, ``.checkpoint.tmp-*``, ``.checkpoint.old-*``), takes the complete one with the highest
step, moves it into place and removes the rest, so a resume never restarts from step 1 beside a good checkpoint and
never leaves a temporary directory behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from opdcache.errors import ConfigError

STATE_FILE = "trainer_state.json"
IGNORED_ON_RESUME = {"stop_after", "steps", "progress", "checkpoint_every", "tensorboard", "num_loader_workers", "save_dtype", "pack"}
"""Settings a resumed run may change: they decide when to stop, what to print, how often to save and how the same rows are
laid out for the forward (``pack``: the same losses to float32's rounding), not the numbers."""


def _step_of(path: Path) -> int | None:
    try:
        return int(json.loads((path / STATE_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # incomplete (no state file yet) or unreadable: not a checkpoint


def _candidates(out: Path) -> list[Path]:
    return [p for p in [out / "checkpoint", *out.glob(".checkpoint.tmp-*"), *out.glob(".checkpoint.old-*")] if p.is_dir()]


def _newest(out: Path) -> Path | None:
    """The complete checkpoint with the highest step (on a tie, the one in place), found without moving anything."""
    complete = [(step, p.name == "checkpoint", p) for p in _candidates(out) if (step := _step_of(p)) is not None]
    return max(complete, key=lambda c: c[:2])[2] if complete else None


def newest_complete(out: Path) -> Path | None:
    """The newest complete checkpoint under ``out``, moved to ``out/checkpoint``; every other candidate is removed."""
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


def save(trainer) -> dict | None:
    """Write ``checkpoint/`` atomically (rank 0); every rank calls it. Returns the full model state (FSDP) for reuse."""
    from safetensors.torch import save_file

    if not trainer.cfg.fsdp and trainer.rank != 0:
        return None
    model_sd, tensors, groups = _full_state(trainer)
    if trainer.rank != 0:
        return None
    out = trainer.cfg.out
    final = out / "checkpoint"
    tmp = out / f".checkpoint.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.model.save_pretrained(tmp / "model", state_dict=model_sd)
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    state = {"step": trainer.step, "param_groups": groups, "config": json.loads(json.dumps(asdict(trainer.cfg), default=str)),
             "loader": trainer.source.state_dict()}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))  # last: marks the directory complete
    old = out / f".checkpoint.old-{os.getpid()}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return model_sd


def settings_diff(saved: dict, mine: dict) -> list[str]:
    """'name: old -> new' for every setting that differs and matters on resume."""
    keys = sorted(k for k in set(mine) | set(saved) if k not in IGNORED_ON_RESUME and mine.get(k) != saved.get(k))
    return [f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in keys]


def _same_settings(ckpt: Path, state: dict, cfg) -> None:
    diff = settings_diff(state["config"], json.loads(json.dumps(asdict(cfg), default=str)))
    if diff:
        raise ConfigError(f"{ckpt} was written with different settings ({', '.join(diff)}); use the original settings to resume, "
                          "or a new --out")


def prior_run(cfg) -> int | None:
    """What ``cfg.out`` already holds, before anything loads: a checkpoint written with other settings is refused in one
    line; the step of a run that already did what ``cfg`` asks is returned (its checkpoint complete, at ``cfg.steps`` or
    beyond, and the final model beside it in the dtype asked for); else None (nothing there, or a run to resume). Reads
    only: every rank of a distributed run may ask at once."""
    if cfg.out.exists() and not cfg.out.is_dir():
        from opdcache.errors import ConfigError

        raise ConfigError(f"--out {cfg.out} is a file, not a folder: give the folder that holds (or will hold) the run's "
                          "checkpoint/, model/ and metrics.jsonl")
    ckpt = _newest(cfg.out)
    if ckpt is None:
        return None
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        step, saved = int(state["step"]), state["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: the resume path says what is wrong
    _same_settings(ckpt, {"config": saved}, cfg)
    try:
        model_dtype = json.loads((cfg.out / "model" / "config.json").read_text()).get("dtype")
    except (OSError, ValueError, AttributeError):
        return None  # no final model yet: the run resumes and saves it
    if cfg.checkpoint != "full" or step < cfg.steps or ckpt.name != "checkpoint":
        return None
    if cfg.save_dtype != "auto" and model_dtype != cfg.save_dtype:
        return None  # the same run, its final model wanted in another dtype: resumed, and saved again
    return step


def resume(trainer) -> bool:
    """Load the newest complete checkpoint into the trainer (model, optimizer, RNG, step, source position)."""
    from safetensors.torch import load_file

    ckpt = newest_complete(trainer.cfg.out) if trainer.rank == 0 or not trainer.ddp else trainer.cfg.out / "checkpoint"
    if trainer.ddp:
        torch.distributed.barrier()  # rank 0 may have just moved a checkpoint into place
        ckpt = trainer.cfg.out / "checkpoint"
    if ckpt is None or not (ckpt / STATE_FILE).is_file():
        return False
    state = json.loads((ckpt / STATE_FILE).read_text())
    _same_settings(ckpt, state, trainer.cfg)
    from opdcache.inputs.models import load_causal_lm

    weights = load_causal_lm(ckpt / "model", torch.float32).state_dict()
    tensors = load_file(str(ckpt / "optimizer.safetensors"))
    per_param: dict[int, dict] = {}
    for key, value in tensors.items():
        if not key.startswith("rng."):
            i, name = key.split(".", 1)
            per_param.setdefault(int(i), {})[name] = value
    if trainer.cfg.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        names = [f"model.{n}" for n, _ in trainer.model.named_parameters()]
        set_model_state_dict(trainer.forward, {f"model.{k}": v for k, v in weights.items()}, options=options)
        optim = {"state": {names[i]: st for i, st in per_param.items()},
                 "param_groups": [{**{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items()}, "params": names}
                                  for g in state["param_groups"]]}
        set_optimizer_state_dict(trainer.forward, trainer.opt, optim, options=options)
    else:
        trainer.model.load_state_dict(weights)
        params = list(trainer.model.parameters())
        for i, st in per_param.items():
            trainer.opt.state[params[i]].update({k: v.to(trainer.device) if k != "step" else v for k, v in st.items()})
        for g, saved in zip(trainer.opt.param_groups, state["param_groups"]):
            g.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()})
    torch.set_rng_state(tensors["rng.torch"])
    trainer.step = state["step"]
    if state["loader"] is not None:
        trainer.source.load_state_dict(state["loader"])
    return True

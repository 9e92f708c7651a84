"""Experiment trackers: where a run's metrics go besides ``metrics.jsonl``, each through its own library.

``--report-to jsonl,tensorboard,wandb,trackio,mlflow`` (``jsonl`` always). Every tracker receives the same numbers at
the same steps (the dict written to ``metrics.jsonl``), from rank 0 only, and the run's resolved settings once at the
start (``config.json`` beside the metrics holds the same). Each library keeps its own offline mode, chosen the way
its users choose it: ``WANDB_MODE=offline`` (W&B writes its run files under ``--out/wandb``), trackio's local store
(``TRACKIO_DIR``), MLflow's tracking URI (``MLFLOW_TRACKING_URI``; default: a local SQLite store, ``--out/mlflow.db``),
TensorBoard's event files under ``--out/tensorboard``. A tracker whose library is missing is refused in one line
before anything loads (:func:`check`), naming the pip install.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

TRACKERS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
"""Tracker name -> the package it needs (the import name; the pip name is the same)."""
PROJECT = "opdcache"


def parse(value) -> tuple[str, ...]:
    """``--report-to``'s names (a comma list or a sequence), ``jsonl`` first and always; unknown names refused."""
    from opdcache.errors import ConfigError

    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value or ()) if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"--report-to names no tracker {', '.join(map(repr, unknown))}; it takes {', '.join(TRACKERS)}")
    return tuple(dict.fromkeys(["jsonl", *names]))


def check(names) -> None:
    """Every named tracker's library is importable; else one line naming the pip install (before the student loads)."""
    from opdcache.errors import MissingDependencyError

    for name in names:
        package = TRACKERS[name]
        if package is not None and importlib.util.find_spec(package) is None:
            raise MissingDependencyError(f"--report-to {name} needs the {package} package: pip install {package} "
                                         "(metrics.jsonl is written either way)")


def _scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a step's metrics (every tracker takes floats; a bool is a number, a string is not)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}


class _TensorBoard:
    def __init__(self, out: Path, config: dict, name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in _scalars(metrics).items():
            self.writer.add_scalar(k, v, step)

    def finish(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, out: Path, config: dict, name: str):
        import wandb

        self.run = wandb.init(project=PROJECT, name=name, dir=str(out), config=config, resume="allow",
                              id=_stable_id(out, name))

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(_scalars(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, out: Path, config: dict, name: str):
        import trackio

        self.trackio = trackio
        trackio.init(project=PROJECT, name=name, config=config, resume="allow")

    def log(self, metrics: dict, step: int) -> None:
        self.trackio.log(_scalars(metrics), step=step)

    def finish(self) -> None:
        self.trackio.finish()


class _MLflow:
    def __init__(self, out: Path, config: dict, name: str):
        import os

        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # a local store (MLflow's file store is in maintenance mode)
            mlflow.set_tracking_uri(f"sqlite:///{(out / 'mlflow.db').resolve()}")
        mlflow.set_experiment(PROJECT)
        self.run = mlflow.start_run(run_name=name)
        flat = _flatten(config)
        for i in range(0, len(flat), 100):  # MLflow takes at most 100 params a call
            mlflow.log_params(dict(list(flat.items())[i: i + 100]))

    def log(self, metrics: dict, step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in _scalars(metrics).items()}, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


def _flatten(config: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]
    return out


def _stable_id(out: Path, name: str) -> str:
    """The same run id for the same run folder (a resumed run continues its W&B run)."""
    import hashlib

    return hashlib.sha256(f"{Path(out).resolve()}:{name}".encode()).hexdigest()[:16]


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _WandB, "trackio": _Trackio, "mlflow": _MLflow}


class Trackers:
    """The run's trackers besides metrics.jsonl (which the trainer writes itself): started together, fed the same
    numbers, finished together. A tracker that cannot start (W&B online without a login, an unreachable MLflow URI) is
    one line, before the first step."""

    def __init__(self, names, out: Path, config: dict, name: str):
        from opdcache.errors import ConfigError

        self.active = []
        for n in names:
            if n == "jsonl":
                continue
            try:
                self.active.append(_CLASSES[n](Path(out), config, name))
            except Exception as exc:  # noqa: BLE001 (each library raises its own: UsageError, MlflowException, OSError)
                self.finish()
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise ConfigError(f"--report-to {n}: the tracker did not start ({type(exc).__name__}: {first}); check its "
                                  "login or URI, or use its offline mode (WANDB_MODE=offline; a local MLFLOW_TRACKING_URI)") from None

    def log(self, metrics: dict, step: int) -> None:
        for t in self.active:
            t.log(metrics, step)

    def finish(self) -> None:
        for t in self.active:
            t.finish()
        self.active = []

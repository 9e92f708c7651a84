"""`train --report-to`: every tracker, through its own library in its offline mode, receives the numbers metrics.jsonl
holds, at the same steps, and the resolved settings; each tracker's files are read back with that library (or, for
W&B, whose reader is in its Go core, by its record format). No network: WANDB_MODE=offline, trackio's local store, a
local MLflow store, TensorBoard's event files."""

import json
import struct

import numpy as np
import pytest

import importlib.util  # noqa: E402 (found, not imported: trackio fixes its store's folder when first imported)

if any(importlib.util.find_spec(m) is None for m in ("wandb", "trackio", "mlflow", "tensorboard")):
    pytest.skip("the trackers' libraries are not installed", allow_module_level=True)
pytestmark = [pytest.mark.trackers, pytest.mark.slow]


def _wandb_records(path):
    """The protobuf records of a W&B run file: a 7-byte header (':W&B', magic, version), then LevelDB-log records
    (CRC32C 4 bytes, length 2, type 1: full, first, middle, last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, part, records = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4: pos + 7])
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(part)
            records.append(r)
    return records


@pytest.fixture(scope="module")
def tracked(hf_cache, weights, tmp_path_factory):
    import os

    from opdcache.cli.main import main

    root = tmp_path_factory.mktemp("tracked")
    env = {"WANDB_MODE": "offline", "TRACKIO_DIR": str(root / "trackio"), "WANDB_SILENT": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with pytest.raises(SystemExit) as e:
            main(["train", "--model", str(weights / "student"), "--cache", str(hf_cache), "--out", str(root / "run"), "--steps", "3",
                  "--batch-size", "4", "--no-progress", "--report-to", "tensorboard,wandb,trackio,mlflow"])
        assert e.value.code == 0
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    out = root / "run"
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return root, out, metrics


def _scalars(metrics):
    return {k for m in metrics for k, v in m.items() if isinstance(v, (int, float))}


def test_tensorboard_events_hold_every_logged_scalar(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, metrics = tracked
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == _scalars(metrics)
    for key in _scalars(metrics):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [m["step"] for m in metrics]
        assert [e.value for e in events] == [float(np.float32(m[key])) for m in metrics]  # event files keep float32
    assert "config" in acc.Tags()["tensors"] or acc.Tags().get("tensors")


def test_wandb_offline_run_holds_every_logged_scalar_and_the_settings(tracked):
    _, out, metrics = tracked
    [path] = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    records = _wandb_records(path)
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item} | {"_step": r.history.step.num}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [m["step"] for m in metrics]
    for h, m in zip(history, metrics):
        assert {k: h[k] for k in _scalars([m])} == {k: float(m[k]) for k in _scalars([m])}
    config = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for r in records
              for i in (r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update if r.WhichOneof("record_type") == "config" else [])}
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
    saved = json.loads((out / "config.json").read_text())
    assert config["loss"] == saved["loss"] == "lightning" and config["steps"] == 3 and config["report_to"] == saved["report_to"]


def test_trackio_local_store_holds_every_logged_scalar(tracked):
    from trackio import sqlite_storage, utils

    root, out, metrics = tracked
    assert utils.TRACKIO_DIR == root / "trackio"  # the store the run was told to use, not the user's own
    logs = sqlite_storage.SQLiteStorage.get_logs("opdcache", out.name)
    assert [l["step"] for l in logs] == [m["step"] for m in metrics]
    for l, m in zip(logs, metrics):
        assert {k: l[k] for k in _scalars([m]) if k != "step"} == {k: float(m[k]) for k in _scalars([m]) if k != "step"}


def test_mlflow_local_store_holds_every_logged_scalar_and_the_settings(tracked):
    from mlflow.tracking import MlflowClient

    _, out, metrics = tracked
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("opdcache").experiment_id])
    for key in _scalars(metrics) - {"step"}:
        history = sorted(client.get_metric_history(run.info.run_id, key.replace("/", ".")), key=lambda h: h.step)
        assert [h.step for h in history] == [m["step"] for m in metrics]
        assert [h.value for h in history] == [float(m[key]) for m in metrics]
    assert run.data.params["loss"] == "lightning" and run.data.params["steps"] == "3"

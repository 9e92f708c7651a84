"""The run folder (``--out``) is untrusted input: links planted where train reads or writes are refused before the
student loads, a planted or damaged checkpoint is one line (exit 2) or, where it only carries hyper-parameters, trains
exactly as this run's settings say; and a checkpoint written before a setting existed resumes with its default."""

import json
import os
import shutil
from dataclasses import field, make_dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from capped import run as _capped
from cli_helpers import cli as _in_process, one_line as _one_line
from opdcache.training.train import TrainConfig, run_train

pytestmark = pytest.mark.slow  # run by .ci/run (pytest -m slow), beside the other hostile suites


def _cli(args, capsys=None):
    """(exit code, output) of the CLI on ``args`` in the hostile suites' capped child (tests/capped.py: address space
    capped, peak memory checked), as a probe of this round runs."""
    return _capped(args)




def _args(weights, cache, out, steps=2, *extra):
    return ["train", "--model", weights / "student", "--cache", cache, "--out", out, "--steps", str(steps), "--batch-size", "4",
            "--checkpoint-every", "1", "--lr", "1e-3", "--deterministic", "--no-progress", *extra]


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture
def outside(tmp_path):
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "keep.txt").write_text("untouched")
    return folder


def _untouched(folder):
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"] and (folder / "keep.txt").read_text() == "untouched"


@pytest.mark.parametrize("name", ["model", "checkpoint", "metrics.jsonl", "tensorboard", ".checkpoint.tmp-4242"])
def test_a_link_where_train_reads_or_writes_is_refused_before_the_student_loads(hf_cache, weights, tmp_path, capsys, outside, name):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(outside)
    code, text = _cli(_args(weights, hf_cache, out), capsys)
    line = _one_line(text)
    assert code == 2 and f"{out / name} is a link" in line and "new --out" in line, line
    assert "student" not in text.split(line)[0]  # nothing was announced: refused before anything loaded
    _untouched(outside)


def test_a_link_inside_the_checkpoint_is_refused(hf_cache, weights, tmp_path, capsys, outside):
    out = tmp_path / "run"
    run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=out, steps=1, batch_size=4, stop_after=1, checkpoint_every=1))
    (out / "checkpoint" / "optimizer.safetensors").unlink()
    (out / "checkpoint" / "optimizer.safetensors").symlink_to(outside / "keep.txt")
    code, text = _cli(_args(weights, hf_cache, out), capsys)
    assert code == 2 and "optimizer.safetensors is a link" in _one_line(text)
    _untouched(outside)


@pytest.fixture(scope="module")
def one_step(hf_cache, weights, tmp_path_factory):
    """A run stopped after its first checkpointed step (of two), to be damaged by each test."""
    out = tmp_path_factory.mktemp("one_step") / "run"
    run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=out, steps=2, batch_size=4, lr=1e-3, deterministic=True,
                          checkpoint_every=1, stop_after=1))
    return out


@pytest.fixture(scope="module")
def straight(hf_cache, weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=out, steps=2, batch_size=4, lr=1e-3, deterministic=True,
                          checkpoint_every=1))
    return out


def _damaged(one_step, tmp_path, edit):
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    path = out / "checkpoint" / "trainer_state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    return out


def test_hyper_parameters_planted_in_the_trainer_state_are_not_used(one_step, straight, hf_cache, weights, tmp_path):
    def plant(state):
        state["param_groups"] = [{"maximize": True, "weight_decay": 1e6, "lr": 5.0, "betas": [0.0, 0.0], "eps": 1.0, "params": []}]

    out = _damaged(one_step, tmp_path, plant)
    run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=out, steps=2, batch_size=4, lr=1e-3, deterministic=True,
                          checkpoint_every=1))
    a, b = _weights(straight / "model"), _weights(out / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # as if the file held the run's own groups


@pytest.mark.parametrize("edit, want", [
    (lambda s: s.update(step=1.5), "step is 1.5, not a non-negative integer"),
    (lambda s: s.update(step=True), "step is True, not a non-negative integer"),
    (lambda s: s.update(step=-1), "step is -1, not a non-negative integer"),
    (lambda s: s.update(step=10**9), "step 1,000,000,000 is past the 2 steps its own settings ask for"),
    (lambda s: s["loader"].update(consumed=-1), "the batch source's consumed is -1, not a non-negative integer"),
    (lambda s: s.update(config=[]), "its settings (config) are not a JSON object"),
    (lambda s: s.update(param_groups=7), "param_groups is not a list of JSON objects"),
    (lambda s: s.update(trained_from={"student": s["trained_from"]["student"], "cache": {"rollouts": "0" * 64}}),
     "was trained from another cache than this run's"),
    (lambda s: s.update(trained_from={"student": "0" * 64}), "was trained from another student than this run's"),
], ids=["float-step", "bool-step", "negative-step", "huge-step", "negative-consumed", "config-list", "groups-int",
        "other-cache", "other-student"])
def test_a_damaged_trainer_state_is_one_line(one_step, weights, hf_cache, tmp_path, capsys, edit, want):
    out = _damaged(one_step, tmp_path, edit)
    code, text = _cli(_args(weights, hf_cache, out), capsys)
    line = _one_line(text)
    assert code == 2 and want in line, line


@pytest.mark.parametrize("content, want", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"step": 1, "step": 2}', "appears twice"),
    (None, "over the 16 MiB such a file may take"),
], ids=["deep", "duplicate-key", "huge"])
def test_a_hostile_trainer_state_file_is_one_line_and_a_large_one_is_not_read(one_step, weights, hf_cache, tmp_path, capsys, content, want):
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    path = out / "checkpoint" / "trainer_state.json"
    if content is None:
        with open(path, "wb") as f:
            f.truncate(300 << 20)  # sparse: 300 MB that a whole read would take into memory
    else:
        path.write_text(content)
    code, text = _cli(_args(weights, hf_cache, out), capsys)
    assert code == 2 and want in _one_line(text)


def _edit_optimizer(out, edit):
    path = out / "checkpoint" / "optimizer.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("edit, want", [
    (lambda t: t.update({"0.exp_avg": torch.zeros(3)}), "'0.exp_avg' is [3] float32, finite floats of shape"),
    (lambda t: t.update({"99999.exp_avg": torch.zeros(1)}), "which is no optimizer state of the student's"),
    (lambda t: t.update({"0.momentum_buffer": torch.zeros(1)}), "which is no optimizer state"),
    (lambda t: t.pop("0.exp_avg_sq"), "parameter 0's state lacks ['exp_avg_sq']"),
    (lambda t: t.update({"0.exp_avg": t["0.exp_avg"] * float("nan")}), "finite floats of shape"),
    (lambda t: t.pop("rng.torch"), "no torch RNG state"),
], ids=["shape", "index", "name", "missing", "nan", "rng"])
def test_planted_optimizer_tensors_are_one_line(one_step, weights, hf_cache, tmp_path, capsys, edit, want):
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    _edit_optimizer(out, edit)
    code, text = _cli(_args(weights, hf_cache, out), capsys)
    line = _one_line(text)
    assert code == 2 and want in line, line


@pytest.mark.parametrize("damage, want", [
    ("garbage", "not a safetensors file"),
    ("foreign-tensor", "holds a tensor 'planted.weight' the student does not have"),
    ("wrong-shape", "the student's is"),
], ids=["garbage", "foreign-tensor", "wrong-shape"])
def test_planted_checkpoint_weights_are_one_line(one_step, weights, hf_cache, tmp_path, capsys, damage, want):
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    path = out / "checkpoint" / "model" / "model.safetensors"
    if damage == "garbage":
        path.write_bytes(b"\xff" * 64)
    else:
        tensors = load_file(str(path))
        if damage == "foreign-tensor":
            tensors["planted.weight"] = torch.zeros(2)
        else:
            name = next(iter(tensors))
            tensors[name] = torch.zeros(1, 1)
        save_file(tensors, str(path))
    code, text = _cli(_args(weights, hf_cache, out), capsys)
    line = _one_line(text)
    assert code == 2 and want in line, line


@pytest.mark.parametrize("content, want", [
    ('{"step": 1}\nnot json\n{"step": 2}\n', "line 2"),
    ('{"step": "one"}\n{"step": 2}\n', "line 1 is not a step's metrics"),
], ids=["not-json", "string-step"])
def test_a_damaged_metrics_file_is_one_line(one_step, weights, hf_cache, tmp_path, capsys, content, want):
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    (out / "metrics.jsonl").write_text(content)
    code, text = _cli(_args(weights, hf_cache, out), capsys)
    line = _one_line(text)
    assert code == 2 and want in line, line


def test_a_metrics_line_cut_by_a_crash_is_dropped_and_the_run_resumes(one_step, straight, weights, hf_cache, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')
    code, text = _cli(_args(weights, hf_cache, out), capsys)
    assert code == 0, text
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_final_model_replaces_a_planted_model_folder_whole(one_step, weights, hf_cache, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    (out / "model").mkdir()
    (out / "model" / "planted.bin").write_bytes(b"x")
    run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=out, steps=2, batch_size=4, lr=1e-3, deterministic=True,
                          checkpoint_every=1))
    assert not (out / "model" / "planted.bin").exists() and (out / "model" / "model.safetensors").is_file()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temporary folder left behind


def test_a_checkpoint_written_before_a_setting_existed_resumes_with_its_default(one_step, straight, weights, hf_cache, tmp_path, capsys):
    """An upgrade adds a setting (a patched config class with one more field): the older checkpoint lacks it, takes the
    field's default, says so once, and trains on to the same weights; a value other than the default is a difference."""
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    Upgraded = make_dataclass("Upgraded", [("new_knob", float, field(default=0.5))], bases=(TrainConfig,), frozen=True)
    common = dict(model=weights / "student", cache=hf_cache, out=out, steps=2, batch_size=4, lr=1e-3, deterministic=True, checkpoint_every=1)
    with pytest.raises(Exception, match=r"different settings \(new_knob: 0.5 -> 0.25\)"):
        run_train(Upgraded(new_knob=0.25, **common))
    capsys.readouterr()
    run_train(Upgraded(**common))
    err = capsys.readouterr().err
    assert err.count("predates the settings new_knob = 0.5") == 1, err
    a, b = _weights(straight / "model"), _weights(out / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_upgrade_finds_a_finished_run_finished(straight, weights, hf_cache, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    state_path = out / "checkpoint" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    del state["config"]["gradient_checkpointing"]  # written by a version before the setting
    state_path.write_text(json.dumps(state))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    res = run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=out, steps=2, batch_size=4, lr=1e-3, deterministic=True,
                                checkpoint_every=1))
    assert res == {"already_done": True, "steps": 2}
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert os.path.isfile(state_path)


def test_a_disk_full_during_the_checkpoint_save_is_one_line_and_leaves_no_half_written_folder(hf_cache, weights, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (no OSError): the CLI says it in one line, and the
    fresh temporary folder is gone. (A full disk cannot be made here: the real error class is raised in its place.)"""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "run"
    code, text = _in_process(_args(weights, hf_cache, out), capsys)  # the patch lives in this process
    line = _one_line(text)
    assert code == 1 and line.startswith("error: storage: OSError: writing the checkpoint into") and "No space left" in line, line
    assert "free disk space" in line
    assert not [p for p in out.iterdir() if p.name.startswith(".checkpoint.")]


def _strace_works() -> bool:
    import subprocess

    try:
        return subprocess.run(["strace", "-qq", "-e", "trace=openat", "-o", os.devnull, "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _strace_works(), reason="needs strace, allowed to trace its child (ptrace)")
@pytest.mark.parametrize("name", ["model", "checkpoint", "metrics.jsonl", ".checkpoint.tmp-4242"])
def test_under_strace_train_opens_nothing_through_a_planted_link(hf_cache, weights, tmp_path, outside, name):
    """Every file system call of the whole process tree (strace -f): none names a path through the planted link or in
    the folder it points to, and the run is refused (exit 2) before the student loads."""
    import re
    import subprocess
    import sys

    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(outside)
    log = tmp_path / "strace.log"
    calls = "trace=open,openat,creat,mkdir,mkdirat,rename,renameat,renameat2,unlink,unlinkat,symlink,symlinkat,link,linkat,truncate"
    done = subprocess.run(["strace", "-f", "-qq", "-e", calls, "-o", str(log), sys.executable, "-m", "opdcache.cli.main",
                           *map(str, _args(weights, hf_cache, out))], capture_output=True, text=True,
                          env={**os.environ, "OPDCACHE_PROGRESS": "0"})
    assert done.returncode == 2 and f"{out / name} is a link" in done.stderr, done.stderr[-2000:]
    paths = re.findall(r'"((?:[^"\\]|\\.)*)"', log.read_text())
    through = [p for p in paths if p.startswith((str(out / name) + "/", str(outside)))]
    assert paths and not through, through[:5]
    _untouched(outside)

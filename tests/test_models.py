"""Models by local directory or Hub id: resolution from a Hub cache in its real on-disk layout, offline; the
manifest's repo id and commit; fingerprints from blob names; vocabulary-size checks."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opdcache.errors import ConfigError, TokenizerMismatchError
from opdcache.inputs.models import ModelRef, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(hub: Path, repo_id: str, src: Path, commit: str = COMMIT, branch: str = "main") -> Path:
    """``models--org--name/{blobs,refs,snapshots}`` as huggingface_hub lays it out: LFS files (weights) stored under
    their sha256, small files under their git blob sha1, snapshot entries relative links to the blobs."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            name = hashlib.sha256(data).hexdigest()
        else:
            name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / name).write_bytes(data)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / name)
    return snap


@pytest.fixture
def hub(tmp_path, weights, monkeypatch):
    root = tmp_path / "hub"
    make_hub_cache(root, "org/teacher", weights / "teacher")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_local_directories_and_missing_paths(tmp_path, weights):
    assert resolve_model(weights / "teacher") == ModelRef(weights / "teacher")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is a directory but not a Hugging Face model \\(no config.json\\)"):
        resolve_model(tmp_path / "empty")
    for missing in (str(tmp_path / "nope"), "./models/pi_ref", "~/nowhere"):
        with pytest.raises(ConfigError, match="no such model directory"):
            resolve_model(missing, what="--teacher")


def test_hub_id_resolves_offline_to_the_snapshot_with_its_commit(hub):
    for spec, rev in (("org/teacher", None), ("org/teacher@main", None), (f"org/teacher@{COMMIT}", None), ("org/teacher", "main")):
        ref = resolve_model(spec, rev)
        assert ref.repo_id == "org/teacher" and ref.commit == COMMIT and (ref.path / "config.json").is_file(), spec
        assert ref.name == "org/teacher"
    with pytest.raises(ConfigError, match="org/other is not in the local Hub cache and HF_HUB_OFFLINE is set; download it first"):
        resolve_model("org/other")
    with pytest.raises(ConfigError, match="names revision 'main' but --revision says 'v2'"):
        resolve_model("org/teacher@main", "v2")


def test_fingerprint_from_blob_names_equals_the_local_copy_and_reads_no_weights(hub, weights, monkeypatch):
    from opdcache.inputs import fingerprint

    local = fingerprint.model_fingerprint(weights / "teacher")
    read = []
    original = fingerprint.sha256_file
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p, *a: read.append(Path(p).name) or original(p, *a))
    assert fingerprint.model_fingerprint(resolve_model("org/teacher").path) == local
    assert read == []  # the weights' sha256 came from their blob names


def test_score_teacher_by_hub_id_offline_records_repo_and_commit(hf_cache, hub, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(hf_cache, cache)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "opdcache.cli.main", "score-teacher", str(cache), "--teacher", "org/teacher",
                           "--name", "hub", "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "teacher consistency: consistent" in proc.stdout  # same content as the local SFT teacher: same fingerprint
    manifest = json.loads((cache / "opdcache.json").read_text())
    model = manifest["tables"]["teachers/hub"]["model"]
    assert model["name_or_path"] == "org/teacher" and model["revision"] == COMMIT
    assert model["fingerprint"] == manifest["tables"]["teachers/teacher"]["model"]["fingerprint"]


def test_a_model_path_that_does_not_exist_is_one_line_and_fast(tmp_path, opd_prompts):
    proc = subprocess.run([sys.executable, "-m", "opdcache.cli.main", "build-rollouts", "--model", str(tmp_path / "missing"),
                           "--prompts", str(opd_prompts), "--out", str(tmp_path / "c")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--model {tmp_path / 'missing'}: no such model directory" in proc.stderr


def test_tokenizer_larger_than_the_vocabulary_is_refused_and_undecodable_samples_are_named():
    from opdcache.inputs.lineage import check_vocab_sizes, undecodable_reason

    class Tok:
        def __len__(self):
            return 70

    with pytest.raises(TokenizerMismatchError, match="has 70 tokens but the model's vocabulary has 64 rows"):
        check_vocab_sizes(Tok(), 64, "m")
    assert check_vocab_sizes(Tok(), 128, "m") == 70
    assert undecodable_reason([3, 80, 5], 70, 128) == "sampled token id 80 that the tokenizer cannot decode (tokenizer 70 tokens, model vocabulary 128)"
    assert undecodable_reason([3, 69], 70, 128) is None and undecodable_reason([99], 128, 128) is None

"""Hub push/pull with the real huggingface_hub client, up to the network call; plus a real round trip
that runs only with HF_TOKEN and network (marker `network`, never in CI)."""

import os
import shutil
import uuid

import pytest
from huggingface_hub import HfApi

from opdcache.cli.main import main
from opdcache.format import hub
from opdcache.format.cache import Cache

SECRET = "hf_" + "x" * 34


class Recorder:
    def __init__(self):
        self.calls = []

    def install(self, monkeypatch):
        rec = self

        def create_repo(self, repo_id, **kw):
            rec.calls.append(("create_repo", repo_id, kw))
            return f"https://huggingface.co/datasets/{repo_id}"

        def upload_folder(self, **kw):
            rec.calls.append(("upload_folder", kw["folder_path"], kw))

        def upload_file(self, **kw):
            rec.calls.append(("upload_file", kw["path_in_repo"], kw))

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(HfApi, "upload_file", upload_file)
        if hasattr(HfApi, "upload_large_folder"):
            monkeypatch.setattr(HfApi, "upload_large_folder", upload_folder)


def test_push_uploads_shards_then_card_then_manifest_last(synth_cache, monkeypatch):
    rec = Recorder()
    rec.install(monkeypatch)
    url = hub.push(synth_cache, "me/cache", token=SECRET)
    assert url.endswith("me/cache")
    names = [c[0] if c[0] != "upload_file" else c[1] for c in rec.calls]
    assert names == ["create_repo", "upload_folder", "README.md", "opdcache.json"]
    folder_kw = rec.calls[1][2]
    assert folder_kw["repo_type"] == "dataset"
    assert "opdcache.json" in folder_kw["ignore_patterns"] and "README.md" in folder_kw["ignore_patterns"]


def test_push_refuses_an_invalid_cache_before_any_network_call(synth_cache, monkeypatch):
    rec = Recorder()
    rec.install(monkeypatch)
    Cache(synth_cache).shard_paths("rollouts")[0].unlink()
    with pytest.raises(hub.HubError, match="refusing to push an invalid cache .* missing shard"):
        hub.push(synth_cache, "me/cache")
    assert rec.calls == []


def test_token_is_never_printed_or_written(synth_cache, monkeypatch, capsys):
    Recorder().install(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["push", str(synth_cache), "me/cache", "--token", SECRET])
    assert exit_.value.code == 0
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    for path in synth_cache.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_pull_downloads_then_validates(synth_cache, tmp_path, monkeypatch):
    import huggingface_hub

    def fake_snapshot(repo_id, repo_type, local_dir, token=None, revision=None):
        assert repo_type == "dataset"
        shutil.copytree(synth_cache, local_dir, dirs_exist_ok=True)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    out = hub.pull("me/cache", tmp_path / "pulled")
    assert Cache(out).teachers == ["synth"]
    # a corrupted download is caught by the validation that follows it
    def corrupt_snapshot(**kw):
        fake_snapshot(**kw)
        next((tmp_path / "bad" / "rollouts").glob("*.parquet")).write_bytes(b"PAR1 garbage")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", corrupt_snapshot)
    with pytest.raises(hub.HubError, match="downloaded cache me/cache is invalid"):
        hub.pull("me/cache", tmp_path / "bad")


@pytest.mark.network
@pytest.mark.skipif(not os.environ.get("HF_TOKEN"), reason="needs HF_TOKEN and network")
def test_real_round_trip(synth_cache, tmp_path):
    user = HfApi().whoami()["name"]
    repo = f"{user}/opdcache-test-{uuid.uuid4().hex[:8]}"
    try:
        hub.push(synth_cache, repo, private=True)
        out = hub.pull(repo, tmp_path / "pulled")
        assert Cache(out).manifest["tables"].keys() == Cache(synth_cache).manifest["tables"].keys()
        from opdcache.format.validate import validate

        url = f"hf://datasets/{repo}"  # read in place through huggingface_hub's fsspec filesystem, no download
        assert Cache(url).manifest == Cache(out).manifest and validate(url) == []
    finally:
        HfApi().delete_repo(repo, repo_type="dataset")


@pytest.mark.parametrize("command", ["push", "pull"])
def test_no_network_is_one_line_exit_1(synth_cache, tmp_path, command):
    """The real client against a closed local port: one line naming the failure and what to do, no traceback."""
    import os
    import subprocess
    import sys

    args = [str(synth_cache), "me/cache"] if command == "push" else ["me/cache", str(tmp_path / "pulled")]
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_dummy", "HF_HUB_ETAG_TIMEOUT": "2",
           "HF_HUB_DOWNLOAD_TIMEOUT": "2", "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-m", "opdcache.cli.main", command, *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "me/cache failed:" in lines[0] and "Check the network, HF_TOKEN" in lines[0]
    assert "hf_dummy" not in proc.stderr + proc.stdout

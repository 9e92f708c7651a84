"""Every command takes `--config FILE` (YAML; the flags' names) with the flags given overriding it, and
`--print-config` (the resolved settings, nothing run); a key that names no setting, or a value its flag refuses, is one
line naming the key. examples/configs/ holds one file per stage of the demo, checked here and run after the demo."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from opdcache.cli.main import _register, app, app_commands, main

EXAMPLES = Path(__file__).parent.parent / "examples" / "configs"


def _cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_the_flags_given_override_the_file_and_print_config_shows_the_result(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("num-shards: 2\nsamples: 3\nmax_new_tokens: 12\nstrict: true\napi-key: sk-secret\n")
    code, out, err = _cli(["build-rollouts", "--model", "m", "--prompts", "p.jsonl", "--out", "o", "--config", path,
                           "--samples", "5", "--print-config"], capsys)
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert resolved["num_shards"] == 2 and resolved["max_new_tokens"] == 12 and resolved["strict"] is True
    assert resolved["samples"] == 5  # the flag, over the file's 3
    assert resolved["temperature"] == 0.8  # neither: the flag's default
    assert resolved["api_key"] == "<redacted>" and "sk-secret" not in out
    assert not Path("o").exists()  # nothing ran


def test_a_positional_argument_may_come_from_the_file(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("cache: some/cache\nteacher: t\ntop-k: 4\n")
    code, out, err = _cli(["score-teacher", "--config", path, "--print-config"], capsys)
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert resolved["cache"] == "some/cache" and resolved["top_k"] == 4


@pytest.mark.parametrize("content, want", [
    ("num-shard: 2\n", "'num-shard' names no setting of `opdcache build-rollouts`; its settings are "),
    ("num-shards: many\n", "num-shards: Input should be a valid integer"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("samples: 1\nsamples: 2\n", "line 2: 'samples' is given twice (first on line 1)"),
], ids=["unknown-key", "wrong-type", "not-a-mapping", "twice"])
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path, capsys, content, want):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    code, out, err = _cli(["build-rollouts", "--model", "m", "--prompts", "p.jsonl", "--out", tmp_path / "o", "--config", path], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and want in lines[0], err
    assert not (tmp_path / "o").exists()


def test_every_command_takes_a_config_file(tmp_path, capsys):
    """An empty file is no setting: --print-config then prints each command's defaults (or says which argument is
    missing, in one line) for every command."""
    path = tmp_path / "empty.yaml"
    path.write_text("")
    _register()
    for name in app_commands():
        code, out, err = _cli([name, "--config", path, "--print-config"], capsys)
        lines = err.strip().splitlines()
        assert "Traceback" not in err and (code == 0 or (code == 2 and len(lines) == 1)), (name, err)


@pytest.mark.parametrize("stage", sorted(p.stem for p in EXAMPLES.glob("*.yaml")))
def test_each_example_config_names_only_settings_of_its_command(stage, capsys):
    code, out, err = _cli([stage, "--config", EXAMPLES / f"{stage}.yaml", "--print-config"], capsys)
    assert code == 0, err
    resolved = yaml.safe_load(out)
    for key, value in yaml.safe_load((EXAMPLES / f"{stage}.yaml").read_text()).items():
        assert resolved[key.replace("-", "_")] in (value, str(value), tuple(value) if isinstance(value, list) else value), key


@pytest.mark.slow
def test_the_example_configs_run_the_demos_stages(demo_workdir, tmp_path):
    """build-rollouts, score-teacher and train from examples/configs/ in a copy of the demo's work directory, each
    with flags that shorten it (the flags override the file)."""
    here = tmp_path / "w"
    shutil.copytree(demo_workdir, here / "opdcache-demo")
    runs = [["build-rollouts", "--config", EXAMPLES / "build-rollouts.yaml", "--limit", "8", "--num-shards", "1", "--no-progress"],
            ["score-teacher", "--config", EXAMPLES / "score-teacher.yaml", "--store", "logprob,topk", "--no-progress"],
            ["train", "--config", EXAMPLES / "train.yaml", "--cache", "opdcache-demo/caches/rollouts-again", "--steps", "2",
             "--batch-size", "8", "--no-progress"]]
    for args in runs:
        proc = subprocess.run(["opdcache", *map(str, args)], cwd=here, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args[0], proc.stderr[-2000:])
    assert (here / "opdcache-demo" / "runs" / "lightning-again" / "config.json").is_file()


def test_a_cache_stage_saves_its_resolved_settings_and_reruns_from_them(weights, opd_prompts, tmp_path, capsys, monkeypatch):
    """build-rollouts and score-teacher write <table>/settings.yaml in --config form (absolute paths, no secrets, no
    per-process settings): from another directory it resumes the same job, and with another --out writes the same bytes.
    A setting missing from an older file takes its flag's default; one that no longer exists is refused naming it."""
    cache = tmp_path / "c"
    monkeypatch.chdir(tmp_path)
    prompts = shutil.copy(opd_prompts, tmp_path / "p.jsonl")
    code, out, err = _cli(["build-rollouts", "--model", weights / "student", "--prompts", "p.jsonl", "--out", "c",
                           "--max-new-tokens", "8", "--num-shards", "2", "--limit", "6", "--api-key", "sk-secret",
                           "--num-workers", "1", "--worker-index", "0", "--no-progress"], capsys)
    assert code == 0, err
    saved = yaml.safe_load((cache / "rollouts" / "settings.yaml").read_text())
    assert saved["prompts"] == str(Path(prompts).absolute()) and saved["out"] == str(cache.absolute())
    assert saved["max_new_tokens"] == 8 and saved["limit"] == 6 and "api_key" not in saved
    assert "num_workers" not in saved and "worker_index" not in saved
    monkeypatch.chdir(Path(__file__).parent)
    code, out, err = _cli(["build-rollouts", "--config", cache / "rollouts" / "settings.yaml"], capsys)
    assert code == 0 and "wrote shards none (all present)" in out, out + err
    code, out, err = _cli(["build-rollouts", "--config", cache / "rollouts" / "settings.yaml", "--out", tmp_path / "again"], capsys)
    assert code == 0, err
    assert [p.read_bytes() for p in sorted((cache / "rollouts").glob("part-*"))] == \
        [p.read_bytes() for p in sorted((tmp_path / "again" / "rollouts").glob("part-*"))]
    code, out, err = _cli(["score-teacher", cache, "--teacher", weights / "teacher", "--store", "logprob,topk", "--top-k", "3",
                           "--no-progress"], capsys)
    assert code == 0, err
    scored = cache / "teachers" / "teacher" / "settings.yaml"
    assert yaml.safe_load(scored.read_text())["top_k"] == 3
    code, out, err = _cli(["score-teacher", "--config", scored], capsys)
    assert code == 0 and "wrote shards none (all present)" in out, out + err
    from opdcache.format.validate import validate

    assert not [p for p in validate(cache) if not p.warning]
    older = yaml.safe_load(scored.read_text())
    del older["top_k"]  # a file written before a setting existed: the flag's default
    (tmp_path / "older.yaml").write_text(yaml.safe_dump(older | {"store": "logprob"}))
    code, out, err = _cli(["score-teacher", "--config", tmp_path / "older.yaml", "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["top_k"] is None
    (tmp_path / "gone.yaml").write_text(yaml.safe_dump(older | {"retired_setting": 1}))
    code, out, err = _cli(["score-teacher", "--config", tmp_path / "gone.yaml"], capsys)
    assert code == 2 and "'retired_setting' names no setting of `opdcache score-teacher`" in err

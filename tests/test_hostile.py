"""A cache from a stranger is untrusted input: each hostile cache or input the review built, and its outcome.

No code from a cache runs; nothing outside the cache is read or disclosed; every tool answers in one line with the
right exit code; concurrent writers lose nothing; a crash never orphans a checkpoint.
"""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli_helpers import cli as _cli, one_line as _one_line
from opdcache.format import manifest as M, shards




@pytest.fixture
def cache(hf_cache, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(hf_cache, root)
    return root


def _rewrite_shard(cache, table, index, rows_fn):
    """Rewrite one shard with edited rows and record its new hash, so that only the edit is wrong (as a careful attacker
    or a buggy writer would leave it)."""
    manifest = M.load(cache)
    path = sorted((cache / table).glob("part-*.parquet"))[index]
    t = pq.read_table(path)
    info = shards.write_table_atomic(pa.Table.from_pylist(rows_fn(t.to_pylist()), schema=t.schema), path, cache)
    manifest["tables"][table]["shards"][index] = info.to_dict()
    M.save(cache, manifest)
    return path


def _train(cache, weights, tmp_path, capsys, *extra):
    return _cli(["train", "--model", weights / "student", "--cache", cache, "--out", tmp_path / "run", "--steps", "1",
                 "--batch-size", "48", "--no-progress", *extra], capsys)


# ---------------------------------------------------------------- 1. no code from a cache runs


@pytest.mark.parametrize("config_file", ["tokenizer_config.json", "config.json"])
def test_a_planted_auto_map_runs_nothing_and_copies_nothing(cache, tmp_path, config_file):
    marker = tmp_path / "PWNED"
    modules = tmp_path / "hf_modules"
    (cache / "tokenizer" / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                                 "from transformers import PreTrainedTokenizerFast\n"
                                                 "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    path = cache / "tokenizer" / config_file
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    cfg["tokenizer_class"] = "EvilTokenizer"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "HF_MODULES_CACHE": str(modules), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "opdcache.cli.main", "export", str(cache), "--to", "jsonl", "--out", str(tmp_path / "x")],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=env)
    assert "Traceback" not in proc.stderr and "[y/N]" not in proc.stdout + proc.stderr
    if config_file == "tokenizer_config.json":  # the class it names exists only in the planted code: refused in one line
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
        assert "without running code from the cache" in proc.stderr
    else:  # transformers loads the declared tokenizer class and ignores config.json's auto_map: the export works
        assert proc.returncode == 0, proc.stderr
    assert not marker.exists()  # nothing executed
    assert not modules.exists() or not any(modules.rglob("*.py"))  # nothing copied into the HF modules cache


def test_a_model_with_custom_code_is_refused_in_one_line(weights, tmp_path, opd_prompts, capsys):
    model = tmp_path / "model"
    shutil.copytree(weights / "student", model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    cfg["model_type"] = "evil-arch"
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "evil.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').write('ran')\n")
    code, out = _cli(["build-rollouts", "--model", model, "--prompts", opd_prompts, "--out", tmp_path / "c", "--max-new-tokens", "4"], capsys)
    assert code == 2 and "opdcache never runs code that comes with a model" in _one_line(out)
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------- 2. nothing outside the cache is read


@pytest.mark.parametrize("bad", ["../outside/part-00000-of-00003.parquet", "/etc/passwd", "teachers/teacher/part-00000-of-00003.parquet"])
def test_a_manifest_path_that_leaves_its_table_is_refused_without_opening_it(cache, tmp_path, weights, capsys, bad):
    manifest = json.loads((cache / "opdcache.json").read_text())
    manifest["tables"]["rollouts"]["shards"][0]["path"] = bad
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    code, out = _cli(["validate", cache], capsys)
    assert code == 1 and "refusing a manifest that points outside its table" in out and "size is" not in out
    for args in (["info", cache], ["export", cache, "--to", "jsonl", "--out", tmp_path / "x"], ["check-consistency", cache]):
        code, out = _cli(args, capsys)
        assert code == 2 and "points outside its table" in _one_line(out), args
    code, out = _train(cache, weights, tmp_path, capsys)
    assert code == 2 and "points outside its table" in _one_line(out)


def test_a_symlinked_shard_leading_outside_is_reported_not_read(cache, tmp_path, weights, capsys):
    secret = tmp_path / "secret.parquet"
    secret.write_bytes(b"not yours " * 122)
    shard = sorted((cache / "rollouts").glob("part-*.parquet"))[0]
    shard.unlink()
    shard.symlink_to(secret)
    code, out = _cli(["validate", cache], capsys)
    assert code == 1 and "symlink that leads outside the cache; not read" in out
    assert "size is" not in out and "1220" not in out  # nothing about the target is disclosed
    code, out = _train(cache, weights, tmp_path, capsys)
    assert code == 2 and "leads outside the cache" in _one_line(out)
    code, out = _cli(["export", cache, "--to", "jsonl", "--out", tmp_path / "x"], capsys)
    assert code == 2 and "leads outside the cache" in _one_line(out)


# ---------------------------------------------------------------- 3. concurrent finalizes lose nothing


def _finalize_at_barrier(root, slug, barrier):
    from synth import TOKENIZER  # noqa: F401 (tests/ is on the path of the forked child)

    from opdcache.format.cache import TableJob, finalize_table

    job = TableJob.from_job_file(root, f"teachers/{slug}")
    barrier.wait()
    finalize_table(job)


def test_two_teacher_tables_finalized_at_the_same_moment_both_survive(tmp_path):
    from synth import make_cache, teacher_rows  # noqa: F401

    from opdcache.format import schema as S
    from opdcache.format.cache import Cache, TableJob, run_table_job

    ctx = multiprocessing.get_context("fork")
    for trial in range(5):
        root = make_cache(tmp_path / f"c{trial}")
        base = Cache(root).table("rollouts")
        for slug in ("a", "b"):  # two scored tables waiting for their finalize, as two score-teacher jobs would be
            job = TableJob(root, f"teachers/{slug}", "teacher", S.StoreParams(stores=("logprob",), ref_top_k=4, mc_samples=3),
                           {"teacher": slug}, len(base["shards"]), parent_fingerprint=base["config_fingerprint"])
            run_table_job(job, lambda i: [{"id": r["id"], "logprobs": r["logprobs"], "logsumexp": r["logsumexp"],
                                           "ref_topk_logprobs": r["ref_topk_logprobs"], "mc_logprobs": r["mc_logprobs"]}
                                          for r in pq.read_table(root / "teachers" / "synth" / shards.shard_name(i, len(base["shards"]))).to_pylist()])
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=_finalize_at_barrier, args=(root, slug, barrier)) for slug in ("a", "b")]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        tables = set(M.load(root)["tables"])
        assert {"teachers/a", "teachers/b", "teachers/synth", "rollouts"} <= tables, f"trial {trial}: {sorted(tables)}"
        from opdcache.format.validate import validate

        assert not [p for p in validate(root) if not p.warning]


# ---------------------------------------------------------------- 4. export never writes into the cache or mixes exports


def test_export_refuses_an_out_inside_the_cache_or_holding_an_earlier_export(cache, tmp_path, capsys):
    before = {p: p.read_bytes() for p in (cache / "rollouts").glob("*.parquet")}
    code, out = _cli(["export", cache, "--to", "parquet-flat", "--out", cache / "rollouts"], capsys)
    assert code == 2 and "is inside the cache" in _one_line(out)
    assert {p: p.read_bytes() for p in (cache / "rollouts").glob("*.parquet")} == before
    code, out = _cli(["export", cache, "--to", "parquet-flat", "--out", tmp_path / "x"], capsys)
    assert code == 0
    code, out = _cli(["export", cache, "--to", "jsonl", "--out", tmp_path / "x"], capsys)
    assert code == 2 and "is not empty (an earlier export?)" in _one_line(out)


# ---------------------------------------------------------------- 5. validate never raises; train checks side files


@pytest.mark.parametrize("damage", ["truncated", "pickle"])
def test_a_damaged_head_is_a_reported_problem_and_train_refuses_it(cache, tmp_path, weights, capsys, damage):
    import pickle

    head = cache / "teachers" / "teacher" / "head.safetensors"
    head.write_bytes(head.read_bytes()[:100] if damage == "truncated" else pickle.dumps({"weight": [1.0]}))
    code, out = _cli(["validate", cache], capsys)
    assert code == 1 and "Traceback" not in out and "teachers/teacher/head.safetensors" in out
    code, out = _cli(["validate", cache, "--quick"], capsys)
    assert code == 1 and "teachers/teacher/head.safetensors" in out
    code, out = _train(cache, weights, tmp_path, capsys, "--loss", "full-rkl")
    assert code == 2 and "head.safetensors does not match the manifest's size and sha256" in _one_line(out)


# ---------------------------------------------------------------- 6. a disk-full tokenizer never validates


def test_a_damaged_tokenizer_file_is_found_by_validate(cache, capsys):
    (cache / "tokenizer" / "tokenizer.json").write_bytes(b"")  # what a disk that filled up mid-save leaves
    code, out = _cli(["validate", cache], capsys)
    assert code == 1 and "tokenizer/tokenizer.json: sha256 does not match the manifest's" in out


def test_an_unfinished_tokenizer_folder_is_rewritten_by_the_rerun(tmp_path, weights, opd_prompts):
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.format.validate import validate

    out = tmp_path / "c"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "tokenizer.json").write_bytes(b"")  # killed (or out of space) before the completion marker
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=4), out=out, num_shards=1,
                             sampling=SamplingConfig(max_new_tokens=4)))
    assert (out / "tokenizer" / "tokenizer.json").stat().st_size > 0
    assert not [p for p in validate(out) if not p.warning]


# ---------------------------------------------------------------- 7. training checks what it trains on


def test_teacher_rows_shifted_by_one_stop_training(cache, tmp_path, weights, capsys):
    def shift_values(rows):  # ids kept, every other column moved down one row, the first row's one position longer
        out = [{**r, **{k: v for k, v in rows[(i + 1) % len(rows)].items() if k != "id"}} for i, r in enumerate(rows)]
        out[0] = {k: (v + v[-1:] if isinstance(v, list) else v) for k, v in out[0].items()}  # rows may share one length
        return out

    path = _rewrite_shard(cache, "teachers/teacher", 0, shift_values)
    code, out = _train(cache, weights, tmp_path, capsys)
    line = _one_line(out)
    assert code == 2 and "not as long as the responses" in line and "opdcache validate" in line
    path = _rewrite_shard(cache, "teachers/teacher", 0, lambda rows: rows[1:] + rows[:1])  # whole rows rolled: ids differ
    code, out = _train(cache, weights, tmp_path, capsys)
    assert code == 2 and "teacher rows are not aligned with the rollout rows (ids differ)" in _one_line(out)
    del path


def test_a_row_longer_than_the_models_context_stops_training_before_padding_to_it(cache, tmp_path, weights, capsys):
    def huge(rows):
        n = 100_000
        rows[0] = {**rows[0], "response_ids": [5] * n, "sampling_logprobs": [-1.0] * n, "ref_logprobs": [-1.0] * n,
                   "ref_topk_ids": [[5] * 5] * n, "ref_topk_logprobs": [[-1.0] * 5] * n, "mc_ids": [[5] * 3] * n,
                   "mc_sampling_logprobs": [[-1.0] * 3] * n}
        return rows

    _rewrite_shard(cache, "rollouts", 0, huge)
    code, out = _train(cache, weights, tmp_path, capsys)
    assert code == 2 and "more than the model's context of 128" in _one_line(out)


def test_a_manifest_declaring_a_trillion_rows_is_refused_before_allocating(cache, tmp_path, weights, capsys):
    manifest = json.loads((cache / "opdcache.json").read_text())
    manifest["tables"]["rollouts"]["shards"][0]["rows"] = 10 ** 12
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    code, out = _train(cache, weights, tmp_path, capsys)
    assert code == 2 and "the manifest says 1,000,000,000,000" in _one_line(out)


# ---------------------------------------------------------------- 8. one bad line or verifier never kills a job


def test_hostile_prompt_lines_fail_their_row_only(tmp_path, weights):
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate

    src = tmp_path / "p.jsonl"
    deep = "[" * 200_000 + "]" * 200_000
    src.write_text("\n".join([json.dumps({"prompt": "123+456", "answer": "0579"}), '{"prompt": "\\ud800"}',
                              '{"prompt": ' + deep + "}", json.dumps({"prompt": "200+300", "answer": "0500"})]) + "\n")
    res = run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src), out=tmp_path / "c", num_shards=1,
                                   sampling=SamplingConfig(max_new_tokens=4)))
    assert [p.index for p in res.prompts.prompts] == [0, 3]
    errors = {e["line"]: e["reason"] for e in map(json.loads, (tmp_path / "c" / "rollouts_errors.jsonl").read_text().splitlines())}
    assert set(errors) == {2, 3} and "UnicodeEncodeError" in errors[2] and "nested too deeply" in errors[3]


def test_verifier_shapes_and_imports(tmp_path, weights, opd_prompts, capsys, monkeypatch):
    from opdcache.inputs import verifiers as V

    assert V.score(lambda r, t: (1.0,), "x", {}).reason.startswith("verifier returned a tuple of 1 items")
    assert V.score(lambda r, t: float("nan"), "x", {}).score is None
    assert V.score(lambda r, t: (0.5, None), "x", {}) == V.Verdict(0.5, None)
    (tmp_path / "broken_verifier.py").write_text("def verify(r, t):\n    return 1.0 +\n")
    (tmp_path / "raising_verifier.py").write_text("raise RuntimeError('no GPU here')\ndef verify(r, t):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, kind in (("broken_verifier", "SyntaxError"), ("raising_verifier", "RuntimeError")):
        code, out = _cli(["build-rollouts", "--model", weights / "student", "--prompts", opd_prompts, "--out", tmp_path / module,
                          "--reward", f"{module}:verify"], capsys)
        assert code == 2 and f"cannot import 'verify' from '{module}' ({kind}" in _one_line(out)
        assert not (tmp_path / module).exists()  # refused at argument checking, before any model loads


def test_chat_template_kwargs_that_collide_with_the_call_are_refused(tmp_path, weights, opd_prompts, capsys):
    code, out = _cli(["build-rollouts", "--model", weights / "student", "--prompts", opd_prompts, "--out", tmp_path / "c",
                      "--chat-template-kwargs", '{"tokenize": true}'], capsys)
    assert code == 2 and "--chat-template-kwargs may not set tokenize" in _one_line(out)


# ---------------------------------------------------------------- 9. checkpoints survive a crash at any rename


@pytest.mark.parametrize("left", ["old-and-tmp", "checkpoint-and-tmp", "tmp-only-incomplete"])
def test_a_resume_takes_the_newest_complete_checkpoint_and_leaves_no_temporary_directory(tmp_path, left):
    from opdcache.training.checkpoint import STATE_FILE, newest_complete

    out = tmp_path / "run"

    def ckpt(name, step, complete=True):
        d = out / name
        (d / "model").mkdir(parents=True)
        if complete:
            (d / STATE_FILE).write_text(json.dumps({"step": step, "config": {}, "param_groups": [], "loader": None}))
        return d

    if left == "old-and-tmp":  # crashed between the two renames: no checkpoint/, the old one aside, the new one complete
        ckpt(".checkpoint.old-11", 2), ckpt(".checkpoint.tmp-11", 3)
        want = 3
    elif left == "checkpoint-and-tmp":  # crashed before the renames: the new one complete beside the old one in place
        ckpt("checkpoint", 2), ckpt(".checkpoint.tmp-11", 3)
        want = 3
    else:  # crashed while writing the new one: it has no state file yet
        ckpt("checkpoint", 2), ckpt(".checkpoint.tmp-11", 3, complete=False)
        want = 2
    found = newest_complete(out)
    assert found == out / "checkpoint" and json.loads((found / STATE_FILE).read_text())["step"] == want
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint"]

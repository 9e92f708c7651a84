"""opdcache export: flat rows any trainer reads, ids exact, text beside them, teacher columns aligned."""

import json

import pyarrow.parquet as pq
import pytest

from opdcache.cli.main import main
from opdcache.format import shards
from opdcache.format.cache import Cache


def _cache_rows(cache):
    c = Cache(cache)
    rollouts = [r for p in c.shard_paths("rollouts") for r in shards.read_table(p).to_pylist()]
    teacher = [r for p in c.shard_paths("teachers/teacher") for r in shards.read_table(p).to_pylist()]
    return rollouts, teacher


@pytest.mark.parametrize("fmt", ["jsonl", "parquet-flat"])
def test_export_round_trips(hf_cache, tmp_path, capsys, fmt):
    with pytest.raises(SystemExit) as e:
        main(["export", str(hf_cache), "--to", fmt, "--out", str(tmp_path / "x")])
    assert e.value.code == 0 and "exported 48 rows with teachers/teacher" in capsys.readouterr().out
    if fmt == "jsonl":
        rows = [json.loads(l) for l in (tmp_path / "x" / "rollouts.jsonl").read_text().splitlines()]
    else:
        rows = [r for p in sorted((tmp_path / "x").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    rollouts, teacher = _cache_rows(hf_cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_cache / "tokenizer")
    assert len(rows) == len(rollouts) == 48
    for row, r, t in zip(rows, rollouts, teacher):
        assert row["id"] == r["id"] == t["id"]
        assert row["prompt_ids"] == list(r["prompt_ids"]) and row["response_ids"] == list(r["response_ids"])
        assert row["teacher_logprobs"] == pytest.approx(list(t["logprobs"]), abs=0) and row["reward"] == r["reward"]
        assert row["teacher_topk_ids"] == [list(x) for x in t["topk_ids"]]
        assert row["response_text"] == tok.decode(r["response_ids"]) and "teacher_hidden" not in row


def test_export_refuses_an_unknown_format(hf_cache, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", str(hf_cache), "--to", "csv", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "--to must be one of jsonl, parquet-flat, lightning-opd, got 'csv'" in capsys.readouterr().err


def _release_reader(directory):
    """What the Lightning OPD release's slime fork does (slime/utils/data.py, slime/rollout/sglang_rollout.py): every
    .parquet under the directory, sorted, read with pandas' pyarrow backend, row by row."""
    import os

    import pandas as pd

    files = sorted(os.path.join(root, f) for root, _, names in os.walk(directory) for f in names if f.endswith(".parquet"))
    for path in files:
        for _, row in pd.read_parquet(path, dtype_backend="pyarrow").iterrows():
            yield row.to_dict()


def test_lightning_opd_export_round_trips_through_the_release_reader(hf_cache, tmp_path, capsys):
    import shutil

    import pyarrow as pa
    from transformers import AutoTokenizer

    from opdcache.format import manifest as M

    cache = tmp_path / "cache"
    shutil.copytree(hf_cache, cache)
    # one row whose prompt holds a reserved token: its decoded text ("<|reserved_0|>") cannot re-encode to that id
    path = Cache(cache).shard_paths("rollouts")[1]
    table = shards.read_table(path)
    rows = table.to_pylist()
    reserved = AutoTokenizer.from_pretrained(cache / "tokenizer").convert_tokens_to_ids("<|reserved_0|>")
    rows[2]["prompt_ids"] = [rows[2]["prompt_ids"][0], reserved] + rows[2]["prompt_ids"][1:]
    info = shards.write_table_atomic(pa.Table.from_pylist(rows, schema=table.schema), path, cache)
    m = M.load(cache)
    m["tables"]["rollouts"]["shards"][1] = info.to_dict()
    M.save(cache, m)

    with pytest.raises(SystemExit) as e:
        main(["export", str(cache), "--to", "lightning-opd", "--out", str(tmp_path / "lo"), "--ref-logprobs"])
    assert e.value.code == 0
    assert "exported 47 rows" in (out := capsys.readouterr().out) and "1 rows refused" in out
    tok = AutoTokenizer.from_pretrained(cache / "tokenizer")
    rollouts, teacher = _cache_rows(cache)
    kept = [(r, t) for r, t in zip(rollouts, teacher) if reserved not in r["prompt_ids"]]
    exported = list(_release_reader(tmp_path / "lo"))
    assert len(exported) == len(kept) == 47
    for row, (r, t) in zip(exported, kept):
        meta = row["metadata"]
        prompt = tok.encode(row["prompt"], add_special_tokens=False)  # what the reader does
        tokens = [int(x) for x in prompt] + [int(x) for x in meta["response_tokens"]]
        assert tokens == list(r["prompt_ids"]) + list(r["response_ids"])
        assert meta["is_lightning_opd"] and row["label"] == "0" and sum(meta["loss_mask"]) == len(meta["loss_mask"]) == len(r["response_ids"])
        assert [float(x) for x in meta["teacher_log_probs"]] == [float(x) for x in t["logprobs"]]  # float32 values, exactly
        assert [float(x) for x in meta["student_log_probs"]] == [float(x) for x in r["ref_logprobs"]]
        assert meta["opdcache_id"] == r["id"]  # joins back to the cache (the release's reader ignores the field)
    assert {r["id"] for r, _ in kept} | {rows[2]["id"]} == {r["id"] for r in rollouts}  # the refused row is the one missing
    assert "not exported (the cache keeps them): " in out and "mc_ids" in out and "teacher_hidden" in out

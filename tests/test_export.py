"""opdcache export: flat rows any trainer reads, ids exact, text beside them, teacher columns aligned."""

import json

import pyarrow.parquet as pq
import pytest

from opdcache import shards
from opdcache.cache import Cache
from opdcache.cli.main import main


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
    assert e.value.code == 2 and "--to must be one of jsonl, parquet-flat, got 'csv'" in capsys.readouterr().err

"""audit judges a table by its recorded arithmetic: a table computed in bfloat16 or float16 is re-scored in that dtype
and passes within a tolerance that follows from it; one changed value still fails; --rows all audits every row."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from opdcache.errors import ConfigError
from opdcache.teacher.audit import audit, AuditConfig, render, tolerance_for, UNIT_ROUNDOFF


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def low_precision_cache(request, tmp_path_factory, weights, ragged_prompts):
    from opdcache.backends import EngineConfig
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    dtype = request.param
    out = tmp_path_factory.mktemp(dtype) / "cache"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(ragged_prompts), out=out, num_shards=2,
                             sampling=SamplingConfig(max_new_tokens=32, samples=2, ref_top_k=3), engine=EngineConfig(dtype=dtype),
                             sft_teacher=weights / "teacher"))
    run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=4, engine=EngineConfig(dtype=dtype)))
    return dtype, out


@pytest.mark.slow
def test_a_fresh_low_precision_table_passes_its_own_audit(low_precision_cache):
    dtype, cache = low_precision_cache
    manifest = json.loads((cache / "opdcache.json").read_text())
    assert manifest["tables"]["rollouts"]["model"]["dtype"] == dtype
    report = audit(AuditConfig(cache=str(cache), rows="all"))
    assert report["passed"], render(report)
    for table in report["tables"]:
        assert table["dtype"] == dtype and not table["exact_claimed"]
        assert table["rows"] == 48  # --rows all: 24 prompts x 2 samples
        assert "transformers engine" in table["how"] and dtype in table["how"] and dtype in table["reasoning"]
        assert f"in {dtype} on {'cuda:0' if torch.cuda.is_available() else 'cpu'}" in table["how"]  # --device auto
        if table["table"] == "rollouts":  # written while decoding: replayed through the same path, not a full forward
            assert table["how"].startswith("replayed through the transformers engine's generation path")
        for name, col in table["columns"].items():
            if "tolerance" in col:
                assert col["tolerance"] >= 8 * UNIT_ROUNDOFF[dtype] and col["max_abs_delta"] <= col["tolerance"], (name, col)
    text = render(report)
    assert "ids differing" in text and "PASS" in text


def test_a_float32_re_score_of_the_same_table_would_not_reproduce_it(low_precision_cache, weights):
    """What audit did before it read the dtype: a float32 re-score of this table differs from it by far more than the
    float32 tolerance (1e-4), so an honest low-precision table failed its own audit. In the recorded dtype it passes."""
    from opdcache.backends import engine_for_table
    from opdcache.format.cache import Cache
    from opdcache.teacher.scoring import score_requests

    dtype, cache_dir = low_precision_cache
    cache = Cache(str(cache_dir))
    record = cache.table("teachers/teacher")["model"]
    rows = cache.read_shard("rollouts", 0, ["id", "prompt_ids", "response_ids"])
    stored = cache.sequences("teachers/teacher", "logprobs")[: rows.num_rows]
    fresh = engine_for_table(record, weights / "teacher", "t", dtype="float32").score(score_requests(rows))
    worst = max(float(np.abs(sc.logprobs.astype(np.float64) - st.astype(np.float64)).max()) for sc, st in zip(fresh, stored))
    assert worst > 1e-4, worst
    assert audit(AuditConfig(cache=str(cache_dir), table="teacher", rows="all"))["passed"]


def test_one_changed_value_still_fails(low_precision_cache, tmp_path):
    import shutil

    dtype, cache = low_precision_cache
    root = tmp_path / "cache"
    shutil.copytree(cache, root)
    path = sorted((root / "teachers" / "teacher").glob("*.parquet"))[0]
    table = pq.read_table(path)
    lp = table["logprobs"].to_pylist()
    lp[0][0] -= 1.0  # one nat on one value
    table = table.set_column(table.schema.get_field_index("logprobs"), table.schema.field("logprobs"),
                             pa.array(lp, table.schema.field("logprobs").type))
    pq.write_table(table, path)
    report = audit(AuditConfig(cache=str(root), table="teacher", rows="all"))
    col = report["tables"][0]["columns"]["logprobs"]
    assert not report["passed"] and col["max_abs_delta"] > col["tolerance"] and abs(col["max_abs_delta"] - 1.0) < 0.2



def _moved(cache, tmp_path, by: float, rows):
    """A copy of ``cache`` with one teacher log-prob moved by ``by`` nats, in a row the audit's sample holds."""
    import shutil

    from opdcache.format.cache import Cache

    root = tmp_path / "cache"
    shutil.copytree(cache, root)
    picks = Cache(str(root)).sample_rows("teachers/teacher", 10 ** 9 if rows == "all" else rows, 0)
    shard, row = next((s, sorted(r)[0]) for s, r in sorted(picks.items()) if len(r))
    path = sorted((root / "teachers" / "teacher").glob("*.parquet"))[shard]
    table = pq.read_table(path)
    lp = table["logprobs"].to_pylist()
    lp[row][1] += by
    table = table.set_column(table.schema.get_field_index("logprobs"), table.schema.field("logprobs"),
                             pa.array(lp, table.schema.field("logprobs").type))
    pq.write_table(table, path)  # the footer's key-values (the batching among them) are the schema's, kept
    return root


@pytest.mark.parametrize("rows", [4, "all"])
def test_a_tenth_of_a_nat_in_one_value_is_found_at_any_rows(low_precision_cache, tmp_path, rows):
    """Before, the tolerance grew with the sample (its largest batch-to-batch spread), so a 0.1-nat change passed with
    --rows all. Replaying each sampled row's shard in the batching its footer records brings the values back bit for
    bit, so one moved value is the only one that differs, whatever --rows."""
    dtype, cache = low_precision_cache
    fresh = audit(AuditConfig(cache=str(cache), table="teacher", rows=rows))
    t = fresh["tables"][0]
    assert fresh["passed"] and t["smallest_detectable"] == 0.0 and t["replay"]["exact"] == t["replay"]["values"] > 0, render(fresh)
    assert "come back bit for bit; any change of a value is seen" in t["reasoning"] and "PASS" in render(fresh)
    report = audit(AuditConfig(cache=str(_moved(cache, tmp_path, 0.1, rows)), table="teacher", rows=rows))
    t = report["tables"][0]
    assert not report["passed"] and t["replay"]["values"] - t["replay"]["exact"] == 1, render(report)
    assert "1 value differs from the bits this machine reproduces for the rest" in t["reasoning"]


def test_without_the_replay_the_report_says_what_it_cannot_see(low_precision_cache):
    """--no-replay judges within the tolerance, and a pass says the size of change it cannot see instead of a bare PASS."""
    dtype, cache = low_precision_cache
    report = audit(AuditConfig(cache=str(cache), table="teacher", rows="all", replay=False))
    t = report["tables"][0]
    assert report["passed"] and "replay" not in t and t["smallest_detectable"] >= 8 * UNIT_ROUNDOFF[dtype]
    assert f"PASS within tolerance (a change under {t['smallest_detectable']:.3g} in one value cannot be seen)" in render(report)

def test_tolerance_follows_the_dtype():
    assert tolerance_for("float32", 0.0, 1e-4) == 1e-4
    assert tolerance_for("bfloat16", 0.0, 1e-4) == 8 * 2.0 ** -8
    assert tolerance_for("float16", 0.0, 1e-4) == 8 * 2.0 ** -11
    assert tolerance_for("bfloat16", 0.05, 1e-4) == pytest.approx(0.2)
    assert tolerance_for("float32", float("inf"), 1e-4) == 1e-4  # a spread that is not a number never widens it


@pytest.mark.parametrize("rows", [0, -3, "some", True])
def test_rows_takes_a_positive_count_or_all(rows):
    with pytest.raises(ConfigError, match="--rows must be a positive number of rows or all"):
        AuditConfig(cache="c", rows=rows)
    assert AuditConfig(cache="c", rows="7").rows == 7 and AuditConfig(cache="c", rows="all").rows == "all"



@pytest.mark.parametrize("planted", [b"not json", b'{"max_batch_tokens": 1024}', b'{"max_batch_tokens": 1024, "threads": 512}',
                                     b'{"max_batch_tokens": true, "threads": 1}', b"x" * 300])
def test_a_planted_batching_is_not_replayed(low_precision_cache, tmp_path, planted):
    """The footer's batching is untrusted: one that is not two bounded integers (threads within this machine's cores)
    is not replayed; the table is judged within the tolerance and the report says no batching was recorded."""
    import shutil

    from opdcache.teacher.scoring import BATCHING_META

    dtype, cache = low_precision_cache
    root = tmp_path / "cache"
    shutil.copytree(cache, root)
    for path in sorted((root / "teachers" / "teacher").glob("*.parquet")):
        table = pq.read_table(path)
        pq.write_table(table.replace_schema_metadata({**table.schema.metadata, BATCHING_META: planted}), path)
    report = audit(AuditConfig(cache=str(root), table="teacher", rows="all"))
    t = report["tables"][0]
    assert "replay" not in t and "no batching recorded to replay" in t["reasoning"] and t["smallest_detectable"] > 0

"""The teacher-store registry (opdcache/stores/): the format, score-teacher, validate, the loader and info read it, and a
store added through it (entropy) works end to end while no other library file names it."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from opdcache.errors import ConfigError
from opdcache.format import manifest as M, schema as S, shards
from opdcache.stores import REGISTRY
from opdcache.backends.base import STATISTICS

ROOT = Path(__file__).parent.parent
LIBRARY = [p for d in ("opdcache", "cli") for p in sorted((ROOT / d).rglob("*.py"))]


def test_the_format_is_built_from_the_registry():
    assert S.TEACHER_STORES == tuple(REGISTRY)
    teacher_columns = [c.name for c in S.columns("teacher")]
    assert teacher_columns == ["id"] + [c.name for store in REGISTRY.values() for c in store.columns]
    for store in REGISTRY.values():
        assert all(c.store == store.name for c in store.columns), store.name
        assert S.STORE_SINCE.get(store.name, 1) == store.since
    assert S.FORMAT_VERSION == max([store.since for store in REGISTRY.values()] + list(S.REQUIRES_SINCE.values()))


def test_a_store_option_without_its_store_is_one_line_from_one_home():
    """The compact top-k's settings are checked in one place for a job and for a table's recorded parameters."""
    from opdcache.teacher.scoring import ScoreJob

    message = "--topk-precision and --topk-mass shape the topk store: add --store topk"
    with pytest.raises(ConfigError, match=re.escape(message)):
        ScoreJob(cache="c", teacher=Path("t"), topk_mass=1e-3)
    with pytest.raises(ConfigError, match=re.escape(message)):
        S.StoreParams(stores=("logprob",), topk_mass=1e-3)
    with pytest.raises(ConfigError, match=re.escape("--topk-precision must be one of float32, float16, prob14, got 'q8'")):
        S.StoreParams(stores=("logprob", "topk"), top_k=4, topk_precision="q8")
    with pytest.raises(ConfigError, match="--samples-per-position sets the sampled store: add --store sampled"):
        ScoreJob(cache="c", teacher=Path("t"), samples_per_position=4)


def test_a_store_that_needs_the_whole_distribution_is_refused_on_vllm_before_any_model_loads():
    from opdcache.backends import EngineConfig
    from opdcache.teacher.scoring import ScoreJob

    with pytest.raises(ConfigError, match=re.escape("--store entropy needs the teacher's full-distribution entropy -E_p[log p] (statistic entropy), "
                                                    "which --backend vllm does not compute: score this table with an engine that does "
                                                    "(transformers, exact)")):
        ScoreJob(cache="c", teacher=Path("t"), stores=("entropy",), engine=EngineConfig(backend="vllm"))


def test_the_entropy_store_lives_in_one_file_and_one_registry_line():
    """No library file but the store's own and the registry names the store, its module or its columns. The only
    other uses of the word are figures that predate the store and mean something else, pinned here by count: the
    fidelity record's "entropy" moment (opdcache/format/fidelity.py) and plan's "teacher_entropy" (the frontier's mean).
    The engines compute the statistic of that name, which the store asks for (its ``needs``)."""
    store = REGISTRY["entropy"]
    words = {store.name} | {c.name for c in store.columns} | {"teacher_" + c.name for c in store.columns}
    found = {}
    for path in LIBRARY:
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("opdcache/stores/entropy.py", "opdcache/stores/__init__.py"):
            continue
        text = path.read_text()
        # the engines name the statistic the store is made from (STATISTICS["entropy"]), not the store
        named = words - set(STATISTICS) if rel.startswith("opdcache/backends/") else words
        quoted = sum(len(re.findall(rf"[\"']{w}[\"']", text)) for w in named)
        module_uses = len(re.findall(r"stores\.entropy|stores import[^\n]*\bentropy\b", text))
        if quoted or module_uses:
            found[rel] = quoted + module_uses
    assert found == {"opdcache/format/fidelity.py": 3, "opdcache/teacher/frontier.py": 1, "opdcache/teacher/plan.py": 1}
    registry = (ROOT / "opdcache/stores/__init__.py").read_text()
    assert registry.count("entropy") == 2  # the import and the registry line



NOT_A_STORE = {
    "cli/options.py": ('getattr(p, "hidden", False)',),  # typer's hidden-option attribute
    "opdcache/teacher/crossteacher.py": ('counts["aligned"]',),  # the aligned record's count of aligned rows
    "opdcache/training/data.py": ('stores=("logprob", "topk")',),  # the loader's usage example in its docstring
}
"""The only quoted first-store names (logprob, topk, hidden, svd, sampled, aligned) in library modules outside
opdcache/stores/, each by the text around it: none is a special case of a store."""
STORE_MODULES_USED_BY = {"opdcache/teacher/crossteacher.py": ("aligned",)}
"""Store modules imported outside opdcache/stores/: the cross-tokenizer scorer writes the aligned store's rows (an
encoding that spans rows and needs the alignment, opdcache/teacher/alignment.py) and its footer record."""


def test_no_library_module_outside_the_stores_names_a_store():
    """The first stores' special cases are hooks of the store spec (opdcache/stores/base.py): a quoted store name or a
    store module imported outside opdcache/stores/ fails here, but for the uses listed above."""
    words = ("logprob", "topk", "hidden", "svd", "sampled", "aligned")
    found, imported = [], {}
    for path in LIBRARY:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("opdcache/stores/", "opdcache/demo/", "opdcache/backends/")):  # backends: the statistics' names
            continue
        for line in path.read_text().splitlines():
            if re.search(rf"[\"']({'|'.join(words)})[\"']", line) and not any(ok in line for ok in NOT_A_STORE.get(rel, ())):
                found.append(f"{rel}: {line.strip()}")
        used = re.findall(rf"stores\.({'|'.join(words)})\b|stores import ({'|'.join(words)})\b", path.read_text())
        if used:
            imported[rel] = tuple(sorted({a or b for a, b in used}))
    assert found == []
    assert imported == STORE_MODULES_USED_BY


def test_losses_read_signals_and_each_signal_has_a_store():
    """Every loss's teacher reads are signals the registry gives; a table's store is preferred to the registry's
    first giver (a table with svd and no hidden store feeds the full-vocabulary losses from svd)."""
    from opdcache.stores import giving
    from opdcache.stores.base import SIGNALS
    from opdcache.training.estimators import ESTIMATORS

    assert {s for store in REGISTRY.values() for s in store.gives} == set(SIGNALS)
    for e in ESTIMATORS.values():
        assert set(e.teacher_reads) <= set(SIGNALS), e.name
    full = ESTIMATORS["full-rkl"]
    assert full.stores(None, ("logprob", "svd"))[0] == ("logprob", "svd")
    assert full.stores(None, ("logprob", "hidden", "svd"))[0] == ("logprob", "hidden")
    assert full.stores(None, ())[0] == ("logprob", giving("vectors"))
    vector_stores = [s for s in REGISTRY.values() if "vectors" in s.gives]
    assert vector_stores and all(s.head is not None for s in vector_stores)

TOY_STORE_RUN = """
import sys
from opdcache import stores
import toy_store
stores.REGISTRY[toy_store.STORE.name] = toy_store.STORE  # the registry line
from opdcache.cli.main import main
main(sys.argv[1:])
"""


def test_a_store_added_as_one_file_and_a_registry_line_scores_validates_and_loads(hf_cache, weights, tmp_path):
    """tests/toy_store.py (a store of a statistic no store kept) is scored, validated, loaded and refused on an engine
    that does not compute its statistic, with no other file changed."""
    import os
    import subprocess
    import sys

    root = tmp_path / "cache"
    shutil.copytree(hf_cache, root)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(*args):
        return subprocess.run([sys.executable, "-c", TOY_STORE_RUN, *map(str, args)], capture_output=True, text=True, env=env)

    done = run("score-teacher", root, "--teacher", weights / "teacher", "--store", "logprob,variance", "--name", "var", "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert run("validate", root).returncode == 0
    import pyarrow.parquet as pq  # this process has no toy store registered: the shard read as plain Parquet

    table = pq.read_table(root / M.load(root)["tables"]["teachers/var"]["shards"][0]["path"])
    v = table["logprob_variance"].combine_chunks().flatten().to_numpy()
    assert v.dtype == np.float32 and (v >= 0).all() and v.max() > 0
    load = subprocess.run([sys.executable, "-c", TOY_STORE_RUN.replace("from opdcache.cli.main import main\nmain(sys.argv[1:])", (
        "from opdcache.training.data import CacheLoader, CacheLoaderConfig\n"
        "batch = next(iter(CacheLoader(CacheLoaderConfig(cache=sys.argv[1], teacher='var', stores=('logprob', 'variance'), "
        "batch_size=4, shuffle=False))))\nprint(sorted(k for k in batch if 'variance' in k))")), str(root)],
        capture_output=True, text=True, env=env)
    assert load.returncode == 0 and "teacher_logprob_variance" in load.stdout, load.stdout + load.stderr
    refused = run("score-teacher", root, "--teacher", weights / "teacher", "--store", "logprob,variance", "--name", "v2",
                  "--backend", "vllm", "--no-progress")
    assert refused.returncode == 2 and "--store variance needs Var_p[log p] (statistic variance), which --backend vllm does not compute" in refused.stdout + refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr and not (root / "teachers" / "v2").exists()


@pytest.fixture(scope="module")
def entropy_cache(hf_cache, weights, tmp_path_factory):
    from opdcache.teacher.scoring import ScoreJob, run_score

    root = tmp_path_factory.mktemp("entropy") / "cache"
    shutil.copytree(hf_cache, root)
    run_score(ScoreJob(cache=root, teacher=weights / "teacher", stores=("logprob", "entropy"), slug="ent"))
    return root


def _reference_entropy(model_dir: Path, prompt_ids, response_ids) -> np.ndarray:
    """The teacher's entropy at each response position from a plain float64 forward over the whole vocabulary."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1: -1]
    lp = torch.log_softmax(logits, -1)
    return (-(lp.exp() * lp).sum(-1)).numpy()


def test_an_entropy_table_is_v5_validates_and_holds_the_teachers_entropy(entropy_cache, weights, tmp_path):
    import datasets

    from opdcache.format.cache import Cache
    from opdcache.format.validate import validate

    cache = Cache(entropy_cache)
    assert cache.manifest["format_version"] == 5 and cache.table("teachers/ent")["params"]["stores"] == ["logprob", "entropy"]
    assert S.params_from_schema(shards.read_schema(cache.shard_paths("teachers/ent")[0]))[2] == 5
    assert cache.table("teachers/teacher")["params"].get("stores") and "entropy" not in cache.table("teachers/teacher")["params"]["stores"]
    assert not [p for p in validate(entropy_cache) if not p.warning]
    rollouts = shards.read_table(cache.shard_paths("rollouts")[0])
    table = shards.read_table(cache.shard_paths("teachers/ent")[0])
    for i in (0, 3):
        stored = np.asarray(table["entropy"][i].as_py(), np.float64)
        want = _reference_entropy(weights / "teacher", rollouts["prompt_ids"][i].as_py(), rollouts["response_ids"][i].as_py())
        assert stored.shape == want.shape and np.allclose(stored, want, rtol=1e-5, atol=1e-5)
        assert (stored >= 0).all() and (stored <= np.log(M.load(entropy_cache)["tables"]["teachers/ent"]["config"]["vocab_size"])).all()
    ds = datasets.load_dataset(str(entropy_cache), "teacher-ent", split="train", cache_dir=str(tmp_path / "hf"))
    assert np.allclose(ds[0]["entropy"], table["entropy"][0].as_py())
    from opdcache.format.export import export

    export(entropy_cache, "jsonl", tmp_path / "flat", teacher="ent")
    first = json.loads((tmp_path / "flat" / "rollouts.jsonl").read_text().splitlines()[0])
    assert first["id"] == table["id"][0].as_py() and first["teacher_entropy"] == table["entropy"][0].as_py()


def test_the_loader_yields_teacher_entropy_and_info_names_the_store(entropy_cache, capsys):
    from opdcache.cli.main import main
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    loader = CacheLoader(CacheLoaderConfig(cache=entropy_cache, teacher="ent", stores=("logprob", "entropy"), batch_size=4, shuffle=False))
    batch = next(iter(loader))
    assert batch["teacher_entropy"].shape == batch["teacher_logprobs"].shape and batch["teacher_entropy"].dtype == torch.float32
    assert (batch["teacher_entropy"] >= 0).all() and batch["teacher_entropy"].sum() > 0
    with pytest.raises(SystemExit) as exit_:
        main(["info", str(entropy_cache)])
    assert exit_.value.code in (0, None)
    assert "entropy store: the teacher's full-distribution entropy at each position" in capsys.readouterr().out


def test_a_damaged_entropy_row_is_found_by_validate_and_refused_by_the_loader(entropy_cache, tmp_path):
    from opdcache.format.cache import Cache
    from opdcache.training.data import CacheLoader, CacheLoaderConfig
    from opdcache.errors import SchemaError
    from opdcache.format.validate import validate

    root = tmp_path / "cache"
    shutil.copytree(entropy_cache, root)
    cache = Cache(root)
    path = cache.shard_paths("teachers/ent")[1]
    entry = cache.table("teachers/ent")
    rows = shards.read_table(path).to_pylist()
    rows[2]["entropy"][1] = -0.5  # an entropy below 0: no distribution has one
    records = [{k: (np.asarray(v, np.float32) if isinstance(v, list) else v) for k, v in row.items()} for row in rows]
    info = shards.write_table_atomic(shards.build_table("teacher", S.StoreParams.from_dict(entry["params"]), records,
                                                        entry["config_fingerprint"]), path, root)
    manifest = cache.manifest
    manifest["tables"]["teachers/ent"]["shards"][1] = info.to_dict()
    M.save(root, manifest)
    problems = [p for p in validate(root) if not p.warning]
    assert [p.message for p in problems if not p.column][0].startswith("table teachers/ent: the recorded error against the full")
    problems = [p for p in problems if p.column]  # the rebuilt shard lost its footer's fidelity record: reported apart
    assert [(p.row, p.column) for p in problems] == [(2, "entropy")], problems
    assert "entropy must be finite, at least 0 and at most log(" in problems[0].message
    loader = CacheLoader(CacheLoaderConfig(cache=root, teacher="ent", stores=("logprob", "entropy"), batch_size=64, shuffle=False))
    with pytest.raises(SchemaError, match="row 2, column entropy: entropy must be finite, at least 0"):
        list(loader)


def test_the_v5_snapshots_are_frozen():
    assert json.loads((ROOT / "schemas/format-v5.json").read_text()) == S.describe(5)
    assert [c["name"] for c in S.describe(4)["tables"]["teacher"]][-1] == "sampled_logprobs"  # v4 readers never see it


@pytest.mark.parametrize("stores", [[{"a": 1}], [["logprob"]], "logprob", ["logprob", "logprob"], None])
def test_a_manifest_whose_store_list_is_not_names_is_one_line_everywhere(synth_cache, capsys, stores):
    """A stranger's manifest with a store list of objects, nested lists, a string, repeats or nothing: one line naming the
    field, exit 2 (validate: its finding, 1), never a traceback (it was a TypeError in info and validate)."""
    from opdcache.cli.main import main

    manifest = json.loads((synth_cache / "opdcache.json").read_text())
    name = next(k for k in manifest["tables"] if k.startswith("teachers/"))
    manifest["tables"][name]["params"]["stores"] = stores
    (synth_cache / "opdcache.json").write_text(json.dumps(manifest))
    for command, code in (("info", 2), ("validate", 1)):
        with pytest.raises(SystemExit) as exit_:
            main([command, str(synth_cache)])
        captured = capsys.readouterr()
        assert exit_.value.code == code and "Traceback" not in captured.out + captured.err
        assert f"tables/{name}/params/stores" in captured.out + captured.err
        assert "is not a list of distinct store names" in captured.out + captured.err


@pytest.mark.parametrize("module", ["opdcache.stores.rowrules", "opdcache.stores.compact", "opdcache.stores.sampled", "opdcache.stores.base",
                                    "opdcache.format.schema", "opdcache.stores.sampled"])
def test_each_module_the_registry_reaches_imports_first(module):
    """The registry's package is initialised whichever of its neighbours a process imports first (an import order
    that re-entered a half-initialised module broke `from opdcache.training.data import CacheLoader` once)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]

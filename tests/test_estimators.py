"""The estimator registry (opdcache/training/estimators.py): a loss is one entry there, and everything else reads it."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from opdcache.errors import ConfigError
from opdcache.training import estimators as E
from opdcache.training.train import stores_for, TrainConfig, Trainer


def test_a_loss_added_as_one_registry_entry_trains_with_no_other_change(hf_cache, weights, tmp_path, monkeypatch):
    """A new estimator registered at run time (half of lightning's terms) is accepted by the settings, gets its stores,
    and trains: its loss on a batch is exactly half of lightning's on the same batch and weights."""
    base = E.ESTIMATORS["lightning"]

    def half(cfg, batch, s, s_K, div_N, support):
        terms, st, stats = base.terms(cfg, batch, s, s_K, div_N, support)
        return 0.5 * terms, st, stats

    monkeypatch.setitem(E.ESTIMATORS, "half-lightning", dataclasses.replace(base, name="half-lightning", terms=half, summary="test"))
    assert stores_for("half-lightning") == (("logprob",), ("base",))
    common = dict(model=weights / "student", cache=hf_cache, steps=1, batch_size=8, seed=3)
    torch.manual_seed(0)
    new = Trainer(TrainConfig(out=tmp_path / "a", loss="half-lightning", **common))
    torch.manual_seed(0)
    old = Trainer(TrainConfig(out=tmp_path / "b", loss="lightning", **common))
    batch = new.source.next_batch()
    loss_new, _ = new.loss_and_stats(dict(batch))
    loss_old, _ = old.loss_and_stats(dict(batch))
    assert float(loss_new) == pytest.approx(0.5 * float(loss_old), rel=1e-6) and float(loss_old) != 0


def test_the_settings_read_the_registry():
    with pytest.raises(ConfigError, match="--loss must be one of lightning, is, mc, ppo, topk-fkl, topk-rkl, sampled-fkl, full-fkl"):
        TrainConfig(model=Path("m"), cache="c", out=Path("o"), loss="nope")
    with pytest.raises(ConfigError, match="--online supports --loss lightning, is, full-fkl, full-rkl or jsd, got 'mc'"):
        TrainConfig(model=Path("m"), cache="c", out=Path("o"), loss="mc", online=True, teacher_model=Path("t"))
    assert E.ASYNC == ("lightning", "is", "mc", "ppo", "topk-fkl")
    assert E.FULL_VOCABULARY == ("full-fkl", "full-rkl", "jsd")
    assert tuple(n for n, e in E.ESTIMATORS.items() if e.aligned) == ("lightning", "uld", "gold", "span")


@pytest.mark.parametrize("loss, teacher, rollouts, topk_support, have", [
    ("lightning", ("logprob",), ("base",), "teacher", ()),
    ("mc", ("logprob",), ("base", "mc"), "teacher", ()),
    ("topk-fkl", ("logprob", "topk"), ("base",), "teacher", ()),
    ("topk-rkl", ("logprob",), ("base", "ref_topk"), "ref", ()),
    ("sampled-fkl", ("logprob", "sampled"), ("base",), "teacher", ()),
    ("full-rkl", ("logprob", "hidden"), ("base",), "teacher", ("logprob", "hidden")),
    ("jsd", ("logprob", "svd"), ("base",), "teacher", ("logprob", "svd")),
    ("span", ("logprob", "aligned"), ("base",), "teacher", ("logprob", "aligned")),
    ("lightning", ("logprob", "aligned"), ("base",), "teacher", ("logprob", "aligned")),
    ("span", ("logprob",), ("base",), "teacher", ("logprob",)),
])
def test_each_estimator_names_the_stores_it_reads(loss, teacher, rollouts, topk_support, have):
    assert stores_for(loss, topk_support, have) == (teacher, rollouts)


def test_no_other_library_module_names_a_loss():
    """The names of the estimators live in the registry (and the docstrings that explain them): no other module of the
    library dispatches on one by its string."""
    root = Path(E.__file__).parent.parent  # the whole library, not the estimators' folder
    names = [n for n in E.ESTIMATORS if n not in ("lightning", "is", "mc", "ppo")]  # words too common to search for
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name in ("estimators.py", "losses.py", "divergence.py", "kernels.py") or "demo" in path.parts:  # kinds fkl/rkl/jsd
            continue
        code = re.sub(r'"""[\s\S]*?"""', "", path.read_text())
        code = "\n".join(line.split("#", 1)[0] for line in code.splitlines())
        offenders += [f"{path.name}: {n}" for n in names if f'"{n}"' in code or f"'{n}'" in code]
    assert not offenders, offenders


# ---------------------------------------------------------------- what train writes


@pytest.mark.parametrize("mode, save_dtype", [("model", "bfloat16"), ("none", "auto"), ("full", "auto")])
def test_train_writes_what_checkpoint_and_save_dtype_say(hf_cache, weights, tmp_path, capsys, mode, save_dtype):
    from safetensors.torch import load_file

    from opdcache.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--model", str(weights / "student"), "--cache", str(hf_cache), "--out", str(tmp_path), "--steps", "1",
              "--batch-size", "4", "--checkpoint", mode, "--save-dtype", save_dtype])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert (tmp_path / "checkpoint").is_dir() == (mode == "full")
    assert (tmp_path / "model").is_dir() == (mode != "none")
    assert (tmp_path / "metrics.jsonl").is_file()
    if mode != "none":
        weights_saved = load_file(str(tmp_path / "model" / "model.safetensors"))
        want = torch.bfloat16 if save_dtype == "bfloat16" else torch.float32
        assert {v.dtype for v in weights_saved.values()} == {want}
        assert json.loads((tmp_path / "model" / "config.json").read_text())["dtype"] == str(want).replace("torch.", "")
    if mode == "model":
        assert "no checkpoint (--checkpoint model): the run cannot be resumed" in out
    if mode == "none":
        assert "no model (--checkpoint none)" in out


def test_checkpoint_settings_are_checked():
    common = dict(model=Path("m"), cache="c", out=Path("o"))
    with pytest.raises(ConfigError, match="--checkpoint must be one of full, model, none, got 'some'"):
        TrainConfig(checkpoint="some", **common)
    with pytest.raises(ConfigError, match="--checkpoint-every .* needs --checkpoint full, got --checkpoint model"):
        TrainConfig(checkpoint="model", checkpoint_every=2, **common)
    with pytest.raises(ConfigError, match="--save-dtype must be one of auto, float32, bfloat16, got 'fp8'"):
        TrainConfig(save_dtype="fp8", **common)

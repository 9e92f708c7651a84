"""The trainer: every estimator trains, resume is exact, the CLI reads YAML, DDP runs on CPU (gloo)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from opdcache.cli.main import main
from opdcache.errors import ConfigError
from opdcache.training.estimators import ESTIMATORS
from opdcache.training.train import run_train, TrainConfig


def _weights(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("loss", [name for name, e in ESTIMATORS.items() if not e.span_topk])  # uld, gold: test_crossteacher
def test_every_estimator_trains_and_logs(hf_cache, weights, tmp_path, loss):
    res = run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, loss=loss, steps=2, batch_size=8, lr=1e-4))
    metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("loss", "is_weight_mean", "is_weight_std", "k1", "k3", "grad_norm"):
        assert all(torch.isfinite(torch.tensor(m[key])) for m in metrics), key
    assert metrics[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)  # step 1: the student is pi_ref
    assert (tmp_path / "model" / "config.json").is_file() and res["steps"] == 2


def test_killed_and_resumed_run_ends_with_the_same_weights(hf_cache, weights, tmp_path):
    common = dict(model=weights / "student", cache=hf_cache, loss="lightning", steps=6, batch_size=4, lr=1e-3, deterministic=True, checkpoint_every=2)
    run_train(TrainConfig(out=tmp_path / "straight", **common))
    first = run_train(TrainConfig(out=tmp_path / "resumed", stop_after=3, **common))
    assert first["stopped_at"] == 3
    second = run_train(TrainConfig(out=tmp_path / "resumed", **common))
    assert second["resumed"] is True
    a, b = _weights(tmp_path / "straight" / "model"), _weights(tmp_path / "resumed" / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(l)["step"] for l in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the un-checkpointed step 3 was redone, not logged twice


def test_resume_with_changed_settings_is_refused(hf_cache, weights, tmp_path):
    run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, steps=1, batch_size=4))
    with pytest.raises(ConfigError, match=r"different settings \(lr: 2e-06 -> 0.001\)"):
        run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, steps=2, batch_size=4, lr=1e-3))


def test_a_finished_run_run_again_loads_nothing_and_writes_nothing(hf_cache, weights, tmp_path, capsys):
    import shutil

    student = tmp_path / "student"
    shutil.copytree(weights / "student", student)
    args = ["train", "--model", str(student), "--cache", str(hf_cache), "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "4"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0, capsys.readouterr().err
    capsys.readouterr()
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.is_file()}
    (student / "model.safetensors").unlink()  # loading the student now fails: the rerun must not try
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr().out
    assert e.value.code == 0 and "already trained to step 2 with these settings" in out and "nothing to do" in out, out
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.is_file()} == written
    for more, why in ((["--steps", "3"], "more steps"), (["--save-dtype", "bfloat16"], "the model in another dtype")):
        with pytest.raises(SystemExit) as e:  # not finished: resumed, so the student loads (and here cannot)
            main(args + more)
        assert e.value.code != 0 and "already trained" not in capsys.readouterr().out, why
    with pytest.raises(SystemExit) as e:  # other settings: refused before the student would load
        main(args + ["--lr", "1e-3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "was written with different settings (lr: 2e-06 -> 0.001)" in err and "Traceback" not in err, err


def test_cli_reads_yaml_and_flags_override(hf_cache, weights, tmp_path, capsys):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"model: {weights / 'student'}\ncache: {hf_cache}\nloss: is\nsteps: 5\nbatch_size: 4\ncorrections:\n  tis_cap: 2.0\n")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(cfg), "--out", str(tmp_path / "o"), "--steps", "2"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "teacher consistency: consistent" in out
    metrics = [json.loads(l) for l in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and "tis_clip_fraction" in metrics[0]
    cfg.write_text("bogus: 1\n")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(cfg), "--model", "m", "--cache", "c", "--out", "o"])
    assert e.value.code == 2 and "unknown training settings ['bogus']" in capsys.readouterr().err


def test_train_packs_unless_no_pack_is_given(hf_cache, weights, tmp_path, capsys):
    """`opdcache train` trains on packed batches by default and on padded ones with --no-pack; the checkpoint records
    which."""
    for flags, pack in (([], True), (["--no-pack"], False)):
        out = tmp_path / ("packed" if pack else "padded")
        with pytest.raises(SystemExit) as e:
            main(["train", "--model", str(weights / "student"), "--cache", str(hf_cache), "--out", str(out), "--steps", "1",
                  "--batch-size", "4", *flags])
        assert e.value.code == 0, capsys.readouterr().err
        assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["config"]["pack"] is pack


def test_sft_command_records_the_teacher_as_lineage(tmp_path, weights, opd_prompts):
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.lineage import model_info, read_sft_lineage
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.training.sft import SFTConfig, run_sft

    run_generate(GenerateJob(model=weights / "teacher", prompts=PromptConfig(opd_prompts, limit=8), out=tmp_path / "sft", kind="sft",
                             num_shards=2, sampling=SamplingConfig(max_new_tokens=40), reward="addition"))
    res = run_sft(weights / "student", tmp_path / "sft", tmp_path / "pi_ref", SFTConfig(steps=3, batch_size=4), only_correct=True)
    assert res["pairs"] + res["skipped"] == 8
    lineage = read_sft_lineage(tmp_path / "pi_ref")
    assert lineage["sft_teacher"]["fingerprint"] == model_info(weights / "teacher")["fingerprint"]


@pytest.mark.slow
def test_ddp_with_two_cpu_processes(hf_cache, weights, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(
        # a rank stuck for 120 s prints every thread's stack and exits, so a hang fails with the place it hung
        "import faulthandler; faulthandler.dump_traceback_later(120, exit=True)\n"
        "import sys, json\nfrom pathlib import Path\nfrom opdcache.training.train import TrainConfig, run_train\n"
        f"r = run_train(TrainConfig(model=Path({str(weights / 'student')!r}), cache=Path({str(hf_cache)!r}), out=Path({str(tmp_path / 'out')!r}), "
        "steps=2, batch_size=4, lr=1e-3, deterministic=True))\n"
        # one write per rank: torchrun runs the ranks unbuffered, and print()'s separate writes interleave character by character
        "sys.stdout.write(f'RESULT {json.dumps(r[\"steps\"])}\\n')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "torchrun"), str(script)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # both ranks print after the final barrier, in either order
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT")) == ["RESULT 2", "RESULT 2"], proc.stdout
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("loss", ["lightning", "full-rkl"])
def test_online_baseline_samples_from_the_current_student_with_a_live_teacher(hf_cache, weights, tmp_path, loss):
    # no KL penalty: with one, the reference column is the frozen pi_ref's scores and the weights below measure the drift
    run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, loss=loss, steps=3, batch_size=6, lr=1e-3, online=True,
                          teacher_model=weights / "teacher", max_new_tokens=24, temperature=1.0, kl_coef=0.0))
    metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # fresh rollouts every step: the student's log-probs equal the sampling engine's at every step, even after updates
    assert all(m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and m["k1"] == pytest.approx(0.0, abs=1e-4) for m in metrics)
    assert all(m["tokens"] <= 6 * 24 for m in metrics)


def test_online_kl_penalty_scores_pi_ref_live(hf_cache, weights, tmp_path):
    """--online --kl-coef: a frozen pi_ref scores the fresh samples, so the logged weight is pi_theta / pi_ref (exactly 1
    at the first step, before any update) and the penalty is measured against pi_ref, not against the sampler."""
    result = run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, loss="lightning", steps=4, batch_size=6, lr=3e-3,
                                   online=True, teacher_model=weights / "teacher", max_new_tokens=24, temperature=1.0, kl_coef=1.0))
    metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and metrics[0]["kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert metrics[-1]["kl_penalty"] > 1e-4 and abs(metrics[-1]["is_weight_mean"] - 1) > 1e-4  # the student moved; pi_ref did not
    assert result["online_seconds"]["pi_ref"] > 0


def test_online_refuses_a_loss_it_cannot_feed(hf_cache, weights, tmp_path):
    with pytest.raises(ConfigError, match="--online supports --loss lightning, is, full-fkl, full-rkl or jsd, got 'mc'"):
        TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, loss="mc", online=True, teacher_model=weights / "teacher")
    with pytest.raises(ConfigError, match="--online needs --teacher-model"):
        TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, online=True)



def test_full_vocabulary_losses_train_from_an_svd_store(hf_cache, weights, tmp_path):
    """A teacher table with an svd store and no hidden one feeds full-fkl: the rank-r vectors with the projection's
    decoder and bias stand in for the hidden states and the head. At full rank the projection is the identity, so the
    first step's loss equals the hidden store's."""
    import shutil

    from opdcache.format.cache import Cache
    from opdcache.teacher.scoring import ScoreJob, run_score

    cache = tmp_path / "cache"
    shutil.copytree(hf_cache, cache)
    hidden_size = json.loads((weights / "teacher" / "config.json").read_text())["hidden_size"]
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher", slug="svdonly", stores=("logprob", "svd"), svd_rank=hidden_size,
                       svd_dtype="float32"))
    assert set(Cache(cache).params("teachers/svdonly").stores) == {"logprob", "svd"}
    common = dict(model=weights / "student", cache=cache, loss="full-fkl", steps=1, batch_size=8, lr=1e-4, seed=3)
    run_train(TrainConfig(out=tmp_path / "svd", teacher="svdonly", **common))
    run_train(TrainConfig(out=tmp_path / "hidden", teacher="teacher", **common))
    svd, hidden = (json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0]) for run in ("svd", "hidden"))
    assert svd["loss"] == pytest.approx(hidden["loss"], rel=1e-3, abs=1e-5) and svd["loss"] > 0
    # the default store: rank 16 in bfloat16 bits, decoded to a bfloat16 tensor (this tiny teacher's logits are nearly
    # rank 16: its first loss is within bfloat16 rounding of the hidden store's)
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher", slug="svd16", stores=("logprob", "svd"), svd_rank=16))
    run_train(TrainConfig(out=tmp_path / "svd16", teacher="svd16", **common))
    low = json.loads((tmp_path / "svd16" / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(low["loss"]) and low["loss"] == pytest.approx(hidden["loss"], rel=1e-2)


def test_a_teacher_head_of_other_shapes_is_refused_in_one_line():
    """head.safetensors / svd.safetensors are untrusted: a matrix that is not [the student's vocabulary, the stored
    vectors' width] (or a bias of another length) is refused naming the file and the shapes, not inside a matmul."""
    from opdcache.errors import SchemaError
    from opdcache.stores.head import Head
    from opdcache.training.sources import checked_head

    good = Head(torch.zeros(10, 4), torch.zeros(10))
    assert checked_head(good, 10, 4, "svd.safetensors") is good
    assert checked_head(Head(torch.zeros(10, 4), None), 10, 4, "head.safetensors").bias is None
    for head, shown in ((Head(torch.zeros(12, 4), None), "[12, 4] matrix"), (Head(torch.zeros(10, 5), None), "[10, 5] matrix"),
                        (Head(torch.zeros(10, 4), torch.zeros(3)), "[10, 4] matrix and a [3] bias")):
        with pytest.raises(SchemaError, match=rf"svd.safetensors holds a {re.escape(shown)}, where the student's vocabulary and the stored "
                                              r"vectors need \[10, 4\]; score the teacher again"):
            checked_head(head, 10, 4, "svd.safetensors")

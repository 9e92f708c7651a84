"""AsyncOPD over the cache (opdcache/asyncopd): three stage processes that share only the cache.

K = 0 equals the synchronous online trainer step for step; a stage killed at any moment resumes to the same run;
the logged importance weights are pi_theta / pi_old recomputed independently; a changed setting is refused.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from opdcache.asyncopd import AsyncConfig, learner, queue as Q, run_async
from opdcache.backends.base import SamplingConfig
from opdcache.inputs.prompts import PromptConfig

FAST = SamplingConfig(temperature=1.0, max_new_tokens=8)


LEARNER = ("steps", "batch_size", "lr", "loss", "seed", "importance_weights", "exact")


def _cfg(weights, prompts, out, **kw):
    run = {"steps": 4, "batch_size": 4, "lr": 1e-4, **{k: kw.pop(k) for k in LEARNER if k in kw}}
    base = dict(teacher=weights / "teacher", prompts=PromptConfig(prompts), out=out, staleness=1, sampling=FAST, device="cpu", threads=1)
    return AsyncConfig(learner=learner(weights / "student", **run), **{**base, **kw})


def _metrics(out, learner="learner"):
    return [json.loads(l) for l in (Path(out) / learner / "metrics.jsonl").read_text().splitlines()]


def _hashes(cache):
    from opdcache.inputs.fingerprint import sha256_file

    return {p.relative_to(cache).as_posix(): sha256_file(p) for p in sorted(Path(cache).rglob("*.parquet"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, weights, opd_prompts):
    """An uninterrupted run at K = 1 (6 steps), the reference of the kill tests."""
    cfg = _cfg(weights, opd_prompts, tmp_path_factory.mktemp("async") / "ref", steps=6)
    return cfg, run_async(cfg)


@pytest.mark.slow
def test_k0_equals_the_synchronous_online_trainer_step_for_step(tmp_path, weights, opd_prompts):
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.training.train import TrainConfig, run_train

    cfg = _cfg(weights, opd_prompts, tmp_path / "async", staleness=0)
    run_async(cfg)
    # the online baseline draws its prompts from a cache built on the same prompt file (same order)
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts), out=tmp_path / "prompts_cache",
                             num_shards=1, sampling=SamplingConfig(max_new_tokens=2)))
    run_train(TrainConfig(model=weights / "student", cache=tmp_path / "prompts_cache", out=tmp_path / "online", loss="is", online=True,
                          teacher_model=weights / "teacher", steps=4, batch_size=4, lr=1e-4, max_new_tokens=8, temperature=1.0,
                          kl_coef=0.0))  # async's learner has no KL penalty to pi_ref
    a, b = _metrics(tmp_path / "async"), _metrics(tmp_path / "online", learner="")
    assert [m["tokens"] for m in a] == [m["tokens"] for m in b]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), (x["step"], x["loss"], y["loss"])
        assert x["rho_mean"] == pytest.approx(y["rho_mean"], abs=1e-5)
    assert [m["staleness"] for m in a] == [0, 0, 0, 0]


@pytest.mark.slow
def test_a_run_validates_and_records_each_shards_snapshot_and_staleness(reference, capsys):
    from opdcache.cli.main import main
    from opdcache.format.validate import validate

    cfg, result = reference
    assert [s["student_version"] for s in result["async"]["shards"]] == [0, 0, 1, 2, 3, 4]  # max(0, b - 1)
    assert [s["staleness"] for s in result["async"]["shards"]] == [0, 1, 1, 1, 1, 1]  # ramps, then plateaus at K
    assert [m["staleness"] for m in _metrics(cfg.out)] == [0, 1, 1, 1, 1, 1]
    assert not [p for p in validate(cfg.cache_root) if not p.warning]
    import pyarrow.parquet as pq

    versions = [pq.read_table(p, columns=["student_version"])["student_version"].to_pylist()
                for p in sorted((Path(cfg.cache_root) / "rollouts").glob("*.parquet"))]
    assert versions == [[v] * 4 for v in (0, 0, 1, 2, 3, 4)]  # every row records the snapshot that sampled it
    with pytest.raises(SystemExit) as e:
        main(["info", cfg.cache_root])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "async run: 6 steps of is, K = 1" in out and "3: v2 -> 4 (1)" in out
    assert not list((Path(cfg.cache_root) / Q.SNAPSHOTS).iterdir())  # snapshots are gone once the run is over
    figures = result["figures"]
    assert figures["updates"] == 6 and 0 < figures["overlap"] <= 3 and figures["throughput_tokens_per_s"] > 0


@pytest.mark.slow
def test_logged_importance_weights_equal_pi_theta_over_pi_old_recomputed(tmp_path, weights, opd_prompts):
    """Batch 3 at K = 1 is sampled by snapshot v2 and consumed by the learner after 3 updates (snapshot v3): the logged
    rho_mean must be exp(log pi_v3 - log pi_v2) over its tokens, recomputed here with a plain full-logits forward."""
    from transformers import AutoModelForCausalLM

    from opdcache.training.data import collate
    from opdcache.training.decoded import DecodedShard

    cfg = _cfg(weights, opd_prompts, tmp_path / "run", steps=5, keep_snapshots=True)
    run_async(cfg)
    model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float32).eval()
    rollout = Path(cfg.cache_root) / "rollouts" / "part-00003-of-00005.parquet"
    shard = DecodedShard(rollout, None, ["prompt_ids", "response_ids", "sampling_logprobs"], [])
    batch = collate([shard.row(i) for i in range(4)])
    mask = batch["response_mask"].bool()

    def logprobs(version):
        Q.load_snapshot(model, cfg.cache_root, version)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
        full = torch.log_softmax(logits, -1)  # [B, L, V]: position p predicts token p + 1
        rows = torch.arange(full.shape[0])[:, None]
        return full[rows, batch["logit_positions"], batch["response_ids"]]  # [B, T] at the response tokens

    pi_old, pi_theta = logprobs(2), logprobs(3)
    assert (pi_old - batch["sampling_logprobs"].double())[mask].abs().max() < 1e-4  # the batch was sampled by v2
    rho = (pi_theta - pi_old).exp()[mask]
    logged = _metrics(cfg.out)[3]
    assert logged["student_version"] == 2 and logged["staleness"] == 1
    assert logged["rho_mean"] == pytest.approx(float(rho.mean()), abs=2e-5)
    assert logged["rho_max"] == pytest.approx(float(rho.max()), abs=2e-5)
    assert float(rho.std()) > 1e-4  # the student moved: the test would see a wrong weight


@pytest.mark.slow
def test_a_lora_learner_publishes_adapters_alone_and_the_worker_samples_with_them(tmp_path, weights, opd_prompts):
    """--lora-rank: each snapshot holds the adapters only (a small fraction of a whole student's), the rollout worker
    samples batch 3 with snapshot v2's adapters on its frozen base (its sampling log-probs are the base plus v2's
    adapters, recomputed here), and the logged importance weight is pi_v3 / pi_v2 of the adapters."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from opdcache.training import lora
    from opdcache.training.data import collate
    from opdcache.training.decoded import DecodedShard

    base = dict(teacher=weights / "teacher", prompts=PromptConfig(opd_prompts), out=tmp_path / "run", staleness=1,
                sampling=FAST, device="cpu", threads=1, keep_snapshots=True)
    cfg = AsyncConfig(learner=learner(weights / "student", steps=5, batch_size=4, lr=1e-2, lora_rank=4), **base)
    run_async(cfg)
    snap = load_file(str(Q.snapshot_path(cfg.cache_root, 2)))
    model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float32)
    whole = sum(p.numel() for p in model.parameters())
    assert snap and all(".lora_" in k for k in snap) and sum(t.numel() for t in snap.values()) < 0.1 * whole
    lora.apply(model, cfg.learner)
    model.eval()
    rollout = Path(cfg.cache_root) / "rollouts" / "part-00003-of-00005.parquet"
    shard = DecodedShard(rollout, None, ["prompt_ids", "response_ids", "sampling_logprobs"], [])
    batch = collate([shard.row(i) for i in range(4)])
    mask = batch["response_mask"].bool()

    def logprobs(version):
        Q.load_snapshot(model, cfg.cache_root, version, adapters=True)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
        full = torch.log_softmax(logits, -1)
        rows = torch.arange(full.shape[0])[:, None]
        return full[rows, batch["logit_positions"], batch["response_ids"]]

    pi_old, pi_theta = logprobs(2), logprobs(3)
    assert (pi_old - batch["sampling_logprobs"].double())[mask].abs().max() < 1e-4  # sampled with v2's adapters
    rho = (pi_theta - pi_old).exp()[mask]
    logged = _metrics(cfg.out)[3]
    assert logged["student_version"] == 2 and logged["rho_mean"] == pytest.approx(float(rho.mean()), abs=2e-5)
    assert float(rho.std()) > 1e-4  # the adapters moved: a worker still on the base would fail the first check
    assert (Path(cfg.out) / "learner" / "model" / "adapter_model.safetensors").is_file()  # the run's output: the adapters


def test_an_adapter_snapshot_of_other_adapters_is_refused_in_one_line(tmp_path, weights):
    """A snapshot whose adapters are not this run's (another rank, other targets) is refused naming the file."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from opdcache.errors import SchemaError
    from opdcache.training import lora

    def student(**settings):
        model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float32)
        lora.apply(model, learner(weights / "student", **settings))
        return model

    Q.publish_snapshot(student(lora_rank=4), tmp_path, 1, adapters=True)
    Q.load_snapshot(student(lora_rank=4), tmp_path, 1, adapters=True)  # the same adapters load
    for other in (dict(lora_rank=2), dict(lora_rank=4, lora_targets="q_proj")):
        with pytest.raises(SchemaError, match=r"student-v000001\.safetensors does not hold this run's adapters .* start the run in a new cache"):
            Q.load_snapshot(student(**other), tmp_path, 1, adapters=True)


def _start(cfg_args, out):
    return subprocess.Popen([sys.executable, "-m", "opdcache.cli.main", "async", *cfg_args, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _cli_args(weights, prompts, steps=6):
    return ["--model", str(weights / "student"), "--teacher", str(weights / "teacher"), "--prompts", str(prompts),
            "--staleness", "1", "--steps", str(steps), "--batch-size", "4", "--temperature", "1.0", "--max-new-tokens", "8",
            "--lr", "1e-4", "--device", "cpu", "--threads", "1"]


@pytest.mark.slow
def test_each_killed_stage_resumes_to_the_uninterrupted_run(tmp_path, weights, opd_prompts, reference):
    """SIGKILL each stage in turn, once ``after`` learner updates are in the ledger (the rollout stage after 1, the
    teacher after 3, the learner after 4): each time the run stops with one line and keeps everything, and the same
    command resumes it; at the end every batch was consumed once and shards and losses equal the uninterrupted run's."""
    ref_cfg, _ = reference
    out = tmp_path / "run"
    ledger = out / Q.LEDGER
    for stage, after in [("rollout", 1), ("teacher", 3), ("learner", 4)]:
        pid_file = out / "stages" / f"{stage}.pid"
        stale = pid_file.read_text() if pid_file.exists() else None  # the previous attempt's stage
        proc = _start(_cli_args(weights, opd_prompts), out)
        deadline = time.monotonic() + 300  # a guard against a hang, not a measured duration
        while ((len(Q.read_jsonl(ledger)) < after or not pid_file.exists() or pid_file.read_text() == stale)
               and proc.poll() is None and time.monotonic() < deadline):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and "Traceback" not in err, err
        assert f"the {stage} stage stopped (signal 9)" in err and "rerun the same command to resume" in err and len(err.strip().splitlines()) == 1
        assert [e["batch"] for e in Q.read_jsonl(ledger)] == list(range(len(Q.read_jsonl(ledger))))  # in order, none twice
    again = _start(_cli_args(weights, opd_prompts), out)
    stdout, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert [e["batch"] for e in Q.read_jsonl(ledger)] == list(range(6))  # none consumed twice, none skipped
    assert stdout.startswith(f"{out}: 6 updates of") and "(this attempt, the 4th: " in stdout  # every update counted, the timing this attempt's
    assert _hashes(out / "cache") == _hashes(Path(ref_cfg.cache_root))
    for x, y in zip(_metrics(out), _metrics(ref_cfg.out), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)


def test_resume_with_other_settings_is_refused_with_the_difference(tmp_path, weights, opd_prompts):
    """A run directory whose run.json records other settings (as a started run leaves it) is refused before any stage
    starts, naming the difference, in one line."""
    from opdcache.asyncopd.run import _begin

    cfg = _cfg(weights, opd_prompts, tmp_path / "run", steps=6)  # the settings _cli_args gives
    _begin(cfg)
    proc = subprocess.run([sys.executable, "-m", "opdcache.cli.main", "async", *_cli_args(weights, opd_prompts), "--out", str(cfg.out),
                           "--lr", "3e-4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "holds an async run with other settings (lr: 0.0001 -> 0.0003);" in proc.stderr  # that difference alone
    assert len(proc.stderr.strip().splitlines()) == 1  # one line: the difference and the fix


@pytest.mark.slow
def test_a_stage_that_cannot_start_stops_the_run_in_one_line(tmp_path, weights, opd_prompts, capsys):
    from opdcache.cli.main import main

    args = _cli_args(weights, opd_prompts)
    with pytest.raises(SystemExit) as e:
        main(["async", *[a if a != str(weights / "teacher") else str(tmp_path / "no-teacher") for a in args], "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no-teacher" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"question": "1+2"}\n')
    with pytest.raises(SystemExit) as e:
        main(["async", *[a if a != str(opd_prompts) else str(bad) for a in args], "--out", str(tmp_path / "r2")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "the rollout stage stopped (exit 2): no usable prompt" in err and len(err.strip().splitlines()) == 1


def test_figures_count_every_update_and_time_the_last_attempt_alone(tmp_path):
    """A resumed run: its earlier attempt's busy intervals and the pause between attempts are not its speed, and a
    ledger line recovered without a time is still an update."""
    from opdcache.asyncopd.run import ATTEMPTS, figures

    cfg = AsyncConfig(learner=learner("m"), teacher=Path("t"), prompts=PromptConfig(Path("p.jsonl")), out=tmp_path)
    lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    (tmp_path / ATTEMPTS).write_text(lines([{"attempt": 1, "start": 0.0}, {"attempt": 2, "start": 1000.0}]))
    ledger = [{"batch": 0, "student_version": 0, "consumed_at_step": 1, "time": None, "tokens": None, "recovered": True}]
    ledger += [{"batch": b, "student_version": b, "consumed_at_step": b + 1, "time": 1000.0 + 10 * b, "tokens": 100} for b in range(1, 8)]
    (tmp_path / Q.LEDGER).write_text(lines(ledger))
    (tmp_path / "stages").mkdir()
    for stage, ivs in {"rollout": [(5, 900), (1000, 1040)], "teacher": [(1020, 1060)], "learner": [(1010, 1070)]}.items():
        (tmp_path / "stages" / f"{stage}.busy.jsonl").write_text(lines([{"batch": 0, "start": a, "end": b} for a, b in ivs]))
    fig = figures(cfg)
    assert fig["updates"] == 8 and fig["attempt"] == 2 and fig["updates_this_attempt"] == 7
    assert fig["throughput_tokens_per_s"] == pytest.approx(200 / 20)  # updates 6 and 7 after update 5 at t = 1050
    assert fig["wall_s"] == 70 and fig["busy_s"] == {"rollout": 40, "teacher": 40, "learner": 60}
    assert fig["overlap"] == pytest.approx(140 / 70)


def test_the_supervisor_reports_progress_at_once_and_from_the_stages_files(tmp_path, capsys, monkeypatch):
    """The README's async printed one line, after 497 s. With --progress the supervisor reports at once, then
    the learner's updates (ledger) and the batches the other stages finished (their busy intervals)."""
    from opdcache.asyncopd.run import _Watch
    from opdcache.progress import bar

    monkeypatch.setenv("OPDCACHE_PROGRESS_INTERVAL", "0")
    cfg = AsyncConfig(learner=learner("m", steps=4), teacher=Path("t"), prompts=PromptConfig(Path("p.jsonl")), out=tmp_path)
    (tmp_path / "stages").mkdir()
    with bar(total=4, desc="async", unit="update", enabled=True, track=True) as pbar:
        watch = _Watch(cfg, pbar)
        first = capsys.readouterr().err
        for stage, n in (("rollout", 3), ("teacher", 2)):
            (tmp_path / "stages" / f"{stage}.busy.jsonl").write_text("".join(json.dumps({"batch": b, "start": 0, "end": 1}) + "\n" for b in range(n)))
        (tmp_path / Q.LEDGER).write_text(json.dumps({"batch": 0, "student_version": 0, "consumed_at_step": 1, "time": 1.0, "tokens": 5}) + "\n")
        watch.at = 0.0  # a second has passed
        watch.poll()
    assert first.startswith("async: 0/4 update (starting the rollout, teacher and learner stages), 0 s"), first
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("async: 1/4 update (batches sampled 3, scored 2)"), lines


def test_settings_that_cannot_work_asynchronously_are_refused():
    from opdcache.errors import ConfigError

    p = PromptConfig(Path("p.jsonl"))
    with pytest.raises(ConfigError, match="full-vocabulary losses need the teacher's hidden states"):
        AsyncConfig(learner=learner("m", loss="full-rkl"), teacher=Path("t"), prompts=p, out=Path("o"))
    with pytest.raises(ConfigError, match="--loss mc needs --mc-samples"):
        AsyncConfig(learner=learner("m", loss="mc"), teacher=Path("t"), prompts=p, out=Path("o"))
    with pytest.raises(ConfigError, match="--staleness must be >= 0"):
        AsyncConfig(learner=learner("m"), teacher=Path("t"), prompts=p, out=Path("o"), staleness=-1)


@pytest.mark.parametrize("prompts,batch", [(5, 3), (7, 7), (3, 8), (10, 4)])
def test_sample_indices_equal_counting_every_earlier_batch(prompts, batch):
    from opdcache.asyncopd.stages import sample_indices
    from opdcache.training.schedule import PromptSchedule

    def reference(schedule, b):  # the plain definition: count each prompt's draws in batches 0..b-1, then within b
        seen = {}
        for earlier in range(b):
            for i in schedule.batch(earlier)[0]:
                seen[i] = seen.get(i, 0) + 1
        out = []
        for i in schedule.batch(b)[0]:
            out.append(seen.get(i, 0))
            seen[i] = out[-1] + 1
        return out

    schedule = PromptSchedule(prompts, batch, seed=3)
    for b in range(12):
        assert sample_indices(schedule, b) == reference(PromptSchedule(prompts, batch, seed=3), b)


def test_an_out_that_is_a_file_is_one_line(tmp_path, weights, opd_prompts, capsys):
    from opdcache.cli.main import main

    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(SystemExit) as e:
        main(["async", "--model", str(weights / "student"), "--teacher", str(weights / "teacher"), "--prompts", str(opd_prompts),
              "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--out" in err and "is a file" in err and len(err.strip().splitlines()) == 1


def test_the_python_default_temperature_is_the_clis():
    from opdcache.asyncopd.config import AsyncConfig

    assert AsyncConfig.__dataclass_fields__["sampling"].default_factory().temperature == 1.0  # the README's K = 0 weight of 1


def test_the_learner_has_no_kl_penalty_whatever_trains_default(weights, opd_prompts, tmp_path):
    """papers/001's learner has no penalty to pi_ref, and a queued batch's ref_logprobs are its sampling snapshot's, not
    pi_ref's: the learner's settings turn the penalty off although `train` defaults to one."""
    from opdcache.training.trainconfig import TrainConfig

    run = _cfg(weights, opd_prompts, tmp_path / "run").learner
    assert TrainConfig.kl_coef > 0 and run.kl_coef == 0.0
    assert run.tau == TrainConfig.tau


RECORDED_IDENTITY = json.loads("""{"batch_size": 4, "cache": null, "checkpoint_every": 1, "chunk": 8192, "deterministic": false,
 "importance_weights": true, "loss": "is", "lr": 0.0001, "max_grad_norm": 1.0, "model": "/m/student", "out": "/run", "ppo_clip": 0.2,
 "prompts": {"answer_field": "answer", "chat_template": true, "chat_template_kwargs": null, "limit": null, "messages_field": null,
 "path": "/p.jsonl", "prompt_field": "prompt", "revision": null, "split": "train", "strict": false, "system_prompt": null},
 "sampling": {"max_new_tokens": 8, "mc_samples": null, "ref_top_k": null, "samples": 1, "seed": 0, "temperature": 1.0, "top_p": 1.0},
 "seed": 0, "staleness": 1, "steps": 4, "tau": 1.0, "teacher": "/m/teacher", "top_k": null, "weight_decay": 0.1}""")


def test_the_learner_is_trains_settings_and_a_recorded_run_keeps_its_identity():
    """The async learner is a TrainConfig (no field of train's restated); the identity a run.json recorded when the
    learner's settings were flat fields of AsyncConfig is the one the same settings give now, so such a run resumes;
    the run record round-trips; a learner setting async does not take, or a KL penalty, is refused in one line."""
    from opdcache.errors import ConfigError
    from opdcache.training.trainconfig import TrainConfig

    cfg = AsyncConfig(learner=learner("/m/student", steps=4, batch_size=4, lr=1e-4), teacher=Path("/m/teacher"),
                      prompts=PromptConfig(Path("/p.jsonl")), out=Path("/run"), sampling=FAST, device="cpu", threads=1)
    assert cfg.identity() == RECORDED_IDENTITY
    assert AsyncConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    assert isinstance(cfg.learner, TrainConfig) and cfg.learner.out == Path("/run/learner") and cfg.learner.cache == "/run/cache"
    assert cfg.learner.dtype == "float32" and cfg.learner.kl_coef == 0.0
    p = PromptConfig(Path("p.jsonl"))
    with pytest.raises(ConfigError, match="^the async learner takes .*; pack is offline training's"):
        AsyncConfig(learner=learner("m", pack=True), teacher=Path("t"), prompts=p, out=Path("o"))
    with pytest.raises(ConfigError, match="no KL penalty to pi_ref .* got kl_coef 1.0"):
        AsyncConfig(learner=TrainConfig(model=Path("m"), cache="", out=Path(), loss="is"), teacher=Path("t"), prompts=p, out=Path("o"))


def test_a_run_record_from_before_a_setting_resumes_with_its_default(tmp_path, capsys):
    """An upgrade adds a setting: the run.json written before it lacks it, which takes its default (said once); given
    another value, the difference is refused."""
    from opdcache.asyncopd.run import _begin
    from opdcache.errors import ResumeError

    def cfg(**kw):
        return AsyncConfig(learner=learner("/m/student", steps=4, batch_size=4, lr=1e-4, **kw), teacher=Path("/m/teacher"),
                           prompts=PromptConfig(Path("/p.jsonl")), out=tmp_path, sampling=FAST, device="cpu", threads=1)

    _begin(cfg())
    record = json.loads((tmp_path / "run.json").read_text())
    del record["identity"]["weight_decay"]  # written by a version before the setting
    (tmp_path / "run.json").write_text(json.dumps(record))
    with pytest.raises(ResumeError, match=r"other settings \(weight_decay: 0.1 -> 0.5\)"):
        _begin(cfg(weight_decay=0.5))
    capsys.readouterr()
    _begin(cfg())
    assert "predates the settings weight_decay = 0.1" in capsys.readouterr().err

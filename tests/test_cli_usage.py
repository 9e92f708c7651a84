"""Usage errors through the installed ``opdcache`` entry point: one line on stderr, exit 2, never a traceback.

Run as a user runs it (a subprocess of the console script), so the typer/click version the install resolved is the
one under test: typer >= 0.29 raises its vendored click exceptions, which an ``isinstance`` check on ``click`` misses.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

OPDCACHE = shutil.which("opdcache") or str(Path(sys.executable).with_name("opdcache"))

CASES = [
    ([], "usage: opdcache COMMAND [OPTIONS]; commands: "),
    (["info"], "error: Missing argument 'CACHE'; see `opdcache info --help`"),
    (["bogus"], "error: No such command 'bogus'; see `opdcache --help`"),
    (["train", "--stepz", "3"], "error: No such option: --stepz"),
    (["export", "x"], "error: Missing option '--to'; see `opdcache export --help`"),
    (["train", "--steps", "abc"], "error: Invalid value for '--steps'"),
    (["build-rollouts", "--samples", "1.5"], "error: Invalid value for '--samples'"),
]


@pytest.mark.parametrize("args,expected", CASES, ids=[" ".join(a) or "no-args" for a, _ in CASES])
def test_a_usage_error_is_one_line_and_exit_2(args, expected):
    assert Path(OPDCACHE).exists(), "the opdcache console script is not installed (pip install -e .)"
    proc = subprocess.run([OPDCACHE, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr


def test_no_arguments_names_every_command_in_its_one_line():
    proc = subprocess.run([OPDCACHE], capture_output=True, text=True, timeout=120)
    for name in ("demo", "build-rollouts", "score-teacher", "train", "async", "validate"):
        assert name in proc.stderr


def test_ctrl_c_is_one_line_saying_what_is_kept(tmp_path):
    """SIGINT while a command runs: exit 130 and one line saying finished work is kept and how to resume."""
    import signal

    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time\n"
        "from opdcache.cli import main as m\n"
        "import typer\n"
        "def slow(seconds: float = 60.0) -> None:\n"
        "    print('started', flush=True)\n"
        "    time.sleep(seconds)\n"
        "m._register()\n"
        "m.app.command('slow')(slow)\n"
        "m.main(['slow'])\n")
    # the child gets SIGINT's default disposition whatever the runner inherited (a background job starts with it ignored)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "started"  # wait on the command's own signal, not on a clock
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err
    assert err.strip() == "interrupted: finished shards and checkpoints are kept; rerun the same command to resume"


@pytest.mark.parametrize("world,shutdown", [("2", False), ("1", True)])
def test_a_torchrun_worker_leaves_without_interpreter_shutdown_and_keeps_its_output(world, shutdown):
    """Under torchrun (WORLD_SIZE > 1) the command leaves by os._exit after flushing: gloo's threads cannot abort the
    rank during interpreter shutdown, buffered output still arrives, the exit code is kept. Elsewhere: a normal exit."""
    import os

    script = ("import atexit, torch.distributed; from opdcache.cli.main import _exit; "
              "atexit.register(lambda: print('shutdown ran')); print('buffered line'); _exit(3)")
    env = {**os.environ, "WORLD_SIZE": world}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == (["buffered line", "shutdown ran"] if shutdown else ["buffered line"])


def test_checks_made_from_arguments_and_configs_come_before_any_model_loads(tmp_path, weights, opd_prompts, monkeypatch):
    """A missing --model, a w4a16 group that the model's config says cannot divide its layers, and a math
    verifier whose package is missing are refused before torch is imported or any model loads (one line, exit 2)."""
    import importlib.util
    import subprocess
    import sys
    import time

    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "opdcache.cli.main", "train"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--model is required" in p.stderr
    assert time.monotonic() - start < 20  # the process's own start-up; without torch this is well under a second quiet
    p = subprocess.run([sys.executable, "-c", "import sys; from opdcache.cli.main import main\n"
                        "try:\n main(['train'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip().endswith("False"), p.stdout + p.stderr

    from opdcache.errors import ConfigError
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.backends import EngineConfig
    from opdcache.teacher.rollouts import GenerateJob

    with pytest.raises(ConfigError, match="does not divide the model's hidden_size .* of 64; pick one that does"):
        GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts), out=tmp_path / "c", engine=EngineConfig(quantize="w4a16"))
    GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts), out=tmp_path / "c", engine=EngineConfig(quantize="w4a16:g32"))

    from opdcache.inputs import verifiers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    assert callable(verifiers.resolve("opdcache.demo.task:verify_addition"))  # module:function still imports (no shadowed name)
    with pytest.raises(ConfigError, match="--reward math needs the math-verify package"):
        verifiers.resolve("math")


def test_omp_num_threads_is_honoured(monkeypatch):
    from opdcache.threads import ENV, pick

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert pick() == (1, "OMP_NUM_THREADS")
    monkeypatch.setenv(ENV, "2")
    assert pick() == (2, ENV)
    assert pick(3) == (3, "--threads")


def test_an_option_missing_its_value_points_to_the_commands_help(capsys):
    from opdcache.cli.main import main

    for argv, command in ((["train", "--model"], "opdcache train"), (["--threads", "2", "audit", "--rows"], "opdcache audit")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"see `{command} --help`" in err and "requires an argument" in err


def test_score_teacher_says_when_the_svd_distortion_is_in_sample(tmp_path, weights, opd_prompts, capsys):
    """On a cache so small that the svd fit takes every row, the distortion printed is in-sample, and says so."""
    from opdcache.cli.main import main

    out = tmp_path / "c"
    for args in (["build-rollouts", "--model", weights / "student", "--prompts", opd_prompts, "--out", out, "--num-shards", 1,
                  "--samples", 1, "--max-new-tokens", 8, "--limit", 3, "--sft-teacher", weights / "teacher"],
                 ["score-teacher", out, "--teacher", weights / "teacher", "--store", "logprob,svd", "--svd-rank", 4,
                  "--svd-min-positions", 1]):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        assert e.value.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())
    assert "positions of the calibration rows (no other rows left: in-sample)" in text, text[-1500:]


def test_missing_local_paths_are_said_before_any_hub_lookup(tmp_path):
    """A missing --prompts is refused before the model (here a Hub id, which would be a network lookup) is resolved,
    and a path shaped like org/name whose first part is a folder here is a mistyped local path, never a Hub id."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([OPDCACHE, "build-rollouts", "--model", "someorg/somemodel", "--prompts", str(tmp_path / "nope.jsonl"),
                           "--out", str(tmp_path / "c")], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"error: prompt file {tmp_path / 'nope.jsonl'} does not exist; check --prompts"]
    (tmp_path / "models").mkdir()
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1"}\n')
    proc = subprocess.run([OPDCACHE, "build-rollouts", "--model", "models/pi_ref", "--prompts", "p.jsonl", "--out", "c"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == ("error: --model models/pi_ref: no such directory (models/ exists here, so this is read as a local path, "
                        "not a Hub id); check the path")
    assert not (tmp_path / "c").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusals on a machine without a GPU")
def test_a_device_this_machine_lacks_is_one_line_before_any_model_loads(tmp_path, weights, opd_prompts, capsys, monkeypatch):
    """--device nonsense and --device cuda without a GPU: one line and exit 2 from the generating, auditing and async
    commands, before any model loads or stage starts."""
    import transformers

    from opdcache.cli.main import main

    loads = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    cache = tmp_path / "c"
    for device, words in (("nonsense", "--device must be auto, cpu, cuda or cuda:N, got 'nonsense'"),
                          ("cuda:1", "--device cuda:1: no CUDA GPU is visible to this torch")):
        for args in (["build-rollouts", "--model", weights / "student", "--prompts", opd_prompts, "--out", cache, "--device", device],
                     ["audit", tmp_path, "--device", device],
                     ["async", "--model", weights / "student", "--teacher", weights / "teacher", "--prompts", opd_prompts,
                      "--out", tmp_path / "run", "--device", device]):  # before any stage starts
            with pytest.raises(SystemExit) as e:
                main([str(a) for a in args])
            out = capsys.readouterr()
            lines = (out.out + out.err).strip().splitlines()
            assert e.value.code == 2 and len(lines) == 1 and words in lines[0], (args, lines)
    assert loads == [] and not cache.exists() and not (tmp_path / "run").exists()


def _one_line(args, tmp_path, env=None):
    proc = subprocess.run([OPDCACHE, *args], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, **(env or {})})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and not proc.stdout.strip(), (proc.returncode, proc.stdout, proc.stderr)
    return lines[0]


def test_train_mistakes_are_one_line_naming_them_and_print_nothing_else(tmp_path, hf_cache, weights):
    """A --config that is missing, not YAML, holds a key twice or is not a mapping; an --out that is a file (before
    the model loads); a refused run prints no `teacher consistency:` line before its error."""
    base = ["train", "--model", str(weights / "student"), "--cache", str(hf_cache), "--teacher", "teacher"]
    line = _one_line([*base, "--out", "run", "--config", "nope.yaml"], tmp_path)
    assert line == "error: --config nope.yaml: no such file; give a YAML file of TrainConfig fields"
    (tmp_path / "bad.yaml").write_text("steps: 3\nlr: [1,\n")
    assert _one_line([*base, "--out", "run", "--config", "bad.yaml"], tmp_path).startswith("error: --config bad.yaml, line 3:")
    (tmp_path / "twice.yaml").write_text("steps: 3\nlr: 1e-5\nsteps: 4\n")
    assert _one_line([*base, "--out", "run", "--config", "twice.yaml"], tmp_path) == (
        "error: --config twice.yaml, line 3: 'steps' is given twice (first on line 1); keep one")
    (tmp_path / "list.yaml").write_text("- steps\n")
    assert "must hold a mapping of TrainConfig fields" in _one_line([*base, "--out", "run", "--config", "list.yaml"], tmp_path)
    (tmp_path / "afile").write_text("x")
    assert _one_line([*base, "--out", "afile", "--steps", "1"], tmp_path) == (
        "error: --out afile is a file, not a folder: give the folder that holds (or will hold) the run's checkpoint/, "
        "model/ and metrics.jsonl")
    other = ["train", "--model", str(weights / "teacher_pairs"), *base[3:]]  # refused by the trainer's checks of the cache
    line = _one_line([*other, "--out", "run", "--steps", "1"], tmp_path)
    assert "is not the model that sampled the cache's rollouts" in line and "teacher consistency" not in line


def test_a_hub_shaped_path_that_is_nowhere_says_both(tmp_path):
    """models/pi_ref with no models/ folder here: not on disk, and the Hub (a local endpoint that refuses, so no
    network is used) cannot give it either: the error says both."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1"}\n')
    line = _one_line(["build-rollouts", "--model", "models/pi_ref", "--prompts", "p.jsonl", "--out", "c"], tmp_path,
                     env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "2",
                          "HF_HUB_DOWNLOAD_TIMEOUT": "2", "HF_HOME": str(tmp_path / "hf")})
    assert line.startswith("error: --model models/pi_ref: no local folder of that name here, and the Hub could not give "
                           "models/pi_ref (") and line.endswith("check the path, or the network and the repo id"), line
    assert not (tmp_path / "c").exists()


def test_tensorboard_without_its_package_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import importlib.util

    from opdcache.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", str(tmp_path / "not-loaded"), "--cache", str(tmp_path / "no-cache"), "--out",
              str(tmp_path / "run"), "--tensorboard"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == ["error: --tensorboard needs the tensorboard package: pip install tensorboard "
                                             "(metrics.jsonl is written either way)"], err


@pytest.mark.parametrize("tracker", ["wandb", "trackio", "mlflow", "tensorboard"])
def test_a_tracker_without_its_library_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, tracker):
    import importlib.util

    from opdcache.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", str(tmp_path / "not-loaded"), "--cache", str(tmp_path / "no-cache"), "--out",
              str(tmp_path / "run"), "--report-to", f"jsonl,{tracker}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [f"error: --report-to {tracker} needs the {tracker} package: pip install {tracker} "
                                             "(metrics.jsonl is written either way)"], err
    assert not (tmp_path / "run").exists()


def test_an_unknown_tracker_is_one_line(tmp_path, capsys):
    from opdcache.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", str(tmp_path / "m"), "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "run"),
              "--report-to", "wandb,comet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == ["error: --report-to names no tracker 'comet'; it takes jsonl, tensorboard, wandb, "
                                             "trackio, mlflow"], err


def test_served_engine_mistakes_are_one_line_before_any_model_loads(tmp_path, hf_cache, weights):
    """No server is needed to refuse these: a missing or malformed --server-url, one without --backend server, and a
    port nothing listens on (said before anything is written)."""
    from served_proxy import free_port

    base = ["score-teacher", str(hf_cache), "--teacher", str(weights / "teacher"), "--name", "served"]
    assert _one_line([*base, "--backend", "server"], tmp_path) == (
        "error: --backend server needs --server-url http://host:port (replicas comma-separated)")
    assert _one_line([*base, "--backend", "server", "--server-url", "127.0.0.1:8000"], tmp_path) == (
        "error: --server-url takes http(s)://host:port URLs, comma-separated; got '127.0.0.1:8000'")
    assert _one_line([*base, "--server-url", "http://127.0.0.1:8000"], tmp_path) == (
        "error: --server-url names running servers, which --backend transformers does not use: add --backend server")
    port = free_port()
    line = _one_line([*base, "--backend", "server", "--server-url", f"http://user:pw@127.0.0.1:{port}/v1"], tmp_path)
    assert line.startswith(f"error: --server-url http://127.0.0.1:{port}: /get_model_info did not answer (") and "pw" not in line
    assert line.endswith("start the server, or check the URL and port"), line
    assert not (hf_cache / "teachers" / "served").exists()


def test_an_unknown_executor_is_one_line_for_every_sharded_stage(weights, tmp_path, capsys):
    from cli_helpers import cli, one_line

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1 + 1 ="}\n')
    code, out = cli(["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", tmp_path / "c",
                     "--executor", "slurm", "--no-progress"], capsys)
    assert code == 2 and "--executor must be one of local, ray, got 'slurm'" in one_line(out)
    assert not (tmp_path / "c").exists()

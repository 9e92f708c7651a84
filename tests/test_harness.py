"""benchmarks/harness.py: sides interleaved with the order alternating per round, one process per run, ratios pair by
pair against the baseline, peak anonymous memory of the work (asserted on what the work allocates, not on time)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

MODULE = '''
import os
import time

def setup(n):
    return {"n": n, "pid": os.getpid()}

def work(state):
    block = bytearray(state["n"] << 20)  # anonymous memory the work allocates
    block[::4096] = b"x" * len(block[::4096])
    time.sleep(0.3)  # held while the sampler (a thread, every millisecond: it needs the GIL) looks
    return {"pid": os.getpid(), "n": state["n"]}
'''


def test_interleaved_rounds_in_their_own_processes_with_pairwise_ratios(tmp_path, capsys):
    from harness import Side, compare, report

    module = tmp_path / "toy_bench.py"
    module.write_text(MODULE)
    sides = [Side("small", "work", "setup", {"n": 8}), Side("big", "work", "setup", {"n": 64}, baseline=True, note="the baseline")]
    result = compare("toy", sides, str(module), rounds=3, warmup=1)
    order = [line.split(": ", 1)[1].split(" ")[0] for line in capsys.readouterr().err.splitlines() if line.startswith("  ")]
    assert order == ["small", "big", "big", "small", "small", "big", "big", "small"]  # warm-up, then A B / B A alternating
    small, big = result["sides"]["small"], result["sides"]["big"]
    pids = [r["figures"]["pid"] for r in small["runs"] + big["runs"]]
    assert len(set(pids)) == 6  # every run its own process
    walls = [a["wall"] / b["wall"] for a, b in zip(small["runs"], big["runs"])]
    assert small["wall_ratio"]["median"] == pytest.approx(sorted(walls)[1]) and "wall_ratio" not in big
    assert big["peak_anon_mib_median"] >= 60 and small["peak_anon_mib_median"] < 30  # the work's own allocation
    assert small["memory_ratio"] < 0.5
    text = report(result, tmp_path / "out.json")
    assert "big: the baseline" in text and (tmp_path / "out.json").is_file()


def test_exactly_one_baseline():
    from harness import Side, compare

    with pytest.raises(ValueError, match="exactly one side is the baseline"):
        compare("x", [Side("a", "f"), Side("b", "f")], __file__)

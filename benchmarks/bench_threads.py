"""The demo's train stage on a machine kept busy by two other processes: torch's own thread defaults against opdcache's
choice, on the harness.

Each run is ``opdcache train`` (the demo's Lightning settings, --steps N on the demo work directory's cache) in its
own process. Sides:

* **torch defaults** (the baseline: what runs when nobody chooses): one thread per core and ``OMP_WAIT_POLICY`` left
  to the OpenMP runtime (GNU's default spins a while before sleeping; not forced to ACTIVE, which is harsher);
* **opdcache's choice**: waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE``), threads from the CPUs this process
  may use (opdcache/threads.py).

The load is two Python processes spinning on the CPU for the whole comparison. A third comparison runs opdcache's
choice on the quiet machine, for the ratio loaded / quiet (the goal: within 2x). benchmarks/harness.py
interleaves the loaded sides over rounds (each run a fresh process; wall and CPU seconds, the trainer's included).
The final losses are printed too: the thread policy must not change them beyond float rounding.

    python benchmarks/bench_threads.py --workdir opdcache-demo [--steps 20 --rounds 3]    (run `opdcache demo` there first)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def setup(workdir: str, steps: int, out: str, policy: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPDCACHE_THREADS", "OMP_NUM_THREADS")}
    # torch's defaults: as many threads as cores, the OpenMP runtime's own wait policy. The CLI sets PASSIVE unless the
    # variable is set; an empty value keeps it from doing so, and libgomp ignores it (saying so on stderr) and keeps its default

    env = base if policy == "opdcache" else {**base, "OPDCACHE_THREADS": str(os.cpu_count()), "OMP_WAIT_POLICY": ""}
    return {"workdir": Path(workdir), "steps": steps, "out": Path(out), "env": env}


def run(st: dict) -> dict:
    """One ``opdcache train`` run; its final loss."""
    out, w = st["out"], st["workdir"]
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "opdcache.cli.main", "train", "--model", str(w / "models" / "pi_ref"), "--cache",
           str(w / "caches" / "rollouts"), "--loss", "lightning", "--tau", "1", "--kl-coef", "1", "--steps", str(st["steps"]),
           "--batch-size", "64", "--lr", "3e-5", "--out", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, env=st["env"], capture_output=True)
    loss = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    shutil.rmtree(out, ignore_errors=True)
    return {"loss": loss}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import Side, compare, report

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("opdcache-demo"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-threads"))
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "threads.json")
    args = ap.parse_args()
    common = {"workdir": str(args.workdir.resolve()), "steps": args.steps, "out": str(args.out)}
    sides = [Side("opdcache's choice, loaded", "run", "setup", common | {"policy": "opdcache"},
                  note="OMP_WAIT_POLICY=PASSIVE, threads from the usable CPUs"),
             Side("torch defaults, loaded", "run", "setup", common | {"policy": "torch"}, baseline=True,
                  note="one thread per core, the OpenMP runtime's own wait policy")]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(1.0)  # let the scheduler see them
        loaded = compare(f"train {args.steps} steps x 64 sequences beside 2 spinning processes", sides, __file__, rounds=args.rounds,
                         meta={"command": "python benchmarks/bench_threads.py"})
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    report(loaded)
    quiet = compare(f"train {args.steps} steps x 64 sequences, quiet", [Side("opdcache's choice, quiet", "run", "setup",
                    common | {"policy": "opdcache"}, baseline=True)], __file__, rounds=args.rounds)
    report(quiet)
    q = quiet["sides"]["opdcache's choice, quiet"]["wall_median"]
    print("\nloaded / quiet (wall medians): " + ", ".join(f"{n} {e['wall_median'] / q:.2f}x" for n, e in loaded["sides"].items()))
    print("final losses: " + ", ".join(f"{n} {e['runs'][0]['figures']['loss']:.6f}" for n, e in (loaded["sides"] | quiet["sides"]).items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"loaded": loaded, "quiet": quiet}, indent=2) + "\n")


if __name__ == "__main__":
    main()

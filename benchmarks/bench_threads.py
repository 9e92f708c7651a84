"""The demo's train stage on a quiet machine and on one kept busy by two other processes, in one run (issue 22).

Three timings of the same `opdcache train` (the demo's Lightning settings, --steps N on the demo work directory's
cache): quiet; loaded with torch's defaults (OpenMP threads spin while they wait: ``OMP_WAIT_POLICY`` left to the
runtime, one thread per core); loaded with opdcache's choice (waiting threads sleep, threads from the CPUs this
process may use; opdcache/threads.py). The load is two Python processes spinning on the CPU, started before and
stopped after each loaded timing. Prints the seconds and the ratio loaded / quiet of each; the goal is opdcache's
choice within 2x of quiet. The losses of the three runs are printed too: the thread policy must not change them
beyond float rounding.

    python benchmarks/bench_threads.py --workdir opdcache-demo [--steps 20]    (run `opdcache demo` there first)
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


def train(workdir: Path, steps: int, out: Path, env: dict) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "opdcache.cli.main", "train", "--model", str(workdir / "models" / "pi_ref"), "--cache",
           str(workdir / "caches" / "rollouts"), "--loss", "lightning", "--tau", "1", "--kl-coef", "1", "--steps", str(steps),
           "--batch-size", "64", "--lr", "3e-5", "--out", str(out), "--no-progress"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    seconds = time.perf_counter() - start
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return seconds, last["loss"]


def loaded(fn):
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(1.0)  # let the scheduler see them
        return fn()
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("opdcache-demo"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-threads"))
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPDCACHE_THREADS", "OMP_NUM_THREADS")}
    torch_default = {**base, "OMP_WAIT_POLICY": "ACTIVE", "OPDCACHE_THREADS": str(os.cpu_count())}  # what torch does alone
    quiet = train(args.workdir, args.steps, args.out / "quiet", base)
    busy_default = loaded(lambda: train(args.workdir, args.steps, args.out / "default", torch_default))
    busy_ours = loaded(lambda: train(args.workdir, args.steps, args.out / "ours", base))
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; train {args.steps} steps x 64 sequences")
    print(f"{'run':<44} {'seconds':>8} {'vs quiet':>9} {'final loss':>12}")
    for name, (s, loss) in (("quiet, opdcache's choice", quiet), ("2 busy processes, torch defaults (spinning)", busy_default),
                            ("2 busy processes, opdcache's choice", busy_ours)):
        print(f"{name:<44} {s:>8.1f} {s / quiet[0]:>8.2f}x {loss:>12.6f}")


if __name__ == "__main__":
    main()

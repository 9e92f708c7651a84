"""How a comparison is measured here: sides interleaved over rounds, each run in its own process.

A benchmark declares its sides (opdcache, and the code a competent user would write for the same work, said in one
line), each a function ``name(state)`` in the benchmark's module with an optional ``setup`` function whose cost is
not timed (loading a model, building data). Then :func:`compare` runs, after ``warmup`` untimed rounds, ``rounds``
rounds of A B A B ... (the order alternating between rounds), each run a fresh ``python`` process so that one side's
allocator, caches and threads never carry into the other's. Per run it records:

* wall seconds and CPU seconds (user + system of every thread and of every child process the work waited for,
  ``resource.getrusage``) of the work alone;
* peak anonymous RSS above the process's own level just before the work (``RssAnon`` from /proc, sampled every
  millisecond: memory the work allocated, not the page cache of a model file that ``ru_maxrss`` would count; the
  process's own: a child process's memory is not in it);
* the machine's one-minute load average before and after.

Per side: min and median of wall and CPU seconds and the median peak; per round the ratio of each side to the
baseline (wall and CPU), with their min, median and max, so a comparison holds when the machine's speed drifts
between rounds. :func:`report` prints the table and writes the JSON beside it. Memory is reported only where /proc
exists (Linux).

    from harness import Side, compare, report
    result = compare("scoring", [Side("opdcache", "run_opdcache", setup="setup", args={...}),
                                 Side("batched forward", "run_batched", setup="setup", baseline=True, note="...")],
                     module=__file__, rounds=3)
    report(result, "results/scoring.json")
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Side:
    name: str
    run: str
    """Function of the benchmark module doing the work once: ``run(state)``; it may return a dict of figures."""
    setup: str | None = None
    """Function building the untimed state: ``setup(**args)``."""
    args: dict = field(default_factory=dict)
    baseline: bool = False
    note: str = ""
    """One line: what this side is (for a baseline: the code a competent user would write, and why)."""


def anon_kib(pid: int | str = "self") -> int:
    """A process's anonymous RSS in KiB (``RssAnon`` of /proc/PID/status); 0 where /proc has none (not Linux, or gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakAnon:
    """Peak anonymous RSS (KiB) while the block runs, sampled every millisecond by a thread; ``delta`` is the peak above
    the level at entry, in bytes. The sampler needs the GIL: work that holds it in one long C call is sampled around it."""

    def __enter__(self):
        self.base = self.peak = anon_kib()
        self._stop = False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, anon_kib())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, anon_kib())

    @property
    def delta(self) -> int:
        return (self.peak - self.base) * 1024


def cpu_seconds() -> float:
    """User + system seconds of this process's threads and of the child processes it has waited for (a side that
    starts workers, as ``opdcache async`` does, is charged for them)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def _child(spec: dict) -> dict:
    """One run in this process: setup (untimed), then the work, timed and sampled."""
    path = Path(spec["module"])
    sys.path.insert(0, str(path.parent))
    loaded = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    state = getattr(module, spec["setup"])(**spec["args"]) if spec["setup"] else spec["args"]
    with PeakAnon() as mem:
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        figures = getattr(module, spec["run"])(state) or {}
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return {"wall": wall, "cpu": cpu, "peak_anon_mib": (mem.peak - mem.base) / 1024, "figures": figures}


def _run(module: str, side: Side) -> dict:
    spec = {"module": module, "run": side.run, "setup": side.setup, "args": side.args}
    load0 = os.getloadavg()[0]
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    load1 = os.getloadavg()[0]
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"wall"')]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{side.name}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1]) | {"load_before": load0, "load_after": load1}


def compare(title: str, sides: list[Side], module: str, rounds: int = 3, warmup: int = 1, meta: dict | None = None) -> dict:
    """Run the sides interleaved (A B ... in round 1, reversed in round 2, ...) after ``warmup`` untimed rounds."""
    if sum(s.baseline for s in sides) != 1:
        raise ValueError("exactly one side is the baseline")
    runs: dict[str, list[dict]] = {s.name: [] for s in sides}
    for r in range(warmup + rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            result = _run(str(Path(module).resolve()), side)
            if r >= warmup:
                runs[side.name].append(result)
            print(f"  {'warm-up' if r < warmup else f'round {r - warmup + 1}'}: {side.name} {result['wall']:.2f} s wall, "
                  f"{result['cpu']:.2f} s CPU, peak +{result['peak_anon_mib']:.0f} MiB (load {result['load_before']:.1f})",
                  file=sys.stderr, flush=True)
    base = next(s for s in sides if s.baseline)
    out = {"title": title, "rounds": rounds, "warmup": warmup, "cpus": os.cpu_count(), "meta": meta or {},
           "sides": {}, "date": time.strftime("%Y-%m-%d %H:%M")}
    for s in sides:
        rs = runs[s.name]
        entry = {"note": s.note, "baseline": s.baseline, "args": s.args,
                 "wall_min": min(x["wall"] for x in rs), "wall_median": statistics.median(x["wall"] for x in rs),
                 "cpu_min": min(x["cpu"] for x in rs), "cpu_median": statistics.median(x["cpu"] for x in rs),
                 "peak_anon_mib_median": statistics.median(x["peak_anon_mib"] for x in rs),
                 "load": [min(x["load_before"] for x in rs), max(x["load_after"] for x in rs)], "runs": rs}
        if not s.baseline:
            for what in ("wall", "cpu"):
                ratios = [a[what] / b[what] for a, b in zip(rs, runs[base.name])]
                entry[f"{what}_ratio"] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
            entry["memory_ratio"] = entry["peak_anon_mib_median"] / max(statistics.median(x["peak_anon_mib"] for x in runs[base.name]), 1e-9)
        out["sides"][s.name] = entry
    return out


def report(result: dict, json_path: str | Path | None = None) -> str:
    """The table (ratios are side / baseline, pair by pair over the rounds: below 1 is faster or smaller)."""
    w = max([34] + [len(name) for name in result["sides"]])  # a side's whole name, never cut
    lines = [f"{result['title']}: {result['rounds']} interleaved rounds after {result['warmup']} warm-up, {result['cpus']} CPUs, "
             f"load {min(e['load'][0] for e in result['sides'].values()):.1f}-{max(e['load'][1] for e in result['sides'].values()):.1f}",
             f"{'side':<{w}} {'wall min':>9} {'median':>8} {'CPU min':>8} {'median':>8} {'peak MiB':>9} "
             f"{'wall/base (min-max)':>22} {'CPU/base':>9} {'mem/base':>9}"]
    lines.append("-" * len(lines[-1]))
    for name, e in result["sides"].items():
        ratio = "" if e["baseline"] else (f"{e['wall_ratio']['median']:.2f} ({e['wall_ratio']['min']:.2f}-{e['wall_ratio']['max']:.2f})")
        lines.append(f"{name:<{w}} {e['wall_min']:>9.2f} {e['wall_median']:>8.2f} {e['cpu_min']:>8.2f} {e['cpu_median']:>8.2f} "
                     f"{e['peak_anon_mib_median']:>9.0f} {ratio:>22} "
                     f"{'' if e['baseline'] else format(e['cpu_ratio']['median'], '.2f'):>9} "
                     f"{'' if e['baseline'] else format(e['memory_ratio'], '.2f'):>9}")
    for name, e in result["sides"].items():
        if e["note"]:
            lines.append(f"  {name}: {e['note']}")
    text = "\n".join(lines)
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return text


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(json.dumps(_child(json.loads(sys.argv[2]))))

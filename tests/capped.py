"""The capped probe child of the hostile suites: the installed CLI's main run in a child whose address space is capped
(RLIMIT_AS, MEMORY_BOUND), one child for all the probes (tests/cliserver.py: it imports torch once); each probe's peak
resident memory is checked to stay within RSS_ABOVE_BASELINE of that child's before any probe."""

import atexit
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
from pathlib import Path

MEMORY_BOUND = 3 << 30  # address space: the CLI with torch loaded reserves ~1 GiB; the bombs needed 2.4-4.3 GB more
RSS_ABOVE_BASELINE = 1 << 30
SERVER = Path(__file__).parent / "cliserver.py"
"""Each probe's peak resident memory may exceed a bare process's that has imported the CLI, torch and pyarrow by at most
this. The address-space cap above is the backstop that stops a runaway; it cannot be this tight, since honest runs
reserve address space they never touch (thread stacks, allocator arenas: std::bad_alloc at ~1.9 GiB of it)."""


class _Probes:
    """The child that runs every probe (tests/cliserver.py): started on first use, again if it died or if its address
    space grew within 1 GiB of the cap (so that a probe always has the headroom a fresh child had); a child of its own
    for every probe where the kernel cannot reset a process's peak memory (or OPDCACHE_TEST_CHILD_PER_PROBE is set)."""

    def __init__(self) -> None:
        self.proc = None
        self.baseline = None

    def start(self) -> None:
        r_req, w_req = os.pipe()
        r_ans, w_ans = os.pipe()
        self.log = tempfile.TemporaryFile("w+")  # the child's own output outside probes, shown if it fails to start

        def cap():
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BOUND, MEMORY_BOUND))

        self.proc = subprocess.Popen([sys.executable, str(SERVER), str(r_req), str(w_ans)], pass_fds=(r_req, w_ans), preexec_fn=cap,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        os.close(r_req)
        os.close(w_ans)
        self.requests, self.answers = os.fdopen(w_req, "w"), os.fdopen(r_ans, "r")
        hello = self._answer(300)
        assert hello is not None, self._log()
        if self.baseline is None:
            self.baseline = hello["baseline"]
        self.resettable = hello["resettable"] and not os.environ.get("OPDCACHE_TEST_CHILD_PER_PROBE")

    def _log(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def _answer(self, timeout: int):
        ready, _, _ = select.select([self.answers], [], [], timeout)
        line = self.answers.readline() if ready else ""
        return json.loads(line) if line else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.requests.close()
            self.answers.close()
            self.log.close()
            self.proc = None

    def run(self, args: list[str], env: dict, timeout: int) -> tuple[int, str, int]:
        """(exit code, output, peak RSS in bytes) of one probe; a probe that hangs past ``timeout`` is killed (-9)."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start()
        with tempfile.NamedTemporaryFile("r", suffix=".out") as out:
            self.requests.write(json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "out": out.name}) + "\n")
            self.requests.flush()
            answer = self._answer(timeout)
            text = out.read()
        if answer is None:  # killed by the clock, or the child died (a crash the probe caused)
            died = self.proc.poll()
            self.stop()
            return (-9 if died is None else died), text, 0
        if answer["vm"] > MEMORY_BOUND - (1 << 30) or not self.resettable:  # no reset: the next probe needs a fresh child
            self.stop()
        return answer["code"], text, answer["peak"]


_PROBES = _Probes()
atexit.register(_PROBES.stop)


def baseline_rss() -> int:
    """Resident memory of the probe child once it has imported the CLI, torch and pyarrow, before any probe."""
    if _PROBES.baseline is None:
        _PROBES.start()
    return _PROBES.baseline


def run(args, timeout: int = 300):
    """The installed CLI's main on ``args`` in the probe child: (exit code, output), after checking the probe's peak RSS
    stayed within RSS_ABOVE_BASELINE."""
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    code, out, rss = _PROBES.run(list(map(str, args)), env, timeout)
    if os.environ.get("OPDCACHE_TEST_RSS_LOG"):  # each probe's peak above the baseline, for the record
        with open(os.environ["OPDCACHE_TEST_RSS_LOG"], "a") as log:
            log.write(f"{(rss - baseline_rss()) / 2**20:.0f} MiB above baseline: {' '.join(map(str, args[:1]))} -> {code}\n")
    assert rss <= baseline_rss() + RSS_ABOVE_BASELINE, (f"peak RSS {rss / 2**20:.0f} MiB, baseline {baseline_rss() / 2**20:.0f} MiB",
                                                        args[:2], out[-1500:])
    return code, out

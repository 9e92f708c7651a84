"""Stage functions for the Ray tests (importable by Ray workers through PYTHONPATH)."""

import os
from pathlib import Path


def crash_once_after_two_shards(job):
    """run_generate, but the first attempt kills its own process after writing two shards (as a lost node would)."""
    from opdcache.format import cache as C
    from opdcache.teacher.rollouts import run_generate

    marker = Path(job.out).parent / "crashed"  # beside the cache: the retry (a new process) sees the first attempt died
    if not marker.exists():
        original = C.TableJob.write_table
        count = {"n": 0}

        def write_then_die(self, index, table):  # in the writer thread: os._exit ends the whole process
            info = original(self, index, table)
            count["n"] += 1
            if count["n"] == 2:
                marker.write_text("crashed")
                os._exit(1)
            return info
        C.TableJob.write_table = write_then_die
    return run_generate(job)

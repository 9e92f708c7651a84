"""Running the CLI's main in the test process, and the one-line refusal every bad input must get."""

import pytest

from opdcache.cli.main import main


def cli(args, capsys) -> tuple[int, str]:
    """(exit code, stdout and stderr together) of ``opdcache ARGS``."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def one_line(out: str) -> str:
    """The only error line of ``out``, which holds no traceback."""
    lines = [l for l in out.strip().splitlines() if l.startswith("error")]
    assert "Traceback" not in out and len(lines) == 1, out
    return lines[0]

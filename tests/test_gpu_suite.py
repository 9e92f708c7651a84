"""The GPU suite's parts that run before and around the device: its import gate finds a missing package in a second,
and its qwen3 model's prompts are words of its vocabulary, not special or unknown tokens. On the CPU."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "benchmarks"


def _preflight(prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}import runpy, sys; sys.argv = ['preflight']; runpy.run_path({str(BENCH / 'preflight.py')!r}, run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_import_gate_passes_here_and_names_each_module_a_missing_package_stops():
    ok = _preflight()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "preflight: 0 modules do not import" in ok.stdout
    hidden = _preflight("import sys; sys.modules['jsonschema'] = None\n")
    assert hidden.returncode == 2, hidden.stdout + hidden.stderr
    assert "cannot import opdcache.format.manifest: needs jsonschema" in hidden.stderr


def test_the_qwen3_prompts_are_words_of_its_vocabulary(tmp_path):
    """Named t0/t1/t2, the special tokens matched inside the prompt words (t13 -> t1 + 3): 37.5% of the ids were
    unknown or end-of-sequence. Every prompt of every section tokenizes to ordinary words only."""
    sys.path.insert(0, str(BENCH))
    import bench_gpu
    from transformers import AutoTokenizer

    bench_gpu.build_qwen3(tmp_path / "q", 1024, 64, 1, "cpu")
    tok = AutoTokenizer.from_pretrained(tmp_path / "q")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    path = bench_gpu._word_prompts(tmp_path / "p.jsonl", 40, 17)
    ids = [i for line in path.read_text().splitlines() for i in tok(json.loads(line)["prompt"])["input_ids"]]
    assert len(ids) == 40 * 16 and min(ids) >= len(bench_gpu.SPECIAL) and max(ids) < 1024

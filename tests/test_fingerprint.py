"""Fingerprints are stable across processes and move with every meaningful change."""

import json
import subprocess
import sys

import pytest
from safetensors.torch import save_file
import torch

from opdcache.demo import models
from opdcache.errors import ConfigError
from opdcache.inputs.fingerprint import config_fingerprint, model_fingerprint, row_id, tokenizer_fingerprint


def _model_dir(tmp_path, name="m", value=1.0):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 4, "_name_or_path": str(d), "transformers_version": "x"}))
    save_file({"w": torch.full((2, 2), value)}, str(d / "model.safetensors"))
    return d


def test_config_fingerprint_ignores_key_order_but_not_values_or_parent():
    a = config_fingerprint({"x": 1, "y": {"b": 2, "a": 1}})
    assert a == config_fingerprint({"y": {"a": 1, "b": 2}, "x": 1})
    assert a != config_fingerprint({"x": 2, "y": {"b": 2, "a": 1}})
    assert a != config_fingerprint({"x": 1, "y": {"b": 2, "a": 1}}, parent="0" * 64)


def test_fingerprints_are_stable_across_processes(tmp_path):
    d = _model_dir(tmp_path)
    tok_dir = tmp_path / "tok"
    models.build_tokenizer().save_pretrained(tok_dir)
    code = (
        "import sys; from transformers import AutoTokenizer;"
        "from opdcache.inputs.fingerprint import model_fingerprint, tokenizer_fingerprint, config_fingerprint, row_id;"
        f"print(model_fingerprint({str(d)!r}), tokenizer_fingerprint(AutoTokenizer.from_pretrained({str(tok_dir)!r})),"
        "config_fingerprint({'t': 0.8, 'k': [1, 2]}), row_id([1, 2, 3], 4))"
    )
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (1, 2)}
    assert len(runs) == 1
    from transformers import AutoTokenizer

    here = f"{model_fingerprint(d)} {tokenizer_fingerprint(AutoTokenizer.from_pretrained(tok_dir))} " \
           f"{config_fingerprint({'t': 0.8, 'k': [1, 2]})} {row_id([1, 2, 3], 4)}\n"
    assert runs == {here}


def test_model_fingerprint_moves_with_weights_and_config_not_with_save_path(tmp_path):
    a = model_fingerprint(_model_dir(tmp_path, "a"))
    assert a == model_fingerprint(_model_dir(tmp_path, "a_copy"))  # _name_or_path differs: ignored
    assert a != model_fingerprint(_model_dir(tmp_path, "b", value=1.0001))
    c = _model_dir(tmp_path, "c")
    (c / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert a != model_fingerprint(c)


def test_model_fingerprint_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no weight files"):
        model_fingerprint(tmp_path)


def test_tokenizer_fingerprint_moves_with_vocab_specials_and_template():
    base = tokenizer_fingerprint(models.build_tokenizer())
    assert base == tokenizer_fingerprint(models.build_tokenizer())
    assert base != tokenizer_fingerprint(models.build_tokenizer(chat_template=models.CHAT_TEMPLATE + " "))
    tok = models.build_tokenizer()
    tok.add_tokens(["<new>"])
    assert base != tokenizer_fingerprint(tok)
    tok = models.build_tokenizer()
    tok.eos_token = models.PAD
    assert base != tokenizer_fingerprint(tok)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_sha256_of_a_file_equals_hashlib_over_its_bytes_at_every_block_boundary(tmp_path, size):
    import contextlib
    import hashlib
    import io
    import types

    from opdcache.storage import sha256_of

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert sha256_of(path, block=4096) == want  # the reused buffer, refilled across blocks and a short last read
    assert sha256_of(path) == want

    class NoReadinto:  # a path whose file object has read but no readinto: one bytes object a read
        def open(self, mode):
            return contextlib.nullcontext(types.SimpleNamespace(read=io.BytesIO(data).read))

    assert sha256_of(NoReadinto(), block=4096) == want

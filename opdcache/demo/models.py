"""Tiny local models and tokenizer for the embedded task, in the real Hugging Face format.

Everything here is saved with ``save_pretrained`` and loaded back with ``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained(path)``, so the demo and the tests run the same loading code as
real checkpoints, and vLLM on CPU can serve them (its CPU attention needs head sizes of at least 32).

* tokenizer: one token per character of the task's alphabet, plus chat special tokens and a chat template;
* teacher:   Qwen3 architecture, hidden 128, 3 layers, 2 heads of 64;
* student:   Llama architecture, hidden 64, 2 layers, 2 heads of 32 (clearly smaller).

Both architectures are exercised so nothing silently depends on one.
"""

from __future__ import annotations

from pathlib import Path

PAD, EOS, UNK = "<|pad|>", "<|eos|>", "<unk>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
SPECIALS = [PAD, EOS, UNK, USER, ASSISTANT]
CHARS = list("0123456789+-*=;:c ,.()abdefghijklmnopqrstuvwxyz")
VOCAB_SIZE = 64  # padded with reserved tokens so the embedding is a round size
PAIR_VOCAB_SIZE = 160  # the digit-pair tokenizer's: the alphabet and specials, 100 pairs, reserved tokens

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def build_tokenizer(chat_template: str = CHAT_TEMPLATE, digit_pairs: bool = False):
    """A character-level WordLevel tokenizer wrapped as a ``PreTrainedTokenizerFast``.

    ``digit_pairs``: a different tokenizer over the same alphabet, for a cross-tokenizer teacher: each pair of digits
    (``"12"``, read from the left) is one token, so its ids and its token boundaries differ from the student's;
    ``PAIR_VOCAB_SIZE`` entries."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + CHARS + ([f"{a}{b}" for a in range(10) for b in range(10)] if digit_pairs else [])
    size = PAIR_VOCAB_SIZE if digit_pairs else VOCAB_SIZE
    tokens += [f"<|reserved_{i}|>" for i in range(size - len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d\d|." if digit_pairs else "."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    fast.chat_template = chat_template
    fast.padding_side = "left"
    return fast


def model_config(role: str, arch: str | None = None, vocab_size: int = VOCAB_SIZE):
    """The config of the demo ``teacher`` or ``student``; ``arch`` overrides the architecture, ``vocab_size`` the
    vocabulary (PAIR_VOCAB_SIZE for the digit-pair tokenizer)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, rope_theta=10000.0,
    )
    if role == "teacher":
        sizes = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=64)
        arch = arch or "qwen3"
    elif role == "student":
        sizes = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=32)
        arch = arch or "llama"
    else:
        raise ValueError(f"role must be 'teacher' or 'student', got {role!r}")
    if arch == "qwen3":
        return Qwen3Config(**common, **sizes)
    if arch == "llama":
        return LlamaConfig(**common, **sizes)
    raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")


def new_model(role: str, arch: str | None = None, seed: int = 0, vocab_size: int = VOCAB_SIZE):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(role, arch, vocab_size), dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def save(model, tokenizer, path: str | Path) -> Path:
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

"""A toy engine as a newcomer writes one: the transformers engine underneath, its own declared capabilities (the
tests register it in ``opdcache.backends.ENGINES`` under the name ``toy``)."""

from dataclasses import replace

from opdcache.backends import hf
from opdcache.backends.base import Capabilities, statistics

CAPABILITIES = Capabilities(summary="a toy: the transformers engine without hidden states or the whole distribution",
                            statistics=statistics("logits", "log_partition", "candidates"), batch_size_changes_bits=True,
                            quantization="emulated", max_temperature=1.5)


def check(engine) -> dict:
    return hf.check(engine)


def build(model, engine, **extra):
    return hf.build(model, replace(engine, backend="transformers"), **extra)


def from_model(model, engine=None):
    return hf.from_model(model, engine)

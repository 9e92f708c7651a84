"""Where a model is loaded: the device and dtype a setting names, each refused in one line before any weights load, and
the load itself (a local Hugging Face causal LM, with an optional low-bit scheme). Shared by the transformers and exact
engines."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from opdcache.errors import ConfigError


def parse_device(device: str) -> torch.device:
    """``--device`` as a torch device (auto: a CUDA GPU when torch sees one, else the CPU); refused in one line when it
    is no device name. Whether this machine has it is :func:`resolve_device`'s question: a configuration may be
    checked on a machine that only dispatches the work (a Ray driver without GPUs)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}") from None


def resolve_device(device: str) -> torch.device:
    """:func:`parse_device`, refused in one line when it names a CUDA GPU this process's torch cannot use (called before
    a model loads)."""
    dev = parse_device(device)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device}: no CUDA GPU is visible to this torch ({torch.__version__}); "
                              "use --device cpu (or auto)")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}") from None


def check_load(path: str | Path, dtype: str, device: str, quantize: str | None) -> torch.device:
    """The device :func:`load_model` would load ``path`` onto, each setting refused in one line before any weights load."""
    from opdcache.backends.quant import QuantScheme

    dev = resolve_device(device)
    resolve_dtype(dtype, dev)
    scheme = None if quantize is None else QuantScheme.parse(quantize)
    if scheme is not None and not scheme.emulated and dev.type != "cpu":
        raise ConfigError("--quantize int8 on the transformers backend is CPU-only (torch dynamic quantisation); use an emulated scheme "
                          "(w8a8) or --backend vllm on GPUs")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{path} is not a local Hugging Face model directory (no config.json); opdcache never downloads models")
    return dev


def load_model(path: str | Path, dtype: str = "auto", device: str = "auto", quantize: str | None = None):
    """Load a local HF causal LM for inference. ``quantize``: a scheme of opdcache/backends/quant.py -- ``int8`` applies
    torch's dynamic int8 linear layers (CPU); w4a16, w8a8 and fp8 are emulated (quantize, dequantize, compute)."""
    from opdcache.inputs.models import load_causal_lm
    from opdcache.backends.quant import QuantScheme, apply_scheme
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dev = check_load(path, dtype, device, quantize)
    torch_dtype = resolve_dtype(dtype, dev)
    scheme = None if quantize is None else QuantScheme.parse(quantize)
    model = load_causal_lm(path, torch_dtype).to(dev).eval()
    if scheme is not None and scheme.emulated:
        apply_scheme(model, scheme, "inference")
    elif scheme is not None:
        model = model.float()
        from torch.ao.quantization import quantize_dynamic

        head = model.get_output_embeddings()
        with warnings.catch_warnings():  # torch >= 2.10 deprecates torch.ao in favour of torchao; it still works, and needs no extra package
            warnings.filterwarnings("ignore", message=".*quantiz.*deprecated", category=UserWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            model = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        # keep the unembedding exact: quantising it too would change what every stored log-prob means
        model.set_output_embeddings(head)
    return model

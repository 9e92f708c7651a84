"""LoRA students (``train --lora-rank R``) through PEFT: the student's base weights stay frozen in their dtype, low-rank
adapters on its linear layers train in float32, and a checkpoint holds the adapters and their optimizer state only.

The adapters are injected into the student's own modules (PEFT's ``get_peft_model``), so the trainer's forward, the
packed attention and every loss run on the same model object; the PEFT wrapper is kept for what PEFT does best
(``save_pretrained`` of an adapter folder, ``merge_and_unload``). Default targets: every linear layer of the decoder's
attention and MLP blocks, found from the model (for Llama, Qwen and Mistral: q/k/v/o and gate/up/down projections).

PEFT is pinned to ``>=0.17,<0.22``: the range whose ``LoraConfig`` fields, ``get_peft_model`` injection in place and
adapter folder layout (``adapter_config.json`` + ``adapter_model.safetensors``, loaded by
``PeftModel.from_pretrained``) this module is tested against.
"""

from __future__ import annotations

import importlib.util

import torch

from opdcache.errors import ConfigError, MissingDependencyError

PEFT_RANGE = ">=0.17,<0.22"
ADAPTER_FILE = "adapter.safetensors"
"""The adapters' float32 weights in a checkpoint (by the student's parameter names)."""
NOT_WITH_LORA = {"exact": "the exact arithmetic re-implements the decoder's layers, which hold no adapters",
                 "fsdp": "adapters are not sharded yet: train a LoRA student with DDP (torchrun) instead"}


def check(cfg) -> None:
    """The LoRA settings (before anything loads): a rank of 0 is full fine-tuning; PEFT importable; no setting LoRA
    does not support."""
    if cfg.lora_rank == 0:
        if cfg.lora_ref:
            raise ConfigError("--lora-ref recomputes pi_ref as the student with its adapters off: train with --lora-rank R")
        if cfg.save == "adapter":
            raise ConfigError("--save adapter writes a LoRA adapter: train with --lora-rank R, or --save merged")
        return
    if not isinstance(cfg.lora_rank, int) or cfg.lora_rank < 0:
        raise ConfigError(f"--lora-rank must be a positive integer (0: full fine-tuning), got {cfg.lora_rank!r}")
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:
        raise ConfigError(f"--lora-alpha must be positive, got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    for name, why in NOT_WITH_LORA.items():
        if getattr(cfg, name):
            raise ConfigError(f"--{name.replace('_', '-')} with --lora-rank is not supported: {why}")
    if importlib.util.find_spec("peft") is None:
        raise MissingDependencyError(f"--lora-rank needs PEFT: pip install 'peft{PEFT_RANGE}'")


def linear_names(model) -> list[str]:
    """The leaf names of the linear layers inside the decoder's layers (q_proj, ..., down_proj), in order."""
    base = getattr(model, model.base_model_prefix)
    names = []
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in names:
                names.append(leaf)
    return names


def apply(model, cfg):
    """Inject the adapters into ``model`` (in place; its other weights frozen) and return PEFT's wrapper of it."""
    from peft import LoraConfig, get_peft_model

    available = linear_names(model)
    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()] if cfg.lora_targets else available
    missing = [t for t in targets if t not in available]
    if missing or not targets:
        raise ConfigError(f"--lora-targets {', '.join(missing) or '(none)'}: {type(model).__name__} has no such linear layer; "
                          f"its decoder's linear layers are {', '.join(available)}")
    smallest = min(min(m.in_features, m.out_features) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets)
    if cfg.lora_rank > smallest:
        raise ConfigError(f"--lora-rank {cfg.lora_rank} is larger than the smallest targeted layer's rank ({smallest}); "
                          f"use at most {smallest}")
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank, lora_dropout=cfg.lora_dropout,
                        target_modules=targets, bias="none")
    wrapped = get_peft_model(model, config)
    for p in model.parameters():  # adapters in float32 whatever the base's dtype
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return wrapped


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapters' weights by the student's parameter names (what a checkpoint holds)."""
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def base_dtype(device: torch.device) -> torch.dtype:
    """The frozen base's dtype: bfloat16 on a GPU that has it, float32 on a CPU."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def save_final(wrapped, folder, save: str, dtype: torch.dtype, base=None) -> None:
    """The run's output: a PEFT adapter folder (``adapter``) or the merged model in ``dtype`` (``merged``). ``base``: a
    function loading the base the adapters merge into, where the trained one is not it (its linear layers computed in
    the rollouts' low-bit scheme, ``--rollout-aligned``): the adapters go onto the base's own weights."""
    if save == "adapter":
        wrapped.save_pretrained(folder)
        return
    import copy

    if base is None:
        merged = copy.deepcopy(wrapped).merge_and_unload()
    else:
        import tempfile

        from peft import PeftModel

        with tempfile.TemporaryDirectory(prefix="opdcache-adapter-", dir=folder) as tmp:
            wrapped.save_pretrained(tmp)
            merged = PeftModel.from_pretrained(base(), tmp).merge_and_unload()
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.state_dict().items()}
    merged.save_pretrained(folder, state_dict=state)

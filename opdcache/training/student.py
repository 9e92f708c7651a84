"""The student in training: its forward to per-token log-probs without [tokens, vocabulary], its precision, and
how it is spread over processes (DDP, or FSDP2 for students larger than one device).

:class:`StudentForward` is the module DDP or FSDP wraps: the decoder, the gather of the response positions
and the fused head pass (opdcache/logits/logprobs.py, and opdcache/logits/divergence.py for the full-vocabulary losses)
all run inside its ``forward``, so FSDP has gathered the head's weight when it is used and gradients
reach the sharded parameters. Memory per micro-batch: activations [B, L, H] (or one layer's with
``--gradient-checkpointing``), the head pass's [rows, chunk] float32 logit blocks (bounded by
opdcache.logits.logprobs.BLOCK_BYTES whatever N; on a GPU [rows, V] blocks of at most GPU_BLOCK_BYTES, and the
forward's probabilities kept for the backward within KEEP_BYTES) and one [V, H] head gradient; nothing grows with N x V
beyond those budgets.
"""

from __future__ import annotations

import os

import torch

from opdcache.errors import ConfigError
from opdcache.logits.logprobs import chunked_logprobs, head_transform_of

DTYPES = ("auto", "float32", "bfloat16")


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``--dtype`` (None: plain float32). auto: bfloat16 on a CUDA device that supports it."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if dtype == "bfloat16" else None


PACKED_ATTENTION = "opdcache_packed"
"""The attention a packed batch's forward runs (registered with transformers' AttentionInterface): each sequence
attends causally within itself, one scaled_dot_product_attention call per sequence (flash or memory-efficient kernels
on a GPU, no mask), so memory grows with the sum of the sequences' squared lengths at most, never with the packed
length squared as a block-diagonal mask over the whole batch would."""


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query [1, heads, N, d], key and value [1, kv_heads, N, d] of sequences laid end to end at the host-side offsets
    ``packed_offsets`` (a tuple: no device sync) -> [1, N, heads, d], each sequence attending causally to itself.
    Without ``packed_offsets`` (a padded batch, from a source that yields them) transformers' SDPA attention with its mask."""
    offsets = kwargs.pop("packed_offsets", None)
    if offsets is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    sizes = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    # split, not one slice a sequence: a slice's backward writes its gradient into a zero tensor of the whole packed
    # length, so B slices would cost B x N a layer; a split's backward is one concatenation of N
    parts = [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout if module.training else 0.0,
                                                              scale=scaling, enable_gqa=groups > 1)
             for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2)) if q.shape[2]]
    return torch.cat(parts, 2).transpose(1, 2).contiguous(), None


def enable_packed_attention(model) -> None:
    """Make ``model`` run :func:`packed_attention`: packed batches with their ``packed_offsets``, padded ones as before."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    model.set_attn_implementation(PACKED_ATTENTION)


class StudentForward(torch.nn.Module):
    """Decoder forward, then per response token: log-probs at requested ids, log-partition, optional divergence."""

    def __init__(self, model, chunk: int, exact_dtype: torch.dtype | None = None, exact_arithmetic: str | None = None):
        """``exact_dtype``: run the decoder and the head in the exact arithmetic (opdcache/exact/) in this dtype;
        ``exact_arithmetic``: which one (a name of opdcache.exact.ARITHMETICS; default: the model's device's)."""
        super().__init__()
        self.model = model
        self.chunk = chunk
        self.scale, self.softcap = head_transform_of(model)
        self.exact = None
        if exact_dtype is not None:
            from opdcache.exact import arithmetic_for_device, primitives
            from opdcache.exact.decoder import ExactDecoder

            name = exact_arithmetic or arithmetic_for_device(next(model.parameters()).device)
            self.exact = ExactDecoder(model, exact_dtype, arith=primitives(name))

    def forward(self, input_ids_BL, attention_mask_BL, logit_positions_BT, select_BT, ids_NK, divergence: str | None = None,
                teacher_hidden_NK=None, teacher_weight=None, teacher_bias=None, uniform: bool = False, position_ids_1L=None,
                packed_offsets: tuple[int, ...] | None = None):
        """(log-probs [N, K] at ``ids_NK``, log-partition [N], divergence [N] or None) for the N selected tokens.
        ``uniform``: the caller reduces the divergence with one weight per token (opdcache.logits.divergence's fast path).
        ``position_ids_1L``: a packed batch (opdcache/training/packing.py): ``input_ids_BL`` is [1, L], the sequences
        end to end with these position ids, starting at ``packed_offsets`` (host-side ints; the model runs
        :func:`packed_attention`: :func:`enable_packed_attention`), and ``logit_positions_BT`` is [N], the selected
        tokens' positions in it, in ``select_BT``'s row-major order."""
        base = getattr(self.model, self.model.base_model_prefix)
        if position_ids_1L is not None:
            offsets = tuple(packed_offsets)
            if self.exact is not None:
                with torch.autocast(input_ids_BL.device.type, enabled=False):
                    h_LH = self.exact.forward_packed(input_ids_BL, position_ids_1L, offsets)[0]
            else:
                h_LH = base(input_ids=input_ids_BL, position_ids=position_ids_1L, use_cache=False, packed_offsets=offsets).last_hidden_state[0]
            h_NH = h_LH[logit_positions_BT]
        else:
            if self.exact is not None:  # right-padded rows (opdcache/training/data.py): the exact forward needs no mask
                with torch.autocast(input_ids_BL.device.type, enabled=False):
                    h_BLH = self.exact.forward(input_ids_BL)
            else:
                h_BLH = base(input_ids=input_ids_BL, attention_mask=attention_mask_BL).last_hidden_state
            rows, cols = select_BT.nonzero(as_tuple=True)
            h_NH = h_BLH[rows, logit_positions_BT[rows, cols]]
        head = self.model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        lp_NK, lse_N = chunked_logprobs(h_NH, head.weight, ids_NK, bias, self.chunk, self.scale, self.softcap)
        if self.exact is not None:  # the exact values, with the streamed head's gradient (straight-through)
            from opdcache.exact.head import picks_and_stats

            with torch.no_grad(), torch.autocast(h_NH.device.type, enabled=False):
                exact_lp, exact_lse, _ = picks_and_stats(h_NH.detach(), head.weight.detach(), None if bias is None else bias.detach(),
                                                         self.exact.dtype, ids_NK.long(), arith=self.exact.arith)
            # exact + (x - x), in float32: the value is the exact one to the bit (x - x = 0), the gradient x's. In the
            # streamed head's dtype (bfloat16 when the exact decoder's hidden states are) the exact value would round
            lp_NK = exact_lp.float() + (lp_NK - lp_NK.detach()).float()
            lse_N = exact_lse.float() + (lse_N - lse_N.detach()).float()
        div_N = None
        if divergence == "uniform":  # cross-entropy of the uniform distribution against the student: lse - mean logit, O(N x H)
            mean_logit_N = h_NH @ head.weight.mean(0).to(h_NH.dtype) + (0 if bias is None else bias.mean())
            if self.scale is not None or self.softcap is not None:
                raise ConfigError("label smoothing does not support models with logit scaling or soft-capping yet")
            div_N = lse_N - mean_logit_N.float()
        elif divergence is not None:
            if self.scale is not None or self.softcap is not None:
                raise ConfigError("the full-vocabulary losses do not support models with logit scaling or soft-capping yet; use lightning")
            from opdcache.logits.divergence import chunked_divergence

            div_N = chunked_divergence(divergence, h_NH, head.weight, teacher_hidden_NK, teacher_weight, bias, teacher_bias, chunk=self.chunk,
                                       uniform=uniform)
        return lp_NK, lse_N, div_N


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward (non-reentrant checkpointing; transformers >= 5 names it
    activation checkpointing, earlier versions gradient checkpointing)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"--gradient-checkpointing: {type(model).__name__} does not support activation checkpointing")
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def init_distributed() -> tuple[bool, int, int, torch.device, bool]:
    """(distributed, rank, world size, device, whether this call started the process group) from torchrun's
    variables; starts the process group when needed (whoever starts it destroys it when done)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    started = distributed and not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    return distributed, rank, world, device, started


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated blocks (its ``_no_split_modules`` classes): FSDP's unit of sharding."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"--fsdp: cannot find the decoder layers of {type(model).__name__} (no _no_split_modules); train without --fsdp")
    return layers


def shard_fsdp(forward: StudentForward, device: torch.device, world: int) -> StudentForward:
    """FSDP2: every decoder layer its own unit, the rest (embeddings, final norm, head) in the root unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in decoder_layers(forward.model):
        fully_shard(layer, mesh=mesh)
    fully_shard(forward, mesh=mesh)
    return forward


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (FSDP gradient norms); a plain tensor as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x

"""One exact arithmetic for sampling, scoring and learning (papers/003, VeXact), on any CPU.

``arith``: the primitives (dot products, sums and transcendental functions whose float32 result is a function of
the mathematics only, never of the batch, padding, kernel or thread count); ``decoder``: the decoder forward built
from them (Llama, Qwen2, Qwen3, Mistral), with a KV cache that gives the same bits as a full forward; ``head``: the
unembedding and its log-partition, top-k and draws in the same arithmetic.
"""

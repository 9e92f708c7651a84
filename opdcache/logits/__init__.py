"""What every stage computes from logits: the log-probs of chosen tokens and the divergences over a vocabulary, in
bounded blocks of positions (never a [tokens, vocabulary] tensor whole), and their fused GPU kernels.
"""

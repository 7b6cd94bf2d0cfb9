"""A tiny stand-in for SmolLM2 in tests of the fine-tuning command and tools: a one-block GPT over bytes plus
the chat template's special tokens, so a fine-tune runs in seconds."""

import torch

from groundup.models import GPT, GPTConfig
from groundup.tokenizers import BPETokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_base(seed=0):
    """(model, tokenizer): a GPT of width 16 with ``seed``'s random weights, and a byte-level tokenizer."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=256 + len(SPECIALS), context_length=256, d_model=16, n_layers=1, n_heads=2))
    return model.eval(), BPETokenizer(special_tokens=SPECIALS)

"""Independent references built from PyTorch's own modules, shared by several test modules."""

import torch
from torch import nn


def encoder_layer_like(block, d: int, n_heads: int, d_ff: int, norm_first: bool) -> nn.TransformerEncoderLayer:
    """PyTorch's nn.TransformerEncoderLayer with our block's weights copied in."""
    ref = nn.TransformerEncoderLayer(d, n_heads, d_ff, dropout=0.0, activation="gelu", batch_first=True,
                                     norm_first=norm_first, layer_norm_eps=1e-5)
    a = block.attention
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(torch.cat([a.W_q.weight, a.W_k.weight, a.W_v.weight]))
        ref.self_attn.in_proj_bias.copy_(torch.cat([a.W_q.bias, a.W_k.bias, a.W_v.bias]))
        ref.self_attn.out_proj.load_state_dict(a.W_o.state_dict())
        ref.linear1.load_state_dict(block.ffn.W_in.state_dict())
        ref.linear2.load_state_dict(block.ffn.W_out.state_dict())
        ref.norm1.load_state_dict(block.norm_1.state_dict())
        ref.norm2.load_state_dict(block.norm_2.state_dict())
    return ref.eval()

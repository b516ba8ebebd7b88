"""Load weights from ``torch.nn.Transformer`` into tfcli's model, for equivalence checks and
side-by-side benchmarks. Only the layout of the ``torch-transformer`` preset is supported:
post-norm, final norms, biases, per-feature norms, no vocabularies or positions."""

from __future__ import annotations

import torch
from torch import nn

from tfcli.model.attention import MultiHeadAttention
from tfcli.errors import ConfigError
from tfcli.model.transformer import Transformer


def _copy_attention(dst: MultiHeadAttention, src: nn.MultiheadAttention) -> None:
    w_q, w_k, w_v = src.in_proj_weight.chunk(3)  # torch stacks W_Q, W_K, W_V in one matrix
    b_q, b_k, b_v = src.in_proj_bias.chunk(3)
    for proj, w, b in ((dst.q_proj, w_q, b_q), (dst.k_proj, w_k, b_k), (dst.v_proj, w_v, b_v)):
        proj.weight.copy_(w)
        proj.bias.copy_(b)
    dst.out_proj.load_state_dict(src.out_proj.state_dict())


@torch.no_grad()
def load_from_torch_transformer(model: Transformer, ref: nn.Transformer) -> Transformer:
    cfg = model.cfg
    layout_ok = (cfg.norm_placement == "post" and cfg.final_norm and cfg.attention_bias
                 and cfg.norm_affine == "feature" and model.src_embed is None
                 and model.tgt_embed is None and model.output is None)
    if not layout_ok:
        raise ConfigError("load_from_torch_transformer: the model must have the "
                          "torch-transformer preset's layout")
    for ours, theirs in zip(model.encoder.layers, ref.encoder.layers, strict=True):
        _copy_attention(ours.self_attn, theirs.self_attn)
        ours.self_attn_norm.load_state_dict(theirs.norm1.state_dict())
        ours.ffn.linear1.load_state_dict(theirs.linear1.state_dict())
        ours.ffn.linear2.load_state_dict(theirs.linear2.state_dict())
        ours.ffn_norm.load_state_dict(theirs.norm2.state_dict())
    for ours, theirs in zip(model.decoder.layers, ref.decoder.layers, strict=True):
        _copy_attention(ours.self_attn, theirs.self_attn)
        ours.self_attn_norm.load_state_dict(theirs.norm1.state_dict())
        _copy_attention(ours.cross_attn, theirs.multihead_attn)
        ours.cross_attn_norm.load_state_dict(theirs.norm2.state_dict())
        ours.ffn.linear1.load_state_dict(theirs.linear1.state_dict())
        ours.ffn.linear2.load_state_dict(theirs.linear2.state_dict())
        ours.ffn_norm.load_state_dict(theirs.norm3.state_dict())
    model.encoder.norm.load_state_dict(ref.encoder.norm.state_dict())
    model.decoder.norm.load_state_dict(ref.decoder.norm.state_dict())
    return model

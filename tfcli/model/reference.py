"""Load weights from other implementations into tfcli's model, for equivalence checks and
side-by-side benchmarks:

- ``torch.nn.Transformer``: the ``torch-transformer`` preset's layout (post-norm, final norms,
  biases, per-feature norms, no vocabularies or positions);
- Transformers' ``LlamaForCausalLM`` / ``MistralForCausalLM``: the ``llama-*`` / ``mistral-7b``
  layout (RMSNorm, rotary, grouped-query attention, SwiGLU, no biases, untied output);
- Transformers' ``GPT2LMHeadModel``: the ``gpt2-*`` layout.

The Transformers models are read by attribute; this module does not import transformers."""

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


def _require(ok: bool, loader: str, preset: str) -> None:
    if not ok:
        raise ConfigError(f"{loader}: the model must have the {preset} presets' layout")


@torch.no_grad()
def load_from_hf_llama(model: Transformer, ref: nn.Module) -> Transformer:
    """Copy a Transformers ``LlamaForCausalLM`` (or ``MistralForCausalLM``, the same layout)."""
    cfg = model.cfg
    _require(cfg.kind == "decoder-only" and cfg.norm == "rmsnorm" and not cfg.has_norm_bias
             and cfg.norm_affine == "feature" and cfg.norm_placement == "pre" and cfg.final_norm
             and cfg.ffn == "swiglu" and not cfg.ffn_bias and not cfg.attention_bias
             and cfg.positional == "rope" and cfg.tie_embeddings == "none"
             and model.tgt_embed.proj is None, "load_from_hf_llama", "llama-*")
    model.tgt_embed.token.weight.copy_(ref.model.embed_tokens.weight)
    for ours, theirs in zip(model.decoder.layers, ref.model.layers, strict=True):
        attn = theirs.self_attn
        for mine, their in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                            ("out_proj", "o_proj")):
            getattr(ours.self_attn, mine).weight.copy_(getattr(attn, their).weight)
        ours.ffn.gate.weight.copy_(theirs.mlp.gate_proj.weight)
        ours.ffn.linear1.weight.copy_(theirs.mlp.up_proj.weight)
        ours.ffn.linear2.weight.copy_(theirs.mlp.down_proj.weight)
        ours.self_attn_norm.weight.copy_(theirs.input_layernorm.weight)
        ours.ffn_norm.weight.copy_(theirs.post_attention_layernorm.weight)
    model.decoder.norm.weight.copy_(ref.model.norm.weight)
    model.output.weight.copy_(ref.lm_head.weight)
    return model


@torch.no_grad()
def load_from_hf_gpt2(model: Transformer, ref: nn.Module) -> Transformer:
    """Copy a Transformers ``GPT2LMHeadModel``. Its ``Conv1D`` layers store W as [in, out], the
    transpose of ``nn.Linear``'s; ``c_attn`` stacks W_Q, W_K, W_V along the output."""
    cfg = model.cfg
    _require(cfg.kind == "decoder-only" and cfg.norm == "layernorm" and cfg.has_norm_bias
             and cfg.norm_affine == "feature" and cfg.norm_placement == "pre" and cfg.final_norm
             and cfg.ffn == "mlp" and cfg.ffn_bias and cfg.attention_bias
             and cfg.positional == "learned" and cfg.tie_embeddings == "tgt_output"
             and not cfg.output_bias and not cfg.embed_norm and model.tgt_embed.proj is None,
             "load_from_hf_gpt2", "gpt2-*")
    gpt = ref.transformer
    model.tgt_embed.token.weight.copy_(gpt.wte.weight)  # also the tied output projection
    model.tgt_embed.pos.weight.copy_(gpt.wpe.weight[: cfg.max_seq_len])

    def linear(dst: nn.Linear, weight: torch.Tensor, bias: torch.Tensor) -> None:
        dst.weight.copy_(weight.t())
        dst.bias.copy_(bias)

    for ours, theirs in zip(model.decoder.layers, gpt.h, strict=True):
        w_q, w_k, w_v = theirs.attn.c_attn.weight.chunk(3, dim=1)
        b_q, b_k, b_v = theirs.attn.c_attn.bias.chunk(3)
        attn = ours.self_attn
        for dst, w, b in ((attn.q_proj, w_q, b_q), (attn.k_proj, w_k, b_k), (attn.v_proj, w_v, b_v)):
            linear(dst, w, b)
        linear(attn.out_proj, theirs.attn.c_proj.weight, theirs.attn.c_proj.bias)
        linear(ours.ffn.linear1, theirs.mlp.c_fc.weight, theirs.mlp.c_fc.bias)
        linear(ours.ffn.linear2, theirs.mlp.c_proj.weight, theirs.mlp.c_proj.bias)
        ours.self_attn_norm.load_state_dict(theirs.ln_1.state_dict())
        ours.ffn_norm.load_state_dict(theirs.ln_2.state_dict())
    model.decoder.norm.load_state_dict(gpt.ln_f.state_dict())
    return model

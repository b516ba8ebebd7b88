"""What separates the replayed layer from Korthikanti et al. 2022's 34·s·b·h/t (Table 2, sequence
parallelism, a fused kernel, 16-bit) once the replay runs as Megatron runs (--precision megatron:
every tensor bf16) on CUDA's paths: exactly the two things the README names, and nothing else
beyond the log-sum-exp and the norms' statistics."""

from __future__ import annotations

import json


def test_the_replayed_layer_is_the_papers_plus_two_named_terms(cli):
    s, b, h, a, t = 512, 1, 512, 8, 4
    result = cli("params", "-p", "gpt2-small", "--set", f"d_model={h}", "--set", f"n_heads={a}",
                 "--set", f"d_ff={4 * h}", "--set", "n_decoder_layers=2", "--set",
                 "tgt_vocab_size=256", "--set", f"max_seq_len={s}", "--parallel", f"tp={t}",
                 "--seq-len", str(s), "--batch-size", str(b), "--device", "cuda", "--precision",
                 "megatron", "--attention-kernel", "flash", "--json")
    assert result.exit_code == 0, result.stderr
    replay, paper, _ = (line["bytes"] for line in json.loads(result.stdout)["cross_check"])
    assert paper == 34 * s * b * h // t  # the paper's row for a fused kernel
    output_saved_twice = 2 * s * b * h // t  # by the kernel, and as the projection's input
    mask_bias = 2 * b * s * s  # the explicit causal mask as a bf16 additive bias, per layer
    rest = replay - paper - output_saved_twice - mask_bias
    assert 0 <= rest < paper // 100  # the log-sum-exp, the norms' mean and rstd

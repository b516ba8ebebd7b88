"""Activations one rank keeps: a fake-tensor replay of the rank's share of the model, and
Korthikanti et al. 2022 (Table 2) beside it as the cross-check.

The replay (:func:`tfcli.inspection.memory.estimate_activations`) runs the share — heads, FFN
width and vocabulary divided by t, the sequence by C — at the stage's depth, each layer a unit
whose saved bytes it tells apart: the last layer of each stack is one layer, and the peak at
the stage's depth less all its layers is the rest (embeddings, output, loss, backward's
working set).
Sequence parallelism, which the replay cannot run, removes what tensor parallelism leaves
replicated in each residual sublayer (the norm's input and output, the dropout mask), t ways.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tfcli.parallel.layout import Line, Parallel, StageParams
from tfcli.model.config import Config


def row_kernel(cfg: Config, kernel: str) -> str:
    """The attention kernel Table 2's row follows: "math" where the s×s scores are kept
    (tfcli's naive attention, --attention-kernel math, or auto on the CPU with dropout, where
    SDPA falls back to math), else the fused kernel (auto on the CPU without dropout: flash)."""
    if cfg.attention == "naive" or kernel == "math" or (kernel == "auto" and cfg.dropout > 0):
        return "math"
    return "flash" if kernel == "auto" else kernel


def korthikanti_layer(s: int, b: int, h: int, a: int, t: int, sp: bool,
                      checkpointing: str, kernel: str = "math") -> tuple[float, str]:
    """Bytes one GPT-style layer keeps for backward at 16 bits (Korthikanti et al. 2022,
    Table 2), and the row used. With a fused ``kernel`` (flash, efficient) no s×s tensor is
    kept (scores, softmax, dropout mask): the 5as/h term goes, as in the paper's selective
    recomputation row."""
    if checkpointing == "full":
        return (2 * s * b * h / (t if sp else 1),
                "2sbh" + ("/t" if sp and t > 1 else "") + " (full recomputation: the layer input)")
    fused = kernel != "math"
    attn = 0.0 if checkpointing == "selective" or fused else 5 * a * s / (h * t)
    if t == 1:
        linear, row = 34.0, "sbh(34 + 5as/h)"
    elif sp:
        linear, row = 34.0 / t, "sbh(34/t + 5as/(ht))"
    else:
        linear, row = 10 + 24.0 / t, "sbh(10 + 24/t + 5as/(ht))"
    if fused:
        row = (row.split(" + 5as")[0] + ")" + f" ({kernel} kernel: no s×s scores, softmax or "
               f"dropout mask kept, as the paper's selective-recomputation row"
               + ("; selective recomputation changes nothing more" if checkpointing == "selective"
                  else "") + ")")
    elif checkpointing == "selective":
        row = row.split(" + 5as")[0] + ")" + " (selective: attention core recomputed)"
    return s * b * h * (linear + attn), row


@dataclass(frozen=True)
class Replay:
    """Replay of one rank's share at the stage's depth: one layer, and the rest."""
    per_layer: int  # bytes one layer saves for backward (the same in every layer)
    per_layer_attention: int  # of which [B, h, T, S] attention matrices
    rest: int  # the peak less all layers' saved bytes: embeddings, output, loss, working set
    how: str
    held_output: int = 0  # of the rest: the model's output a keep-output loop holds


def share_config(cfg: Config, t: int, n_enc: int, n_dec: int) -> Config:
    """The model one tensor-parallel rank runs, with n_enc + n_dec layers: heads, FFN width and
    vocabularies divided by t (head width kept). At t = 1 and every layer, ``cfg`` itself: its
    replays are those any other plan or line of the same model asks for (remembered)."""
    if t == 1 and (n_enc if cfg.has_encoder else 0, n_dec if cfg.has_decoder else 0) == (
            cfg.n_encoder_layers, cfg.n_decoder_layers):
        return cfg
    vocab = lambda v: -(-v // t) if v else 0  # noqa: E731
    return cfg.replace(
        n_heads=cfg.n_heads // t, n_kv_heads=cfg.kv_heads // t, head_dim=cfg.d_k,
        d_ff=cfg.d_ff // t, src_vocab_size=vocab(cfg.src_vocab_size),
        tgt_vocab_size=vocab(cfg.tgt_vocab_size),
        n_encoder_layers=n_enc if cfg.has_encoder else 0,
        n_decoder_layers=n_dec if cfg.has_decoder else 0)


@functools.lru_cache(maxsize=64)  # --fit asks again for sizes it has seen
def replay_share(cfg: Config, t: int, batch: int, seq_len: int, dtype: str = "fp32",
                 mixed: str | None = None, kernel: str = "auto",
                 depth: tuple[int, int] = (1, 1), loop: str = "loss-only",
                 device: str = "cpu") -> Replay:
    """The replay at ``depth`` (encoder, decoder layers), every layer a unit whose saved
    bytes the replay tells apart: one layer is what the last layer of each stack saved
    (from the second layer on, each saves the same; the first also saves what the later ones
    share, the masks and, in a decoder, the encoder's output its cross-attention reads).
    Where a stack has one layer at ``depth``, a replay at two layers per stack gives it.
    The peak at ``depth`` less its layers is the rest (with ``loop`` "keep-output", the
    model's output held through backward too), which the peak's moment makes no linear
    function of the depth. ``device``: whose code paths (tfcli.inspection.cuda_replay).
    The replays are remembered (tfcli.inspection.memory), so plans of one model at several
    depths, and its other lines, share them. The last layer's bytes equal the difference
    between replays at one and two layers per stack, which this function took before
    (tests/test_parallel.py holds them equal)."""
    from tfcli.inspection.memory import estimate_activations
    from tfcli.subjects.own import OwnSubject

    sizes = {"B": batch, "S": seq_len, "T": seq_len, "L": seq_len}
    stacks = [n for n, present in zip(depth, (cfg.has_encoder, cfg.has_decoder)) if present]

    def run(n_enc: int, n_dec: int):
        subject = OwnSubject(share_config(cfg, t, n_enc, n_dec))
        return estimate_activations(subject, sizes, dtype, mixed, kernel, loop=loop,
                                    device=device)

    at, how = run(*depth)
    layered = at if min(stacks) >= 2 else run(2, 2)[0]
    per_stack = stacks if layered is at else [2] * len(stacks)
    lasts = [sum(per_stack[:i + 1]) - 1 for i in range(len(per_stack))]  # units in order
    saved = lambda unit, kind=None: (sum(layered.unit_saved[unit].values())  # noqa: E731
                                     if kind is None else
                                     layered.unit_saved[unit].get(kind, 0))
    # an encoder-decoder's layer: the mean of an encoder and a decoder layer
    per_layer = sum(saved(u) for u in lasts) // len(lasts)
    per_attn = sum(saved(u, "attention matrices") for u in lasts) // len(lasts)
    rest = at.peak_bytes - per_layer * sum(stacks)
    return Replay(per_layer, per_attn, rest, how + (f", one rank's share (h/{t}, d_ff/{t}, V/{t})"
                                                     if t > 1 else ""), at.held_output)


def _in_flight(par: Parallel, stage: int, m: int) -> int:
    return min(par.pp - stage, m)  # 1F1B: stage i starts backward after P - i forwards


def kept_per_layer(cfg: Config, par: Parallel, rep: Replay, batch: int, s_local: int,
                    checkpointing: str, e: int) -> tuple[int, str]:
    t, d = par.tp, cfg.d_model
    sp = par.sp and t > 1
    if checkpointing == "full":
        return (batch * s_local * d * e // (t if sp else 1),
                f"the layer input b·s·d_model × {e} B" + (" / t (sequence parallel)" if sp else ""))
    kept, how = rep.per_layer, "one layer of the replay"
    if checkpointing == "selective":
        kept -= rep.per_layer_attention
        how += (f" less its attention matrices ({rep.per_layer_attention:,} B)"
                if rep.per_layer_attention else ": its attention kernel keeps no attention "
                "matrices, so selective recomputation saves nothing here")
    if sp:
        # what TP alone leaves replicated per residual sublayer: the norm's input and output
        # (e bytes each) and, with dropout, the output's dropout mask (1 byte), per position
        # 2 residual sublayers per layer, 3 in a decoder layer with cross-attention: an
        # encoder-decoder's per-layer figure is the mean of its two kinds
        subs = 2.5 if cfg.kind == "encoder-decoder" else 2
        per_sub = 2 * e + (1 if cfg.dropout > 0 else 0)
        saved = int(subs * per_sub * batch * s_local * d * (1 - 1 / t))
        kept -= saved
        how += (f", less what sequence parallelism splits t ways ({subs:g} sublayers × "
                f"{per_sub} B × b·s·d_model × (1 - 1/t))")
    return max(kept, 0), how


def activation_lines(cfg: Config, par: Parallel, st: StageParams, rep: Replay, batch: int,
                      s_local: int, m: int, checkpointing: str, e: int) -> list[Line]:
    flight = _in_flight(par, st.stage, m)
    kept, how = kept_per_layer(cfg, par, rep, batch, s_local, checkpointing, e)
    out = [Line("activations: layers", st.layers * flight * kept,
                f"{st.layers} layers × {flight} micro-batch(es) in flight × {kept:,} B: {how}",
                "activations")]
    if checkpointing == "full":
        out.append(Line("activations: recomputed layer", rep.per_layer,
                        "one layer's activations while it is recomputed for backward",
                        "activations"))
    if st.stage == par.pp - 1:
        out.append(Line("activations: embeddings, output, loss, working set", rep.rest,
                        "the replay less its layers: embeddings, logits, loss and backward's "
                        "gradients in flight at the peak"
                        + ("; the model's output held by the keep-output loop"
                           if rep.held_output else "")
                        + ("; the first stage's embedding activations are counted here"
                           if par.pp > 1 else ""), "activations"))
    return out


def cross_check(cfg: Config, par: Parallel, st: StageParams, rep: Replay, batch: int,
                 s_local: int, m: int, checkpointing: str, e: int, kernel: str = "auto",
                 precision: str = "") -> list[Line]:
    """The replay's layer beside Table 2's row for the same kernel; each label says its
    precision and kernel (``precision``: the replay's, in words)."""
    attention = row_kernel(cfg, kernel)
    per, row = korthikanti_layer(s_local, batch, cfg.d_model, cfg.n_heads, par.tp,
                                 par.sp, checkpointing, attention)
    kept, _ = kept_per_layer(cfg, par, rep, batch, s_local, checkpointing, e)
    flight = _in_flight(par, st.stage, m)
    paper = f"Korthikanti et al. 2022 (16-bit, {attention} kernel)"
    return [
        Line(f"per layer: replay ({precision or f'{e} B'}, {attention} kernel)", kept,
             f"fake-tensor replay under {precision or f'{e} B activations'}: each tensor in "
             f"the dtype that run gives it", "activations"),
        Line(f"per layer: {paper}", int(per),
             f"Table 2, {row}, s={s_local}, b={batch}, h={cfg.d_model}, a={cfg.n_heads}, "
             f"t={par.tp}; every tensor 16-bit (2 B; 1 B dropout masks), GPT layer with "
             f"dropout and a 4h MLP", "activations"),
        Line(f"stage layers: {paper}", int(per * st.layers * flight),
             f"{st.layers} layers × {flight} in flight × the row above", "activations"),
    ]

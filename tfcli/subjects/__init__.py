"""Subjects: the three kinds of model every command inspects (tfcli's own configuration, the
user's ``nn.Module``, a Hugging Face configuration), and the one function that picks one from
the command-line options."""

from __future__ import annotations

from pathlib import Path


def resolve_subject(preset: str | None = None, config: Path | None = None,
                    overrides: list[str] | None = None, model: str | None = None,
                    model_args: list[str] | None = None, hf_class: str | None = None,
                    inputs: list[str] | None = None, attn_implementation: str = "auto"):
    """The Subject the options name: ``--model`` (a file/module callable, ``hf:PATH`` or
    ``hf:ORG/NAME[@REVISION]``) or
    tfcli's own model from ``--preset/--config/--set``; never both."""
    if hf_class is not None and not hf_class.strip():
        raise _error(f"--hf-class {hf_class!r}: give a Transformers model class name, e.g. "
                     f"LlamaForCausalLM")
    if model is None:
        if attn_implementation != "auto":
            raise _error("--attn-implementation applies to --model hf:PATH; tfcli's own model "
                         "chooses with --set attention=naive|sdpa")
        for option, value in (("--model-arg", model_args), ("--hf-class", hf_class),
                              ("--input", inputs)):
            if value:
                raise _error(f"{option} applies to --model; tfcli's own model takes "
                             f"--preset/--config/--set")
        from tfcli.model.config import load_config

        cfg = load_config(preset, config, overrides or [])  # before torch: bad input is instant
        from tfcli.subjects.own import OwnSubject

        return OwnSubject(cfg, preset)
    given = [o for o, v in (("--preset", preset), ("--config", config), ("--set", overrides))
             if v]
    if given:
        raise _error(f"--model with {', '.join(given)}: those configure tfcli's own model; "
                     f"give one or the other")
    if not model.startswith("hf:"):
        return _model_subject(model, model_args, hf_class, inputs, attn_implementation)
    from tfcli.subjects.hf_size import announce_depth

    with announce_depth(model[3:]):  # before torch is loaded: a deep config is named at once
        return _model_subject(model, model_args, hf_class, inputs, attn_implementation)


def _model_subject(model: str, model_args, hf_class, inputs, attn_implementation):
    from tfcli.subjects.base import parse_input

    specs = [parse_input(text) for text in inputs or []]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise _error(f"--input: {sorted({n for n in names if names.count(n) > 1})[0]!r} is "
                     f"given twice")
    if model.startswith("hf:"):
        if model_args:
            raise _error("--model-arg applies to --model FILE.py:NAME; a Hugging Face config "
                         "is configured by its config.json")
        from tfcli.subjects.hf import HFSubject

        return HFSubject(model[3:], hf_class, specs, attn_implementation)
    for option, value in (("--hf-class", hf_class),
                          ("--attn-implementation", attn_implementation != "auto")):
        if value:
            raise _error(f"{option} applies to --model hf:PATH")
    from tfcli.subjects.user import UserSubject, parse_model_args

    return UserSubject(model, parse_model_args(model_args or []), specs)


def _error(message: str):
    from tfcli.errors import TfcliError

    return TfcliError(message)

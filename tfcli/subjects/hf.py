"""A Hugging Face configuration as a Subject: ``--model hf:PATH`` (a ``config.json`` or a
directory holding one) or ``--model hf:ORG/NAME[@REVISION]`` (a model id; see hf_source for how
its config.json is found).

The Transformers model class for that configuration is built from the configuration alone:
random initialisation. tfcli reads the JSON itself and hands it to ``AutoConfig.for_model``, so
no weights are downloaded and no remote code (``auto_map``) is ever run.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import warnings

import torch
from torch import nn

from tfcli.errors import TfcliError, did_you_mean
from tfcli.subjects import hf_masks, hf_moe
from tfcli.subjects.hf_moe import is_stacked_experts
from tfcli.subjects.base import (InputSpec, Inputs, Subject, building, check_inputs_fit,
                                 error_text, fake_mode_active, make_tensors)
from tfcli.subjects.hf_size import LAYER_KEYS
from tfcli.subjects.hf_source import NEEDS_TRANSFORMERS, config_source, hub_offline


def _transformers():
    """Transformers, with the Hugging Face Hub offline: nothing tfcli asks of it may reach the
    network (a config can name a backbone to fetch)."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True  # in case it was imported before
    except ImportError:
        pass
    try:
        import transformers
    except ImportError:
        raise TfcliError(f"--model hf:...: {NEEDS_TRANSFORMERS}") from None
    transformers.logging.set_verbosity_error()  # its advice on configs is not tfcli's output
    hf_masks.install()
    return transformers


def _check_model_type(tf, model_type, path_text: str) -> None:
    """An unknown model_type in one line: Transformers' own message lists all of its several
    hundred types."""
    known = list(tf.CONFIG_MAPPING.keys())
    if isinstance(model_type, str) and model_type in known:
        return
    if not isinstance(model_type, str):
        raise TfcliError(f"--model hf:{path_text}: model_type {str(model_type)[:100]} is not "
                         f"a string; it names a Transformers model type, e.g. \"gpt2\", "
                         f"\"llama\"")
    raise TfcliError(f"--model hf:{path_text}: Transformers {tf.__version__} knows no model_type "
                     f"{model_type[:100]!r}{did_you_mean(model_type, known)}; it knows "
                     f"{len(known)}, e.g. gpt2, llama, bert, t5 (a newer version may know more)")


# Keys whose value sizes the model, by what they count. Transformers builds an empty stack from
# a layer count of -1 or 0, and from K/V heads that do not divide the query heads a model that
# fails only when run: both would be inspected as if they were sound.
# (LAYER_KEYS lives in hf_size, which reads the JSON before torch is loaded.)
SIZE_KEYS = ("hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "d_ff",
             "encoder_ffn_dim", "decoder_ffn_dim", "vocab_size", "image_size", "patch_size",
             "num_channels", "num_mel_bins", "max_source_positions")
DERIVED_KEYS = ("head_dim", "d_kv")  # 0 means "width / heads" to some model types (glm5_next)
QUERY_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
                   "decoder_attention_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads")
TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "moe_k")  # experts per token, by model type


def _check_sizes(values: dict, path_text: str, where: str = "") -> None:
    """Refuse, in one line naming the key, a layer count, size or head count that is not a
    positive integer, and K/V heads that do not divide the query heads; nested configurations
    (``text_config``, ...) too. Values that are absent, None or not integers are left to
    Transformers."""
    def number(key: str):
        value = values.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    for keys, what in ((LAYER_KEYS, "a layer count"), (SIZE_KEYS, "a size"),
                       (QUERY_HEAD_KEYS + KV_HEAD_KEYS, "a head count")):
        for key in keys:
            value = number(key)
            if value is not None and value < 1:
                raise TfcliError(f"--model hf:{path_text}: {where}{key}={value}: {what} must be "
                                 f"a positive integer")
    for key in DERIVED_KEYS:
        if number(key) is not None and number(key) < 0:
            raise TfcliError(f"--model hf:{path_text}: {where}{key}={number(key)}: a size must "
                             f"not be negative")
    heads = next((number(k) for k in QUERY_HEAD_KEYS if number(k) is not None), None)
    kv_key = next((k for k in KV_HEAD_KEYS if number(k) is not None), None)
    if heads is not None and kv_key is not None and heads % number(kv_key):
        raise TfcliError(f"--model hf:{path_text}: {where}{kv_key}={number(kv_key)} does not "
                         f"divide the {heads} query heads; each key/value head serves an equal "
                         f"group of query heads")
    for key, value in values.items():  # text_config, vision_config, ... (a few levels deep)
        if isinstance(value, dict) and key not in ("id2label", "label2id") \
                and where.count(".") < 4:
            _check_sizes(value, path_text, f"{where}{key}.")


@contextlib.contextmanager
def _no_init_on_fake():
    """Transformers initialises no weights on meta, where there are no values; under fake
    tensors there are none either, and its initialisers may read values (ViT's trunc_normal_
    draws until every value is within bounds), which a fake tensor cannot give: they are
    skipped with Transformers' own no_init_weights. Real builds are initialised as usual."""
    if not fake_mode_active():
        yield
        return
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # Transformers 4
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def _pair(config, key: str, label: str) -> tuple[int, int]:
    """(height, width) from a configuration's image or patch size: one int, or a pair."""
    value = getattr(config, key)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not 1 <= len(values) <= 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise TfcliError(f"--model {label}: {key}={str(value)[:60]}: an image size is a "
                         f"positive integer or a pair [height, width]")
    return values[0], values[-1]


class HFSubject(Subject):
    kind = "hf"
    runs_on_meta = False

    def __init__(self, path_text: str, class_name: str | None = None,
                 input_specs: list[InputSpec] | None = None,
                 attn_implementation: str = "auto") -> None:
        # The config first, while the Hub is as the user left it: only its one download may
        # go online; everything asked of Transformers afterwards stays offline.
        self.source = config_source(path_text, offline=hub_offline())
        tf = _transformers()
        path = self.source.path
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            raise TfcliError(f"--model hf:{path_text}: not valid JSON: {error}") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise TfcliError(f"--model hf:{path_text}: a Transformers config.json names its "
                             f"'model_type' (e.g. \"gpt2\", \"llama\")")
        _check_model_type(tf, data["model_type"], path_text)
        _check_sizes(data, path_text)  # as written, before Transformers divides by them
        if data.get("use_pretrained_backbone"):  # weights from the Hub: random ones instead
            data["use_pretrained_backbone"] = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.config = tf.AutoConfig.for_model(**data)
        except Exception as error:  # its validators put the reason on the following lines
            backbone = data.get("backbone")
            if isinstance(backbone, str) and not data.get("backbone_config"):
                raise TfcliError(f"--model hf:{path_text}: the config takes its backbone "
                                 f"({backbone[:100]!r}) from the Hugging Face Hub, and tfcli "
                                 f"downloads nothing; put the backbone's configuration in "
                                 f"backbone_config") from None
            raise TfcliError(f"--model hf:{path_text}: Transformers rejects this config: "
                             f"{error_text(error, whole=True)}") from None
        _check_sizes(self.config.to_dict(), path_text)  # with the model type's defaults
        # Mixture of experts: tfcli's uniform-routing replay where tensors hold no values,
        # the config's own experts implementation (Transformers' default: grouped_mm) on real
        # ones; see tfcli/subjects/hf_moe.py.
        self.experts_default = getattr(self.config, "_experts_implementation", None) \
            or "grouped_mm"
        self.use_experts(self.experts_default)
        self.has_experts = False  # known once built
        self.model_class = self._choose_class(tf, class_name, path_text)
        self.attention = self._choose_attention(attn_implementation)
        self.label = f"hf:{path_text} ({self.model_class.__name__}, {self.attention} attention)"
        self.input_specs = input_specs or []
        self.encoder_decoder = bool(getattr(self.config, "is_encoder_decoder", False))

    def _choose_class(self, tf, class_name: str | None, path_text: str):
        names = [class_name] if class_name else list(getattr(self.config, "architectures", None)
                                                     or [])
        for name in names:
            cls = getattr(tf, name, None)
            if isinstance(cls, type) and issubclass(cls, nn.Module):
                return cls
            if class_name:
                raise TfcliError(f"--hf-class {class_name!r}: Transformers has no model class "
                                 f"of that name (e.g. LlamaForCausalLM, GPT2LMHeadModel)")
        autos = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel")
        if getattr(self.config, "is_encoder_decoder", False):  # Whisper: speech to text
            autos = ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq",
                     "AutoModelForCausalLM", "AutoModel")
        for auto in autos:
            if not hasattr(tf, auto):
                continue
            mapping = getattr(tf, auto)._model_mapping
            try:
                return mapping[type(self.config)]
            except KeyError:
                continue
        raise TfcliError(f"--model hf:{path_text}: no Transformers model class for model_type "
                         f"{self.config.model_type!r}; name one with --hf-class")

    def _choose_attention(self, requested: str) -> str:
        """The attention the model will run: ``auto`` is SDPA where the model class supports it,
        else its eager attention (what Transformers itself picks when nothing is asked);
        ``sdpa`` for a class without it is refused here, before anything is built. The
        choice is set on the config (and so on every sub-config); ``auto`` leaves it to each
        sub-model, and ``build`` reads back what each one took."""
        supports_sdpa = bool(getattr(self.model_class, "_supports_sdpa", False))
        if requested == "auto" and self.config._attn_implementation == "eager":
            requested = "eager"  # the config.json asks for it (attn_implementation)
        if requested == "auto":
            self.config._attn_implementation = None
            return "sdpa" if supports_sdpa else "eager"
        if requested == "sdpa" and not supports_sdpa:
            raise TfcliError(f"--attn-implementation sdpa: Transformers' "
                             f"{self.model_class.__name__} has no scaled_dot_product_attention "
                             f"path; use eager (or auto, which picks eager for it)")
        self.config._attn_implementation = requested
        return requested

    def build(self, device="meta", dtype=None, kernel=None) -> nn.Module:
        if not getattr(self, "_size_checked", False):  # once: builds repeat within a command
            from tfcli.subjects.hf_size import check_module_count

            check_module_count(self.model_class, self.config, LAYER_KEYS, self.label)
            self._size_checked = True
        try:
            with building(device, dtype), _no_init_on_fake():
                model = self.model_class(self.config)
            if fake_mode_active():
                model.tie_weights()  # what post_init does after initialising
        except Exception as error:
            if not (fake_mode_active() and "DataDependent" in type(error).__name__):
                raise TfcliError(f"--model {self.label}: building it raised "
                                 f"{error_text(error, whole=True)}") from None
            model = self._build_on_meta_as_fake(device, dtype)
        self.has_experts = any(is_stacked_experts(m) for m in model.modules())
        self.attention_by_model = _attention_taken(model)
        if self.attention != "none" and not _has_attention_module(model):
            # Transformers' flag says eager for a model with no attention at all (ConvNeXt,
            # Mamba): name what it is instead
            self.label = self.label.replace(f", {self.attention} attention)",
                                            ", no attention module)")
            self.attention = "none"
        return model

    def _build_on_meta_as_fake(self, device, dtype) -> nn.Module:
        """A model whose constructor reads values of tensors it makes (ConvNeXt's drop-path
        rates, ``torch.linspace(...).tolist()``) cannot be built under fake tensors: build it
        on meta, where such tensors are real, and make its parameters and buffers fake ones
        on ``device`` (each tied tensor once)."""
        from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        mode = next(m for m in _get_current_dispatch_mode_stack()
                    if isinstance(m, FakeTensorMode))
        try:
            with unset_fake_temporarily(), building("meta", dtype):
                model = self.model_class(self.config)
        except Exception as error:
            raise TfcliError(f"--model {self.label}: building it raised "
                             f"{error_text(error, whole=True)}") from None
        made: dict[int, torch.Tensor] = {}

        def fake(t: torch.Tensor, parameter: bool) -> torch.Tensor:
            if id(t) not in made:
                out = mode.fake_tensor_converter.from_meta_and_device(mode, t,
                                                                      torch.device(device))
                made[id(t)] = nn.Parameter(out, t.requires_grad) if parameter else out
            return made[id(t)]

        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = fake(p, True)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = fake(b, False)
        return model

    def use_experts(self, real: str) -> None:
        """Run real tensors through Transformers' experts implementation ``real`` (tensors
        without values through tfcli's replay, whichever it is); models built before and
        after both follow it, as Transformers reads the name at every call."""
        name = hf_moe.install(real)
        self.experts_real = real
        if name is not None:
            self.config._experts_implementation = name

    def count_natively(self) -> None:
        self.use_experts("eager")  # a loop of F.linear over the experts: FlopCounterMode sees it

    def experts_per_token(self) -> int | None:
        return next((v for v in (getattr(self.config, key, None) for key in TOP_K_KEYS)
                     if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)

    def assumptions(self, sizes: dict[str, int] | None = None) -> list[str]:
        out = []
        if self.has_experts and hf_moe.replays_grouped(self.experts_real):
            out.append("mixture of experts: the experts replayed as Transformers' grouped_mm "
                       "runs them, one grouped product over the B·L·k token slots (its memory "
                       "does not depend on the routing)")
        elif self.has_experts:
            out.append("mixture of experts: routing assumed uniform, each of E experts gets "
                       "B·L·k/E token slots (the experts' FLOPs and saved activations do not "
                       "depend on it; the eager loop's backward working set can)")
        if sizes and self._interpolates(sizes):
            h, w = self._image_size()
            out.append(f"images of {sizes['H']} x {sizes['W']}, not the configuration's "
                       f"image_size {h} x {w}: called with interpolate_pos_encoding=True, its "
                       f"position embeddings interpolated to the new grid of patches")
        return out

    def _interpolates(self, sizes: dict[str, int]) -> bool:
        """Whether an image input at ``sizes`` is another size than the configuration's, so
        that the model is called with interpolate_pos_encoding=True."""
        return ("H" in self.length_dims() and "H" in sizes and "W" in sizes
                and "interpolate_pos_encoding" in inspect.signature(
                    self.model_class.forward).parameters
                and (sizes["H"], sizes["W"]) != self._image_size())

    # --- inputs, by what the model takes -------------------------------------------------------
    # A Transformers model class names its main input (``main_input_name``): token ids, an
    # image (``pixel_values [B, C, H, W]``) or speech features (``input_features``). tfcli makes
    # that input at the sizes the configuration gives, and a decoder's ids for an
    # encoder-decoder; two-tower models (CLIP) get an image beside their text.

    def _main_input(self) -> str:
        return getattr(self.model_class, "main_input_name", None) or "input_ids"

    def _vision(self):
        """The configuration that sizes the image input: the model's own, or its
        vision_config (CLIP, SigLIP)."""
        for c in (self.config, getattr(self.config, "vision_config", None)):
            if c is not None and getattr(c, "image_size", None) is not None:
                return c
        return None

    def _image_size(self) -> tuple[int, int]:
        return _pair(self._vision(), "image_size", self.label)

    def _patch(self) -> tuple[int, int] | None:
        if getattr(self._vision(), "patch_size", None) is None:
            return None
        return _pair(self._vision(), "patch_size", self.label)

    def _channels(self) -> int:
        channels = getattr(self._vision(), "num_channels", None)
        return channels if isinstance(channels, int) and channels > 0 else 3

    def _mel_bins(self) -> int | None:
        bins = getattr(self.config, "num_mel_bins", None)
        return bins if isinstance(bins, int) and bins > 0 else None

    def _speech_frames(self) -> int | None:
        """The one length of Whisper-style input features: its encoder's two convolutions
        (the second of stride 2) must give exactly max_source_positions positions."""
        positions = getattr(self.config, "max_source_positions", None)
        return 2 * positions if isinstance(positions, int) and positions > 0 else None

    def _specs(self) -> list[InputSpec]:
        main = self._main_input()
        text = getattr(self.config, "vocab_size", None) is not None
        if main == "pixel_values" and self._vision() is not None:
            specs = [InputSpec("pixel_values", "float32", ("B", "C", "H", "W"))]
        elif main == "input_features" and self._mel_bins() and self._speech_frames():
            specs = [InputSpec("input_features", "float32", ("B", "F", "N"))]
        elif main == "input_ids":
            if self.encoder_decoder:
                return [InputSpec("input_ids", "int64", ("B", "S")),
                        InputSpec("attention_mask", "int64", ("B", "S"), 2),
                        InputSpec("decoder_input_ids", "int64", ("B", "T"))]
            specs = [InputSpec("input_ids", "int64", ("B", "L")),
                     InputSpec("attention_mask", "int64", ("B", "L"), 2)]
            if self._vision() is not None and self._vision() is not self.config \
                    and "pixel_values" in self._forward_params() and not any(
                    hasattr(self.config, k) for k in ("image_token_id", "image_token_index")):
                specs.append(InputSpec("pixel_values", "float32", ("B", "C", "H", "W")))
            return specs
        else:
            raise TfcliError(
                f"--model {self.label}: it takes {main}, and tfcli makes only input_ids (text), "
                f"pixel_values (images, from a config with image_size) and input_features "
                f"(Whisper's layout, from a config with num_mel_bins and "
                f"max_source_positions); describe it with --input {main}=DTYPE[DIMS]")
        if self.encoder_decoder and text:
            specs.append(InputSpec("decoder_input_ids", "int64", ("B", "T")))
        return specs

    def _forward_params(self) -> set[str]:
        try:
            return set(inspect.signature(self.model_class.forward).parameters)
        except (TypeError, ValueError):
            return set()

    @property
    def default_sizes(self) -> dict[str, int]:
        """B, S, T, L as for any model; C, H, W, F and N as the configuration gives them."""
        sizes = dict(Subject.default_sizes)
        if self._vision() is not None:
            sizes["C"] = self._channels()
            sizes["H"], sizes["W"] = self._image_size()
        if self._mel_bins() and self._speech_frames():
            sizes["F"], sizes["N"] = self._mel_bins(), self._speech_frames()
        return sizes

    def fixed_dims(self) -> dict[str, tuple[int, str]]:
        if self.input_specs:
            return {}
        letters = set(self.dims_used())
        sizes = self.default_sizes
        fixed = {"C": f"the model's first layer takes num_channels={sizes.get('C')} channels",
                 "F": f"the model takes num_mel_bins={sizes.get('F')} mel bins",
                 "N": f"Whisper's encoder takes exactly 2 × max_source_positions = "
                      f"{sizes.get('N')} frames (its two convolutions, the second of stride 2, "
                      f"make them its {sizes.get('N', 0) // 2} positions)"}
        return {k: (sizes[k], why) for k, why in fixed.items() if k in letters}

    def derived_dims(self, sizes: dict[str, int]) -> dict[str, int]:
        """P, the patches of an image (H/p × W/p for a patch size p); S, the positions
        Whisper's encoder makes of its N frames."""
        letters = set(self.dims_used())
        out = {}
        if {"H", "W"} <= letters and self._patch() and "H" in sizes and "W" in sizes:
            (p_h, p_w) = self._patch()
            out["P"] = (sizes["H"] // p_h) * (sizes["W"] // p_w)
        if "N" in letters and "N" in sizes:
            out["S"] = sizes["N"] // 2
        return out

    def unmasked_lengths(self, sizes: dict[str, int]) -> dict[str, tuple[int, str, str]]:
        """The patches of the image tower, with or without a class token (ViT and CLIP
        prepend one, SigLIP none: both lengths are offered, the call's length picks), and
        the positions Whisper's encoder makes of its frames. Transformers gives neither a
        mask argument."""
        if self.input_specs:  # the user's --input describes the model: nothing known here
            return {}
        derived, out = self.derived_dims(sizes), {}
        if "P" in derived:
            out["P"] = (derived["P"], "vision tower", "image patches")
            out["P+1"] = (derived["P"] + 1, "vision tower", "image patches and a class token")
        if "N" in self.dims_used() and "S" in derived:
            out["S"] = (derived["S"], "audio encoder", "audio frames after its convolutions")
        return out

    def tokens(self, sizes: dict[str, int]) -> int:
        derived = self.derived_dims(sizes)
        if "P" in derived and self.length_dims() == ["H", "W"]:
            return sizes["B"] * derived["P"]  # an image is its patches
        return super().tokens(sizes)

    def make_inputs(self, model, sizes, device="meta", seed=0) -> Inputs:
        if self.input_specs:
            check_inputs_fit(model, [s.name for s in self.input_specs])
            return Inputs((), make_tensors(self.input_specs, sizes, device, self.vocab, seed))
        specs = self._specs()
        tensors = make_tensors(specs, sizes, device, self.vocab, seed)
        if "attention_mask" in tensors:
            tensors["attention_mask"] = torch.ones_like(tensors["attention_mask"])  # no padding
        accepts = set(inspect.signature(model.forward).parameters)
        kwargs = {k: v for k, v in tensors.items() if k in accepts or k == specs[0].name}
        if "use_cache" in accepts:
            kwargs["use_cache"] = False  # a cache is inference state, not part of one pass
        if "pixel_values" in kwargs and "interpolate_pos_encoding" in accepts \
                and (sizes["H"], sizes["W"]) != self._image_size():
            kwargs["interpolate_pos_encoding"] = True  # positions for another image size
        return _MadeInputs((), kwargs)

    # --- the loss a training step computes ---------------------------------------------------
    # A Transformers language model computes its own loss when given labels, as people train
    # it (``model(input_ids=x, labels=x).loss``): the logits cast to fp32, shifted one position
    # for a causal model, cross-entropy over the vocabulary. What that keeps for backward (an
    # fp32 log-softmax of B·L·V) is part of the step, so the replay passes the labels too.

    _LM_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForMaskedLM")
    _CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ForImageClassification")

    def _labels_from(self) -> str | None:
        """What the labels of the model's own loss are: an input whose tokens they are
        (a language model's ids, a sequence-to-sequence model's decoder ids), "classes" (one
        class per example, for a classifier of two or more labels), or None where tfcli knows
        no labels for the class or the user chose the inputs (--input: labels among them are
        theirs)."""
        if self.input_specs:
            return None
        try:
            takes = inspect.signature(self.model_class.forward).parameters
        except (TypeError, ValueError):
            return None
        if "labels" not in takes:
            return None
        name = self.model_class.__name__
        if self.encoder_decoder and name.endswith("ForConditionalGeneration"):
            main = [s.name for s in self._specs()]
            return "decoder_input_ids" if "decoder_input_ids" in main else None
        if name.endswith(self._LM_SUFFIXES) and self._main_input() == "input_ids":
            return "input_ids"
        if name.endswith(self._CLASSIFIER_SUFFIXES) \
                and (getattr(self.config, "num_labels", 0) or 0) > 1:
            return "classes"  # one label regresses (MSE on float labels): not assumed
        return None

    def step_inputs(self, model, sizes, device="meta", seed=0) -> Inputs:
        inputs = self.make_inputs(model, sizes, device, seed)
        source = self._labels_from()
        main = inputs.kwargs.get(self._main_input())
        if source == "classes" and isinstance(main, torch.Tensor):
            inputs.kwargs["labels"] = torch.zeros(main.shape[0], dtype=torch.long,
                                                  device=main.device)
        elif source is not None and source in inputs.kwargs:
            inputs.kwargs["labels"] = inputs.kwargs[source]  # the same tensor, as a loop passes it
        return inputs

    def loss_name(self) -> str:
        source = self._labels_from()
        if source == "classes":
            return "the model's own loss (labels: one class per example)"
        if source is not None:
            return f"the model's own loss (labels = {source})"
        if self.input_specs:
            return super().loss_name()
        return "mean-square loss on the output (a stand-in: no labels known for " \
               f"{self.model_class.__name__})"

    def input_dims(self, name: str) -> tuple | None:
        if self.input_specs:
            return super().input_dims(name)
        dims = {s.name: s.dims for s in self._specs()}
        if "decoder_input_ids" in dims:
            dims["decoder_attention_mask"] = ("B", "T")
        return dims.get(name)

    @property
    def vocab(self) -> int:
        return int(getattr(self.config, "vocab_size", 0) or 2)

    def length_dims(self) -> list[str]:
        """The letters a sweep grows: the text's lengths, else an image's sides (H and W
        together); not Whisper's frames, which its encoder fixes."""
        if self.input_specs:
            letters = [d for s in self.input_specs for d in s.dims if d in ("S", "T", "L")]
            return list(dict.fromkeys(letters))
        used = self.dims_used()
        return [d for d in ("S", "T", "L") if d in used] or [d for d in ("H", "W") if d in used]

    def dims_used(self) -> list[str]:
        specs = self.input_specs or self._specs()
        return list(dict.fromkeys(d for s in specs for d in s.dims if isinstance(d, str)))

    def model_dims(self, model=None) -> dict[str, int]:
        c = self.config
        names: dict[str, int] = {}

        def first(*attrs):
            for a in attrs:
                value = getattr(c, a, None)
                if isinstance(value, int) and value > 0:
                    return value
            return None

        d_model = first("hidden_size", "n_embd", "d_model")
        heads = first("num_attention_heads", "n_head", "encoder_attention_heads")
        kv = first("num_key_value_heads")
        d_ff = first("intermediate_size", "n_inner", "d_ff", "encoder_ffn_dim", "ffn_dim")
        if d_ff is None and getattr(c, "model_type", "") == "gpt2" and d_model:
            d_ff = 4 * d_model  # GPT-2's n_inner=None means 4 × n_embd
        head_dim = first("head_dim", "d_kv") or (d_model // heads if d_model and heads else None)
        for key, value in (("h", heads), ("h_kv", kv if kv != heads else None), ("d_k", head_dim),
                           ("d_model", d_model), ("d_ff", d_ff), ("V", first("vocab_size"))):
            if value:
                names[key] = value
        return names

    def describe(self) -> dict:
        out = {**super().describe(), "class": self.model_class.__name__,
               "model_type": self.config.model_type, "attention": self.attention,
               "config_file": str(self.source.path), "config_from": self.source.origin}
        if len(set(getattr(self, "attention_by_model", {}).values())) > 1:
            out["attention_by_model"] = self.attention_by_model  # a tower took another
        if self.has_experts:
            out["experts_implementation"] = {"real_tensors": self.experts_real,
                                             "transformers_runs": self.experts_default,
                                             "meta_and_fake_tensors": (
                                                 hf_moe.GROUPED_REPLAY
                                                 if hf_moe.replays_grouped(self.experts_real)
                                                 else hf_moe.REPLAY)}
        return out


def _has_attention_module(model: nn.Module) -> bool:
    """Whether any module of ``model`` is an attention by its class name, as every attention
    in Transformers is named (LlamaAttention, ViTSelfAttention, LSHSelfAttention,
    nn.MultiheadAttention…); an attention-free model (a convolution or state-space stack, FNet's
    Fourier mixing) has none."""
    return any("Attention" in type(m).__name__ or "Attn" in type(m).__name__
               for m in model.modules())


class _MadeInputs(Inputs):
    """Inputs tfcli made for a Transformers model (its attention mask all ones, its positions
    the model's own): on fake or meta tensors, Transformers leaves out the masks it would
    leave out on a real batch without padding (see hf_masks)."""

    def call(self, model: nn.Module):
        with hf_masks.no_padding():
            return super().call(model)


def _attention_taken(model: nn.Module) -> dict[str, str]:
    """The attention implementation each Transformers (sub-)model of ``model`` took when
    built, by module name ("" for the model itself)."""
    taken = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if isinstance(implementation, str) and hasattr(module, "_supports_sdpa"):
            taken[name] = implementation
    return taken

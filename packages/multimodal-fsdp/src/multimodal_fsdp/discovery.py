"""Find the modality towers and multimodal projectors of a vision/audio-language model.

Sharding frameworks treat these modules differently from the text decoder (their own FSDP
unit, their own mixed-precision policy, often frozen), so they need to be located by
qualified name in an arbitrary ``nn.Module`` tree.

A submodule matches by its *name* when the attribute name under which it is registered (the
last component of its qualified name) is a known tower or projector name. Where names fail
(towers registered as plain ``encoder``, embedders bundled under a text model's embedding),
*structural* rules match what transformers models expose, without naming any model: a
model built from an enclosing model's media sub-config (``vision_config``, ``audio_config``,
an ``encoder`` config of a vision or audio type), a model whose ``main_input_name`` is a
media input, a child encoder taking media (or a projector taking a tower's output) and no
text right where media meets text, and a module holding nothing but two or more towers.
A structural match that shares (ties) a parameter with the rest of the model is dropped.
Each result records the rule that matched. Three rules decide which matches are reported:

* **Maximality** -- the walk is ``model.named_modules()`` in pre-order, and a match hides its
  whole subtree, so ``model.vision_tower`` is reported but ``model.vision_tower.vision_model``
  is not, and a tower's internal ``merger`` (Qwen2-VL) is never mistaken for a projector.
* **Repeated-block guard** -- nothing inside a *numbered item* of an ``nn.ModuleList``,
  ``nn.Sequential`` or ``nn.ModuleDict`` (a child registered under an integer key such as
  ``layers.3``) can match. Such items are one of N identical blocks (decoder layers,
  cross-attention layers, resampler stages); a modality tower or projector is a singleton
  wired in by attribute, never the inside of the k-th layer of a stack. This is structural,
  so it covers decoder layers whatever the language model is called (``model.layers.N``,
  ``transformer.h.N``, Mllama's ``language_model.layers.N.cross_attn``).
* **Language-model guard** -- nothing strictly below a module registered under a
  language-model name (:data:`LANGUAGE_MODEL_NAMES`, e.g. ``language_model``) can match,
  nor anything in a model built from an enclosing model's text or decoder sub-config, so
  helper modules that a text decoder keeps outside its layer stack are not mistaken for
  towers either.

The root module is never reported: discovery is about parts of a model, not the model.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from fsdp_core.containers import unwrap_module
from multimodal_fsdp.validation import check_attribute_names, check_module_paths

__all__ = [
    "LANGUAGE_MODEL_NAMES",
    "MEDIA_FEATURE_INPUTS",
    "MEDIA_INPUTS",
    "MULTIMODAL_MODULE_NAMES",
    "MULTIMODAL_PROJECTOR_NAMES",
    "MULTIMODAL_TOWER_NAMES",
    "Modality",
    "MultimodalModule",
    "Role",
    "is_multimodal_module_name",
    "iter_multimodal_modules",
    "resolve_multimodal_modules",
]

logger = logging.getLogger(__name__)

Role = Literal["tower", "projector"]
Modality = Literal["vision", "audio", "video", "unknown"]

# Tower name -> modality. The reference implementation's names come first, in its order
# (the exported tuples start with the reference's), model-specific names (with the family
# that uses them) after.
_TOWER_MODALITY: Mapping[str, Modality] = {
    # Generic vision towers: Qwen*-VL / GLM-4V / Omni thinkers ("visual"); LLaVA family,
    # Gemma 3/4, InternVL, PaliGemma, Mistral3 ("vision_tower"); Idefics*, SmolVLM, Mllama,
    # Llama 4, BLIP-2, Kosmos-2, DeepSeek-VL ("vision_model"); LightOnOCR ("vision_encoder");
    # GIT ("image_encoder"); "vit_model" is common outside transformers.
    "visual": "vision",
    "vision_tower": "vision",
    "vision_model": "vision",
    "vit_model": "vision",
    "image_encoder": "vision",
    "vision_encoder": "vision",
    # Generic audio towers: Qwen2-Audio, Voxtral, Gemma 4, Omni thinkers ("audio_tower").
    "audio_tower": "audio",
    "audio_encoder": "audio",
    "audio_model": "audio",
    # Video-LLaVA keeps separate image and video towers.
    "image_tower": "vision",
    "video_tower": "video",
    # SeamlessM4T speech-to-text.
    "speech_encoder": "audio",
    # DeepSeek-VL hybrid: SAM high-resolution encoder and its neck.
    "high_res_vision_model": "vision",
    "high_res_vision_neck": "vision",
    # Discrete image tokenizers (VQ-VAE): Chameleon, Emu3, Janus, GLM-Image, Apertus 1.5.
    "vqmodel": "vision",
    "vision_tokenizer": "vision",
    # Discrete / continuous audio tokenizers: Apertus 1.5, VibeVoice, Kyutai STT, CSM.
    "audio_tokenizer": "audio",
    "acoustic_tokenizer_encoder": "audio",
    "semantic_tokenizer_encoder": "audio",
    "codec_model": "audio",
    # Phi-4-multimodal: encoder + projection bundled under the text model's embedding.
    "image_embed": "vision",
    "audio_embed": "audio",
}

# Projector name -> modality ("unknown" = modality-neutral name; the resolver infers it
# from sibling towers, see ``_infer_projector_modality``).
_PROJECTOR_MODALITY: Mapping[str, Modality] = {
    # Gemma 3n / Gemma 4 embedders.
    "embed_vision": "vision",
    "embed_audio": "audio",
    # LLaVA-style names (most VLMs and audio LMs in transformers use the second one).
    "mm_projector": "unknown",
    "multi_modal_projector": "unknown",
    "multimodal_projector": "unknown",
    # Reference-table names: Step3 ("vit_large_projector"); the other two are common
    # outside transformers.
    "vision_projector": "vision",
    "vit_large_projector": "vision",
    "audio_projector": "audio",
    # DeepSeek-VL / Janus ("aligner"), Idefics2/3 and SmolVLM ("connector"), MiniCPM-V
    # ("merger" next to the tower; Qwen's merger lives inside the tower and stays hidden),
    # VideoLLaMA3 / PaddleOCR-VL / Granite Speech / Cosmos3 ("projector").
    "aligner": "unknown",
    "connector": "unknown",
    "merger": "unknown",
    "projector": "unknown",
    # BLIP-2 / InstructBLIP: Q-Former plus the linear map into the language model.
    "qformer": "unknown",
    "language_projection": "unknown",
    # Kosmos-2, LightOnOCR / Muse, Fuyu (patch projection straight into the decoder).
    "image_to_text_projection": "vision",
    "vision_projection": "vision",
    # GIT: image features into the text embedding space.
    "visual_projection": "vision",
    "vision_embed_tokens": "vision",
    # Muse adapters, LLaVA-NeXT-Video pooler, ERNIE-4.5-VL resampler.
    "vision_adapter": "vision",
    "vision_resampler": "vision",
    "resampler_model": "unknown",
    # Ovis2 visual embedding table, Janus generation aligner, DeepSeek-VL hybrid SAM proj.
    "visual_embeddings_table": "vision",
    "generation_aligner": "vision",
    "high_res_vision_proj": "vision",
    # VibeVoice semantic connector.
    "semantic_connector": "audio",
    # Granite 4 Vision deepstack / spatial projector stacks (ModuleLists of projectors).
    "layerwise_projectors": "vision",
    "spatial_projectors": "vision",
}

MULTIMODAL_TOWER_NAMES: tuple[str, ...] = tuple(_TOWER_MODALITY)
"""Attribute names under which models register modality encoders (towers)."""

MULTIMODAL_PROJECTOR_NAMES: tuple[str, ...] = tuple(_PROJECTOR_MODALITY)
"""Attribute names under which models register modality-to-text projectors."""

MULTIMODAL_MODULE_NAMES: tuple[str, ...] = MULTIMODAL_TOWER_NAMES + MULTIMODAL_PROJECTOR_NAMES
"""Towers first, then projectors."""

LANGUAGE_MODEL_NAMES: tuple[str, ...] = ("language_model", "text_model", "text_decoder", "llm")
"""Attribute names of text decoders; nothing strictly below them is a tower or projector.

A whole VLM registered under one of these names would therefore be hidden; pass the inner
model itself to discovery in that case.
"""

_BLOCK_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

# Keyword -> modality, for names the user adds (built-in names use the tables above).
_MODALITY_KEYWORDS: tuple[tuple[str, Modality], ...] = (
    ("video", "video"),
    ("audio", "audio"),
    ("speech", "audio"),
    ("acoustic", "audio"),
    ("whisper", "audio"),
    ("wav", "audio"),
    ("vision", "vision"),
    ("visual", "vision"),
    ("image", "vision"),
    ("img", "vision"),
    ("vit", "vision"),
    ("pixel", "vision"),
)


# The subset that names an input modality in a sub-config attribute. "wav" is left out:
# it also names output vocoders (a ``token2wav`` speech generator is not a tower).
_INPUT_MODALITY_KEYWORDS: tuple[tuple[str, Modality], ...] = tuple(
    (keyword, modality)
    for keyword, modality in _MODALITY_KEYWORDS
    if keyword in ("video", "audio", "speech", "acoustic", "vision", "visual", "image")
)


@dataclass(frozen=True)
class MultimodalModule:
    """One discovered tower or projector.

    ``modality`` comes from the matched name (caller-supplied names are read for keywords
    such as "audio" or "image"); a modality-neutral projector name such as
    ``multi_modal_projector`` takes the modality of the towers registered beside it, and is
    "unknown" when they disagree (Video-LLaVA) or there are none. ``rule`` records why it
    matched, so that surprising results can be traced: ``"name:<attr>"`` for a built-in
    name, ``"extra:<attr>"`` for a caller-supplied one, or a structural rule:
    ``"config:<sub-config attribute>"``, ``"main_input:<arg>"``, ``"forward:<arg>"``,
    ``"features:<arg>"`` or ``"bundle:<child>+<child>"``.
    """

    path: str
    module: nn.Module
    role: Role
    modality: Modality
    rule: str


@dataclass(frozen=True)
class _Rule:
    role: Role
    modality: Modality
    label: str


def _builtin_rules() -> dict[str, _Rule]:
    rules = {name: _Rule("tower", mod, f"name:{name}") for name, mod in _TOWER_MODALITY.items()}
    for name, modality in _PROJECTOR_MODALITY.items():
        rules[name] = _Rule("projector", modality, f"name:{name}")
    return rules


_BUILTIN_RULES: Mapping[str, _Rule] = _builtin_rules()


def is_multimodal_module_name(name: str) -> bool:
    """Whether the last component of a (possibly dotted) qualified name is a known name.

    Only the name is checked; the structural guards of :func:`iter_multimodal_modules` need
    the module tree and are not applied here.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}: {name!r}")
    return name.rpartition(".")[2] in _BUILTIN_RULES


def iter_multimodal_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(qualified_name, module)`` for the maximal towers and projectors of ``model``.

    Same walk and rules (names and structure) as :func:`resolve_multimodal_modules` with no
    extra names or excludes; results come in ``named_modules()`` pre-order.
    """
    _check_model(model)
    found = _walk(model, _BUILTIN_RULES, frozenset(), structural=True)
    return iter([(item.path, item.module) for item in found])


def resolve_multimodal_modules(
    model: nn.Module,
    *,
    extra_tower_names: Iterable[str] = (),
    extra_projector_names: Iterable[str] = (),
    exclude: Iterable[str] = (),
    structural: bool = True,
) -> tuple[MultimodalModule, ...]:
    """Return the maximal towers and projectors of ``model`` with their role and modality.

    ``extra_tower_names`` / ``extra_projector_names`` add attribute names (not dotted paths)
    for models whose towers use names this module does not know; they obey the same
    maximality and guard rules as the built-in names. ``exclude`` lists qualified paths
    whose whole subtree is skipped; every entry must name a module of ``model`` (as reported
    by ``named_modules()``), otherwise a ``ValueError`` names it, so a typo cannot silently
    disable the exclusion. ``structural=False`` turns off the rules that look past names
    (media inputs, sub-configs, forward signatures, bundles), leaving name matching only.
    """
    _check_model(model)
    if not isinstance(structural, bool):
        raise TypeError(f"structural must be a bool (True or False), got {structural!r}")
    rules = dict(_BUILTIN_RULES)
    extra_towers = check_attribute_names(extra_tower_names, "extra_tower_names")
    extra_projectors = check_attribute_names(extra_projector_names, "extra_projector_names")
    both = sorted(set(extra_towers) & set(extra_projectors))
    if both:
        raise ValueError(f"names given as both extra tower and extra projector names: {both}")
    extras: tuple[tuple[Role, tuple[str, ...]], ...] = (
        ("tower", extra_towers),
        ("projector", extra_projectors),
    )
    for role, names in extras:
        for name in names:
            builtin = _BUILTIN_RULES.get(name)
            if builtin is None:
                rules[name] = _Rule(role, _modality_from_keywords(name), f"extra:{name}")
            elif builtin.role != role:
                raise ValueError(
                    f"{name!r} is already a built-in {builtin.role} name; "
                    f"it cannot also be an extra {role} name"
                )
    excluded = frozenset(check_module_paths(exclude))
    seen_excludes: set[str] = set()
    found = tuple(_walk(model, rules, excluded, seen_excludes, structural=structural))
    unmatched = sorted(excluded - seen_excludes)
    if unmatched:
        raise ValueError(
            f"exclude paths {unmatched} do not name any submodule of "
            f"{type(model).__name__} (paths are qualified names from named_modules())"
        )
    return found


def _walk(
    model: nn.Module,
    rules: Mapping[str, _Rule],
    excluded: frozenset[str],
    seen_excludes: set[str] | None = None,
    *,
    structural: bool,
) -> list[MultimodalModule]:
    """The single pre-order walk behind both public entry points.

    ``closed`` holds, for every visited path, whether its subtree is already decided:
    it was matched, excluded, or is inside a guarded region (repeated block or language
    model). Parents are always visited before children, so one dict lookup per module
    propagates the state without re-scanning ancestors. ``subconfigs`` maps each sub-config
    object of an open model's config to the attribute it is stored under, so a submodule
    built from it can be recognised by identity.
    """
    closed: dict[str, bool] = {}
    modules: dict[str, nn.Module] = {}
    subconfigs: dict[int, tuple[str, object]] = {}
    uses: dict[int, int] = {}  # parameter id -> registrations in the model, filled on demand
    found: list[MultimodalModule] = []
    for path, module in model.named_modules():
        modules[path] = module
        if not path:
            closed[path] = False
            if structural:
                _register_subconfigs(unwrap_module(module), subconfigs)
            continue
        parent_path, _, name = path.rpartition(".")
        if path in excluded:
            if seen_excludes is not None:
                seen_excludes.add(path)
            logger.debug("skipping excluded subtree %s", path)
            closed[path] = True
            continue
        if closed[parent_path]:
            closed[path] = True
            continue
        parent = modules[parent_path]
        if isinstance(parent, _BLOCK_CONTAINERS) and name.isdecimal():
            # Entering the k-th block of a stack: nothing in here is a tower.
            closed[path] = True
            continue
        match = _match_name(path, module, parent, name, rules)
        if match is None and structural:
            if _is_text_model(unwrap_module(module), subconfigs):
                logger.debug("language model by its config: %s", path)
                closed[path] = True
                continue
            match = _match_structure(path, module, parent, subconfigs)
            if match is not None and _shares_parameters(model, path, module, uses):
                logger.debug("not a tower, shares parameters outside itself: %s", path)
                match = None
        if match is not None:
            closed[path] = True
            logger.debug("found %s %s (%s, %s)", match.role, path, match.modality, match.rule)
            found.append(match)
            continue
        # Entering a language model: its descendants are never candidates.
        closed[path] = name in LANGUAGE_MODEL_NAMES
        if structural and not closed[path]:
            _register_subconfigs(unwrap_module(module), subconfigs)
    if structural:
        found = _absorb_bundles(model, found)
    return found


def _match_name(
    path: str, module: nn.Module, parent: nn.Module, name: str, rules: Mapping[str, _Rule]
) -> MultimodalModule | None:
    """The name rule: the attribute name is a known (or caller-supplied) name."""
    rule = rules.get(name)
    if rule is None:
        return None
    modality = rule.modality
    if rule.role == "projector" and modality == "unknown":
        modality = _infer_projector_modality(parent, rules)
    return MultimodalModule(path, module, rule.role, modality, rule.label)


def _infer_projector_modality(parent: nn.Module, rules: Mapping[str, _Rule]) -> Modality:
    """Modality of a neutrally named projector, taken from the towers next to it.

    A projector maps the output of the towers registered beside it (LLaVA's
    ``multi_modal_projector`` sits next to ``vision_tower``, Qwen2-Audio's next to
    ``audio_tower``). When those towers disagree or are absent the answer is "unknown".
    """
    modalities = {
        rule.modality
        for child_name, _ in parent.named_children()
        if (rule := rules.get(child_name)) is not None and rule.role == "tower"
    }
    modalities.discard("unknown")
    if len(modalities) == 1:
        return modalities.pop()
    return "unknown"


# --- structural rules ----------------------------------------------------------------------

MEDIA_INPUTS: Mapping[str, Modality] = {
    "pixel_values": "vision",
    "pixel_values_images": "vision",
    "image_pixel_values": "vision",
    "flattened_patches": "vision",
    "images": "vision",
    "pixel_values_videos": "video",
    "videos": "video",
    "input_features": "audio",
    "input_values": "audio",
    "audio_values": "audio",
    "audio_input_features": "audio",
    "input_audio_features": "audio",
}
"""Forward arguments (and ``main_input_name`` values) that carry raw media, by modality."""

MEDIA_FEATURE_INPUTS: Mapping[str, Modality] = {
    "image_features": "vision",
    "vision_features": "vision",
    "video_features": "video",
    "audio_features": "audio",
}
"""Forward arguments that carry a tower's output: a module taking only these is a projector."""

# Arguments that only a text model (or a model containing one) takes. A cross-attending
# decoder takes ``encoder_hidden_states``; a sequence-to-sequence model takes ``decoder_*``.
_TEXT_INPUTS = frozenset({"input_ids", "inputs_embeds", "encoder_hidden_states"})

# Sub-config attribute names (without ``_config``) whose module is the text model.
_TEXT_CONFIG_ATTRS = frozenset({"text", "decoder", "language", "llm", "text_decoder"})


_FORWARD_ARGUMENTS: dict[type, frozenset[str]] = {}


def _forward_arguments(module: nn.Module) -> frozenset[str]:
    """Names of the parameters of ``forward`` (empty when it cannot be inspected).

    Cached per class: a model walk asks once per module and classes repeat a lot.
    """
    cls = type(module)
    arguments = _FORWARD_ARGUMENTS.get(cls)
    if arguments is None:
        try:
            arguments = frozenset(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError):
            arguments = frozenset()
        _FORWARD_ARGUMENTS[cls] = arguments
    return arguments


def _takes_text(arguments: frozenset[str]) -> bool:
    return bool(arguments & _TEXT_INPUTS) or any(a.startswith("decoder_") for a in arguments)


def _first_media(arguments: frozenset[str], table: Mapping[str, Modality]) -> str | None:
    """The first argument of ``table`` (in table order) that ``arguments`` contains."""
    return next((name for name in table if name in arguments), None)


def _model_config(module: nn.Module) -> object | None:
    """The config of a transformers-style model: it has a ``main_input_name`` and a config.

    Duck-typed, so that discovery does not import transformers.
    """
    if not isinstance(getattr(module, "main_input_name", None), str):
        return None
    return getattr(module, "config", None)


def _is_config(value: object) -> bool:
    return hasattr(value, "model_type") and callable(getattr(value, "to_dict", None))


def _register_subconfigs(module: nn.Module, subconfigs: dict[int, tuple[str, object]]) -> None:
    """Remember the sub-configs of ``module``'s config under their attribute names."""
    config = _model_config(module)
    if config is None or not hasattr(config, "__dict__"):
        return
    for attr, value in vars(config).items():
        if _is_config(value):
            subconfigs.setdefault(id(value), (attr, value))


def _subconfig_attr(module: nn.Module, subconfigs: Mapping[int, tuple[str, object]]) -> str | None:
    """The attribute (without ``_config``) under which an ancestor keeps this model's config."""
    config = _model_config(module)
    if config is None:
        return None
    entry = subconfigs.get(id(config))
    if entry is None or entry[1] is not config:
        return None
    return entry[0].removesuffix("_config")


def _is_text_model(module: nn.Module, subconfigs: Mapping[int, tuple[str, object]]) -> bool:
    """Built from an ancestor's text or decoder sub-config: a language model, guarded."""
    attr = _subconfig_attr(module, subconfigs)
    return attr is not None and (attr in _TEXT_CONFIG_ATTRS or attr.startswith("text_"))


def _config_modality(module: nn.Module, attr: str) -> Modality:
    """Modality of a model built from sub-config ``attr``: from its name, else its type.

    ``vision_config`` / ``audio_config`` say it in the name; a neutral ``encoder`` config
    says it in its ``model_type`` (``vit``, ``wav2vec2``, ``granite_speech_encoder``).
    """
    modality = _modality_from_keywords(attr, _INPUT_MODALITY_KEYWORDS)
    if modality == "unknown" and attr in ("encoder", "encoder_model"):
        model_type = getattr(_model_config(module), "model_type", "")
        modality = _modality_from_keywords(model_type if isinstance(model_type, str) else "")
    return modality


def _match_structure(
    path: str,
    module: nn.Module,
    parent: nn.Module,
    subconfigs: Mapping[int, tuple[str, object]],
) -> MultimodalModule | None:
    """The structural rules, strongest first; ``None`` when none applies.

    1. ``config:<attr>`` -- a model built from an ancestor's media sub-config
       (``vision_config``, ``audio_config``, an ``encoder`` config of a vision/audio type).
    2. ``main_input:<name>`` -- a model whose ``main_input_name`` is a media input.
    3. ``forward:<arg>`` / ``features:<arg>`` -- a child of the module where media meets
       text (its parent's forward takes both) whose own forward takes no text and either
       media, when it has a layer stack of its own (a tower), or a tower's output (a
       projector).

    None of them matches a module whose forward takes text or cross-attends, since a tower
    encodes media alone. Activation-checkpoint and compile wrappers are looked through;
    the wrapper itself is reported, being what is registered in the tree.
    """
    reported, module, parent = module, unwrap_module(module), unwrap_module(parent)
    arguments = _forward_arguments(module)
    if _takes_text(arguments):
        return None
    attr = _subconfig_attr(module, subconfigs)
    if attr is not None:
        modality = _config_modality(module, attr)
        if modality != "unknown":
            return MultimodalModule(path, reported, "tower", modality, f"config:{attr}_config")
    main_input = getattr(module, "main_input_name", None)
    if (
        isinstance(main_input, str)
        and main_input in MEDIA_INPUTS
        and _model_config(module) is not None
    ):
        modality = MEDIA_INPUTS[main_input]
        return MultimodalModule(path, reported, "tower", modality, f"main_input:{main_input}")
    if not _is_media_entry(parent) or not _has_parameters(module):
        return None
    media = _first_media(arguments, MEDIA_INPUTS)
    if media is not None:
        # Only an encoder with layers of its own: a bare patch projection at the media entry
        # belongs to the single-stream text model that embeds the patches.
        if not _has_layer_container(module):
            return None
        return MultimodalModule(path, reported, "tower", MEDIA_INPUTS[media], f"forward:{media}")
    feature = _first_media(arguments, MEDIA_FEATURE_INPUTS)
    if feature is not None:
        modality = MEDIA_FEATURE_INPUTS[feature]
        return MultimodalModule(path, reported, "projector", modality, f"features:{feature}")
    return None


def _shares_parameters(
    model: nn.Module, path: str, module: nn.Module, uses: dict[int, int]
) -> bool:
    """Whether a parameter of ``module`` is also registered outside it (tied weights).

    A structural match must be separable from the rest of the model: a patch embedding
    whose weights are tied to one inside the text encoder is not a tower of its own, and
    giving it an FSDP unit would split a tied parameter across units. ``uses`` counts the
    registrations of each parameter in ``model``, filled on the first call.
    """
    if not uses:
        for _, param in model.named_parameters(remove_duplicate=False):
            uses[id(param)] = uses.get(id(param), 0) + 1
    inside: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        inside[id(param)] = inside.get(id(param), 0) + 1
    shared = [key for key, count in inside.items() if uses.get(key, 0) > count]
    if shared:
        logger.debug("%s shares %d parameter(s) with the rest of the model", path, len(shared))
    return bool(shared)


def _is_media_entry(module: nn.Module) -> bool:
    """Media meets text here: forward takes both, and no layer stack is owned directly.

    A module that owns its layer list (``layers``, ``block``) is a text stack with an
    image-patch input, whose parts are not separate towers.
    """
    arguments = _forward_arguments(module)
    if not _takes_text(arguments) or _first_media(arguments, MEDIA_INPUTS) is None:
        return False
    return not any(isinstance(child, (nn.ModuleList, nn.ModuleDict)) for child in module.children())


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _owns_parameters(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _has_layer_container(module: nn.Module) -> bool:
    return any(isinstance(sub, (nn.ModuleList, nn.ModuleDict)) for sub in module.modules())


def _absorb_bundles(model: nn.Module, found: list[MultimodalModule]) -> list[MultimodalModule]:
    """Report a module whose parameters all belong to discovered towers instead of them.

    A parent that owns no parameters itself and whose children with parameters are all
    discovered towers, two or more of them, is the maximal tower: one module bundling the
    image and audio embedders under a text model's embedding, for example. Repeated
    upwards; the root is never reported; towers and projectors are not merged, to keep
    the roles apart.
    """
    changed = True
    while changed:
        changed = False
        by_path = {item.path: item for item in found}
        for item in found:
            parent_path = item.path.rpartition(".")[0]
            if not parent_path or item.role != "tower":
                continue
            bundle = _bundle(model.get_submodule(parent_path), parent_path, by_path)
            if bundle is not None:
                found = _replace_children(found, bundle)
                changed = True
                break
    return found


def _bundle(
    parent: nn.Module, parent_path: str, by_path: Mapping[str, MultimodalModule]
) -> MultimodalModule | None:
    if isinstance(parent, _BLOCK_CONTAINERS) or _owns_parameters(parent):
        return None
    members = []
    for name, child in parent.named_children():
        item = by_path.get(f"{parent_path}.{name}")
        if item is not None and item.role == "tower":
            members.append(item)
        elif _has_parameters(child):
            return None
    if len(members) < 2:
        return None  # a plain wrapper around one tower: the named tower is the answer
    modalities = {item.modality for item in members}
    modality = modalities.pop() if len(modalities) == 1 else "unknown"
    label = "bundle:" + "+".join(item.path.rpartition(".")[2] for item in members)
    return MultimodalModule(parent_path, parent, "tower", modality, label)


def _replace_children(
    found: list[MultimodalModule], bundle: MultimodalModule
) -> list[MultimodalModule]:
    """``found`` with ``bundle`` in place of its first member and without the others."""
    prefix = bundle.path + "."
    result: list[MultimodalModule] = []
    for item in found:
        if item.path.startswith(prefix):
            if bundle not in result:
                logger.debug("bundling %s into %s", item.path, bundle.path)
                result.append(bundle)
            continue
        result.append(item)
    return result


def _modality_from_keywords(
    name: str, keywords: tuple[tuple[str, Modality], ...] = _MODALITY_KEYWORDS
) -> Modality:
    lowered = name.lower()
    for keyword, modality in keywords:
        if keyword in lowered:
            return modality
    return "unknown"


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")

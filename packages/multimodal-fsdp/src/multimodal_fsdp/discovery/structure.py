"""The structural rules of discovery: towers and projectors found by shape, not name.

Where names fail (a tower registered as plain ``encoder``), these rules match what
transformers models expose: a media sub-config, a media ``main_input_name``, an encoder
taking media and no text where media meets text, an encoder of two or more towers. A
match that ties a parameter to the rest of the model is dropped. The walk applying them
is [`multimodal_fsdp.discovery.walk`][multimodal_fsdp.discovery.walk].
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping

from torch import nn

from fsdp_core.containers import unwrap_module
from multimodal_fsdp.discovery.conditional import required_forward_arguments
from multimodal_fsdp.discovery.names import (
    _INPUT_MODALITY_KEYWORDS,
    Modality,
    MultimodalModule,
    _modality_from_keywords,
)

__all__ = ["MEDIA_FEATURE_INPUTS", "MEDIA_INPUTS"]

# Discovery's logger: the structural rules log as part of the walk.
logger = logging.getLogger("multimodal_fsdp.discovery.walk")

_BLOCK_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

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
    """Names of the parameters of ``forward`` (cached per class; empty if uninspectable)."""
    cls = type(module)
    if cls not in _FORWARD_ARGUMENTS:
        try:
            _FORWARD_ARGUMENTS[cls] = frozenset(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError):
            _FORWARD_ARGUMENTS[cls] = frozenset()
    return _FORWARD_ARGUMENTS[cls]


def _takes_text(arguments: frozenset[str]) -> bool:
    return bool(arguments & _TEXT_INPUTS) or any(a.startswith("decoder_") for a in arguments)


def _first_media(arguments: frozenset[str], table: Mapping[str, Modality]) -> str | None:
    """The first argument of ``table`` (in table order) that ``arguments`` contains."""
    return next((name for name in table if name in arguments), None)


def _model_config(module: nn.Module) -> object | None:
    """The config of a transformers-style model (duck-typed: no transformers import)."""
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
    """Modality of a model built from sub-config ``attr``: from its name, else (a neutral
    ``encoder`` config) from its ``model_type``."""
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
    """The structural rules, strongest first (``config:``, ``main_input:``, then
    ``forward:`` / ``features:`` for a child of the media entry); ``None`` when none
    applies or the module takes text. Wrappers are looked through but reported."""
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
    """Whether a parameter of ``module`` is also registered outside it (tied weights);
    ``uses`` counts each parameter's registrations in ``model``, filled on first call."""
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
    """Media meets text here: forward takes both, and no layer stack is owned directly
    (that would be a text stack with an image-patch input)."""
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
    """Report a parent made only of two or more discovered towers, whose call runs them
    all (``_encodes_media_alone``), instead of them; repeated upwards, never the root."""
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
    if not _encodes_media_alone(unwrap_module(parent)):
        logger.debug("not a bundle, its towers run on their own: %s", parent_path)
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


def _encodes_media_alone(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs its towers: its forward takes no text and
    requires every media input it has (at least one)."""
    arguments = _forward_arguments(module)
    media = {name for name in arguments if name in MEDIA_INPUTS}
    return (
        not _takes_text(arguments) and bool(media) and media <= required_forward_arguments(module)
    )


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

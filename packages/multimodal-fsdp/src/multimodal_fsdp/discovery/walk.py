"""Find the modality towers and multimodal projectors of a vision/audio-language model.

Sharding frameworks treat these modules differently from the text decoder (their own FSDP
unit, their own mixed-precision policy, often frozen), so they need to be located by
qualified name in an arbitrary ``nn.Module`` tree.

A submodule matches by its *name* when the attribute name under which it is registered (the
last component of its qualified name) is a known tower or projector name. Where names fail
(towers registered as plain ``encoder``), *structural* rules match what transformers models
expose, without naming any model: a model built from an enclosing model's media sub-config
(``vision_config``, ``audio_config``, an ``encoder`` config of a vision or audio type), a
model whose ``main_input_name`` is a media input, a child encoder taking media (or a
projector taking a tower's output) and no text right where media meets text, and an encoder
holding nothing but two or more towers (media in, no text: its call runs them; a module that
takes the text stream, such as a feature embedding calling its encoders only with media, is
not one, and its towers are reported). A structural match that shares (ties) a parameter
with the rest of the model is dropped. Each result records the rule that matched. Three
rules decide which matches are reported:

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
  language-model name
  ([`LANGUAGE_MODEL_NAMES`][multimodal_fsdp.discovery.walk.LANGUAGE_MODEL_NAMES],
  e.g. ``language_model``) can match, nor anything in a model built from an enclosing model's text
  or decoder sub-config, so helper modules that a text decoder keeps outside its layer stack are not
  mistaken for towers either.

The root module is never reported: discovery is about parts of a model, not the model.

The name tables live in [`multimodal_fsdp.discovery.names`][multimodal_fsdp.discovery.names] and
the structural rules in
[`multimodal_fsdp.discovery.structure`][multimodal_fsdp.discovery.structure]; this module is the
walk that applies them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

from torch import nn

from fsdp_core.containers import unwrap_module
from multimodal_fsdp.discovery.names import (
    _BUILTIN_RULES,
    LANGUAGE_MODEL_NAMES,
    Modality,
    MultimodalModule,
    Role,
    _modality_from_keywords,
    _Rule,
)
from multimodal_fsdp.discovery.structure import (
    _BLOCK_CONTAINERS,
    _absorb_bundles,
    _is_text_model,
    _match_structure,
    _register_subconfigs,
    _shares_parameters,
)
from multimodal_fsdp.discovery.validation import check_attribute_names, check_module_paths

__all__ = ["iter_multimodal_modules", "resolve_multimodal_modules"]

logger = logging.getLogger(__name__)


def iter_multimodal_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(qualified_name, module)`` for the maximal towers and projectors of ``model``.

    Same walk and rules (names and structure) as
    [`resolve_multimodal_modules`][multimodal_fsdp.discovery.walk.resolve_multimodal_modules] with
    no
    extra names or excludes; results come in ``named_modules()`` pre-order.

    Args:
        model: the model to search.

    Yields:
        ``(qualified name, module)`` per tower or projector.
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

    Args:
        model: the model to search.
        extra_tower_names: more attribute names of towers.
        extra_projector_names: more attribute names of projectors.
        exclude: qualified paths whose subtrees are skipped.
        structural: whether the structural rules apply.

    Returns:
        Each match with its path, role, modality and the rule that found it.

    Raises:
        TypeError: ``structural`` is not a bool.
        ValueError: a name is given twice or is already built in, or an ``exclude``
            path names no module.
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


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")

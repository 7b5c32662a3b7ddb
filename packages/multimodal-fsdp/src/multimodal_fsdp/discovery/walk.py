"""Find the modality towers and multimodal projectors of a vision/audio-language model.

Sharding treats these modules unlike the text decoder (their own units, often frozen), so
they are located by qualified name. A submodule matches by the attribute name it is
registered under ([`names`][multimodal_fsdp.discovery.names]) or, where names fail, by
the [`structural`][multimodal_fsdp.discovery.structure] rules. Which matches are reported:

* **Maximality** -- the walk is ``named_modules()`` pre-order and a match hides its
  subtree (a tower's internal ``merger`` is never a projector).
* **Repeated-block guard** -- nothing inside a numbered item of an ``nn.ModuleList``,
  ``nn.Sequential`` or ``nn.ModuleDict`` (``layers.3``) matches: towers are singletons
  wired in by attribute.
* **Language-model guard** -- nothing below a language-model name (``language_model``)
  or a model built from a text sub-config matches.

The root module is never reported.
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

    Same walk as
    [`resolve_multimodal_modules`][multimodal_fsdp.discovery.walk.resolve_multimodal_modules]
    with no extra names or excludes.

    Args:
        model: the model to search.

    Yields:
        ``(qualified name, module)`` per tower or projector.
    """
    _check_model(model)
    found = _walk(model, _BUILTIN_RULES, frozenset(), set(), structural=True)
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

    Args:
        model: the model to search.
        extra_tower_names: more attribute names (not dotted paths) of towers.
        extra_projector_names: more attribute names of projectors.
        exclude: qualified paths whose subtrees are skipped (each must name a module).
        structural: whether the structural rules apply (else names only).

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
    seen_excludes: set[str],
    *,
    structural: bool,
) -> list[MultimodalModule]:
    """The single pre-order walk behind both public entry points. ``closed``: whether a
    visited path's subtree is decided (matched, excluded or guarded)."""
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
    """Modality of a neutrally named projector: that of the towers beside it, if one."""
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

"""What a model holds for multimodal planning, found once by ``discover`` (a plan reads
it many times; the chooser passes one discovery to every plan it makes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from multimodal_fsdp.discovery.conditional import find_media_conditional_layers
from multimodal_fsdp.discovery.validation import check_attribute_names, check_module_paths
from multimodal_fsdp.discovery.walk import resolve_multimodal_modules
from multimodal_fsdp.parts import MultimodalParts, split_frozen_parts

__all__ = ["Discovery", "DiscoveryOptions", "discover"]


@dataclass(frozen=True)
class DiscoveryOptions:
    """The options that change what discovery finds (a parallelizer's, by default none)."""

    extra_tower_names: tuple[str, ...] = ()
    extra_projector_names: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def checked(
        cls,
        *,
        extra_tower_names: Iterable[str] = (),
        extra_projector_names: Iterable[str] = (),
        exclude: Iterable[str] = (),
    ) -> DiscoveryOptions:
        """The options from user input, each collection checked.

        Args:
            extra_tower_names: more attribute names of towers.
            extra_projector_names: more attribute names of projectors.
            exclude: qualified paths discovery skips.

        Returns:
            The checked options.
        """
        return cls(
            extra_tower_names=check_attribute_names(extra_tower_names, "extra_tower_names"),
            extra_projector_names=check_attribute_names(
                extra_projector_names, "extra_projector_names"
            ),
            exclude=check_module_paths(exclude, "exclude"),
        )


@dataclass(frozen=True)
class Discovery:
    """One model's towers and projectors with their frozen and trainable parts, and its
    decoder layers that run only with media, as found with ``options`` (and the model's
    ``requires_grad`` flags at the time, see
    [`matches`][multimodal_fsdp.model_discovery.Discovery.matches])."""

    model: nn.Module = field(compare=False)
    options: DiscoveryOptions
    parts: tuple[MultimodalParts, ...]
    conditional: tuple[str, ...]
    #: ``requires_grad`` of every parameter, in ``named_parameters()`` order.
    trainable: tuple[bool, ...] = field(repr=False)

    @property
    def paths(self) -> list[str]:
        """Paths of every discovered tower and projector."""
        return [part.found.path for part in self.parts]

    @property
    def towers(self) -> list[str]:
        """Paths of the discovered towers (projectors left out)."""
        return [part.found.path for part in self.parts if part.found.role == "tower"]

    @property
    def projectors(self) -> list[str]:
        """Paths of the discovered projectors."""
        return [part.found.path for part in self.parts if part.found.role != "tower"]

    def matches(self, model: nn.Module, options: DiscoveryOptions) -> bool:
        """Whether this discovery is ``model``'s with ``options`` and the model's
        parameters are still trainable exactly as they were when it was made.

        Args:
            model: the model about to be planned.
            options: the planner's discovery options.

        Returns:
            Whether the discovery may be reused for it.
        """
        return (
            model is self.model and options == self.options and _trainable(model) == self.trainable
        )


def discover(
    model: nn.Module,
    *,
    extra_tower_names: Iterable[str] = (),
    extra_projector_names: Iterable[str] = (),
    exclude: Iterable[str] = (),
) -> Discovery:
    """Find the towers and projectors of ``model``, split into frozen and trainable parts,
    and its media-dependent decoder layers, once.

    Args:
        model: the model.
        extra_tower_names: more attribute names of towers.
        extra_projector_names: more attribute names of projectors.
        exclude: qualified paths discovery skips.

    Returns:
        What was found, to pass to ``plan(model, discovery=...)``.
    """
    options = DiscoveryOptions.checked(
        extra_tower_names=extra_tower_names,
        extra_projector_names=extra_projector_names,
        exclude=exclude,
    )
    return discover_with(model, options)


def discover_with(model: nn.Module, options: DiscoveryOptions) -> Discovery:
    """[`discover`][multimodal_fsdp.model_discovery.discover] with options already checked."""
    found = resolve_multimodal_modules(
        model,
        extra_tower_names=options.extra_tower_names,
        extra_projector_names=options.extra_projector_names,
        exclude=options.exclude,
    )
    parts = []
    for item in found:
        frozen, trainable = split_frozen_parts(item.module, item.path)
        parts.append(MultimodalParts(item, frozen, trainable))
    return Discovery(
        model=model,
        options=options,
        parts=tuple(parts),
        conditional=tuple(find_media_conditional_layers(model)),
        trainable=_trainable(model),
    )


def _trainable(model: nn.Module) -> tuple[bool, ...]:
    return tuple(param.requires_grad for param in model.parameters())

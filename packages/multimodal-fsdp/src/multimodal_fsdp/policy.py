"""The frozen-tower policy and the small questions it asks of modules."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, Literal, get_args

from torch import nn

from fsdp_core.sharding import owned_ignored_params

__all__ = [
    "FrozenMultimodalSharding",
    "VALID_FROZEN_MULTIMODAL_SHARDING",
    "FrozenPolicy",
    "FROZEN_POLICIES",
    "frozen_policy",
    "normalize_frozen_multimodal_sharding",
    "FrozenPolicies",
    "module_parameters",
    "module_is_fully_frozen",
    "ignored_params_for_root",
]

#: How fully frozen towers/projectors are sharded:
#: ``root`` (their parameters join the root unit), ``per_layer`` (one unit per
#: layer-container item) or ``replicate`` (kept whole on every rank, no FSDP).
FrozenMultimodalSharding = Literal["root", "per_layer", "replicate"]

VALID_FROZEN_MULTIMODAL_SHARDING: Final[tuple[FrozenMultimodalSharding, ...]] = get_args(
    FrozenMultimodalSharding
)


@dataclass(frozen=True)
class FrozenPolicy:
    """What one frozen-tower policy does with a fully frozen tower or projector (asked
    instead of comparing names, so a new policy is one more ``FROZEN_POLICIES`` entry)."""

    name: FrozenMultimodalSharding
    #: Its frozen layers (layer-container items) become FSDP units of their own.
    layer_units: bool
    #: Its frozen parameters stay whole on every rank, outside FSDP.
    replicates: bool
    #: Safe when ranks may skip the part's calls (``uneven_media=True``): it makes no
    #: unit that only ranks with media would run.
    uneven_media_safe: bool
    #: Plan note: what it does with the layers of a partly trainable module.
    partly_trainable_rule: str

    def replicated_paths(self, frozen: Sequence[str]) -> list[str]:
        """The frozen paths kept whole on every rank.

        Args:
            frozen: the fully frozen paths of a discovered module.

        Returns:
            Those this policy replicates (none, or all of them).
        """
        return list(frozen) if self.replicates else []

    def partly_trainable_units(self, layers: Iterable[tuple[str, str]]) -> list[str]:
        """Unit paths among the layers of a partly trainable module: trainable ones, and
        frozen and adapted ones where the policy makes layer units.

        Args:
            layers: ``(path, kind)`` per layer, kind ``"trainable"``, ``"frozen"`` or
                ``"adapted"``.

        Returns:
            The layer paths that become units.
        """
        return [
            path
            for path, kind in layers
            if kind == "trainable" or (self.layer_units and kind in ("frozen", "adapted"))
        ]


#: Every policy, in the order of ``VALID_FROZEN_MULTIMODAL_SHARDING``.
FROZEN_POLICIES: Final[dict[FrozenMultimodalSharding, FrozenPolicy]] = {
    "root": FrozenPolicy(
        name="root",
        layer_units=False,
        replicates=False,
        uneven_media_safe=True,
        partly_trainable_rule="frozen and adapted layers and the rest join the root unit",
    ),
    "per_layer": FrozenPolicy(
        name="per_layer",
        layer_units=True,
        replicates=False,
        uneven_media_safe=False,
        partly_trainable_rule="frozen and adapted layers are units (adapters in their "
        "layer's unit), the rest joins the root unit",
    ),
    "replicate": FrozenPolicy(
        name="replicate",
        layer_units=False,
        replicates=True,
        uneven_media_safe=True,
        partly_trainable_rule="frozen parameters are replicated, trainable ones outside "
        "trainable layers join the root unit",
    ),
}


def frozen_policy(name: str) -> FrozenPolicy:
    """The policy object of ``name`` (spelled as ``frozen_multimodal_sharding`` accepts).

    Args:
        name: a policy name.

    Returns:
        Its ``FrozenPolicy``.
    """
    return FROZEN_POLICIES[normalize_frozen_multimodal_sharding(name)]


class _NotAStrError(ValueError, TypeError):
    """A non-string policy value: a ``ValueError`` like every bad value, and a ``TypeError``."""


def normalize_frozen_multimodal_sharding(value: str) -> FrozenMultimodalSharding:
    """Accept ``"Per-Layer"``, ``" replicate "`` and the like; reject anything else.

    Args:
        value: the user's spelling of a policy.

    Returns:
        ``"root"``, ``"per_layer"`` or ``"replicate"``.

    Raises:
        ValueError: not a policy name, listing the valid choices (a non-string is a
            ``TypeError`` too).
    """
    if not isinstance(value, str):
        raise _NotAStrError(
            f"frozen multimodal sharding must be a str, got {type(value).__name__} ({value!r}); "
            f"valid choices: {', '.join(VALID_FROZEN_MULTIMODAL_SHARDING)}"
        )
    key = value.strip().lower().replace("-", "_")
    for choice in VALID_FROZEN_MULTIMODAL_SHARDING:
        if key == choice:
            return choice
    raise ValueError(
        f"unknown frozen multimodal sharding {value!r}; "
        f"valid choices: {', '.join(VALID_FROZEN_MULTIMODAL_SHARDING)}"
    )


@dataclass(frozen=True)
class FrozenPolicies:
    """Which frozen-tower policy each discovered multimodal module follows: ``default``
    for every module that ``by_path`` does not name. The plan records it, so planning,
    the chooser and the costs read the same policies.
    """

    default: FrozenMultimodalSharding = "root"
    #: ``(path, policy)`` pairs in the order given (a tuple, so the value is hashable).
    by_path: tuple[tuple[str, FrozenMultimodalSharding], ...] = ()

    #: The mapping key of the policy for the modules the mapping does not name.
    REST: ClassVar[str] = "*"

    @classmethod
    def parse(cls, value: str | Mapping[str, str]) -> FrozenPolicies:
        """The policies of ``frozen_multimodal_sharding`` as the user gives it.

        Args:
            value: one policy name, or ``{path or "*": policy name}``.

        Returns:
            The policies.

        Raises:
            TypeError: ``value`` is neither a string nor a mapping of strings.
            ValueError: a policy name or path is invalid.
        """
        if not isinstance(value, Mapping):
            return cls(normalize_frozen_multimodal_sharding(value))
        if not value:
            raise ValueError(
                "frozen multimodal sharding mapping is empty; give a policy "
                f"({', '.join(VALID_FROZEN_MULTIMODAL_SHARDING)}) or map multimodal module "
                f"paths (and {cls.REST!r} for the rest) to policies"
            )
        default: FrozenMultimodalSharding = "root"
        by_path: dict[str, FrozenMultimodalSharding] = {}
        for path, policy in value.items():
            if not isinstance(path, str):
                raise TypeError(
                    f"frozen multimodal sharding keys must be module paths (str) or "
                    f"{cls.REST!r}, got {type(path).__name__} ({path!r})"
                )
            try:
                normalized = normalize_frozen_multimodal_sharding(policy)
            except ValueError as error:
                raise type(error)(f"{path!r}: {error}") from None
            if path == cls.REST:
                default = normalized
            else:
                by_path[path] = normalized
        return cls(default, tuple(by_path.items()))

    def option(self) -> str | dict[str, str]:
        """The ``frozen_multimodal_sharding`` value that parses to these policies.

        Returns:
            One name, or ``{path or "*": name}``.
        """
        if not self.by_path:
            return self.default
        return {**dict(self.by_path), self.REST: self.default}

    @property
    def label(self) -> str:
        """``per_layer`` for one policy, ``vision=per_layer, *=root`` when the named
        modules differ from the default (plan headers, choices and errors)."""
        if all(policy == self.default for _, policy in self.by_path):
            return self.default
        entries = [f"{path}={policy}" for path, policy in self.by_path]
        return ", ".join([*entries, f"{self.REST}={self.default}"])

    def policy_of(self, path: str) -> FrozenMultimodalSharding:
        """The policy of the multimodal module at ``path``.

        Args:
            path: a discovered module's qualified name.

        Returns:
            Its policy (the default when no entry names it).
        """
        return dict(self.by_path).get(path, self.default)

    def resolve(self, paths: Sequence[str], *, owner: str) -> dict[str, FrozenMultimodalSharding]:
        """The policy of each discovered multimodal module path.

        Args:
            paths: the discovered modules' paths.
            owner: the model's class name, for the message.

        Returns:
            ``{path: policy}`` for every path.

        Raises:
            ValueError: an entry names a path that was not discovered.
        """
        unknown = [path for path, _ in self.by_path if path not in paths]
        if unknown:
            found = ", ".join(repr(p) for p in paths) or "none"
            raise ValueError(
                f"frozen_multimodal_sharding names {', '.join(repr(p) for p in unknown)}, "
                f"not a discovered multimodal module of {owner}; "
                f"discovered: {found} (use {self.REST!r} for the rest)"
            )
        return {path: self.policy_of(path) for path in paths}

    @property
    def per_layer_where(self) -> str:
        """Where a policy unsafe under uneven media (``per_layer``) is set, as the option
        reads ('' when nowhere)."""
        unsafe = {name for name, policy in FROZEN_POLICIES.items() if not policy.uneven_media_safe}
        if not self.by_path and self.default in unsafe:
            return f"frozen_multimodal_sharding={self.default!r}"
        where = [(path, policy) for path, policy in self.by_path if policy in unsafe]
        if self.default in unsafe:
            where.append((self.REST, self.default))
        if not where:
            return ""
        named = sorted({policy for _, policy in where})
        return (
            f"frozen_multimodal_sharding {', '.join(map(repr, named))} for "
            f"{', '.join(repr(path) for path, _ in where)}"
        )


def module_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The module's parameters, recursively (shared parameters once).

    Args:
        module: any module.

    Returns:
        Its distinct parameters.
    """
    return list(module.parameters())


def module_is_fully_frozen(module: nn.Module) -> bool:
    """Whether ``module`` owns parameters and none of them requires a gradient.

    Args:
        module: any module.

    Returns:
        Whether it has parameters and none is trainable.
    """
    params = module_parameters(module)
    return bool(params) and not any(p.requires_grad for p in params)


def ignored_params_for_root(
    root: nn.Module, ignored_params: Iterable[nn.Parameter] | None
) -> set[nn.Parameter] | None:
    """The subset of ``ignored_params`` that ``root`` owns (FSDP accepts only those).

    Args:
        root: the module about to be sharded.
        ignored_params: every replicated parameter of the model.

    Returns:
        Those ``root`` owns, or None.
    """
    return owned_ignored_params([root], ignored_params)

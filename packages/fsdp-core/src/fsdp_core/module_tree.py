"""What a plan was made for: the module tree, and the checks that it did not change.

Adapters added after planning (peft's ``get_peft_model``) make a plan wrong; added after
sharding, their weights stay outside FSDP. ``ShardingPlan.fingerprint`` records the tree;
``apply_plan`` compares it with the model before sharding, and a one-time forward
pre-hook compares again at the first forward, which also checks that a model sharded on
``meta`` got its weights ([fsdp_core.weights_check][]). Both raise the same
``ModuleTreeChangedError`` on every rank. Checkpoint and compile wrappers are looked through.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_core.rank_wait import names_text
from fsdp_core.sharding import original_class
from fsdp_core.weights_check import check_weights_given, record_meta_tensors

__all__ = [
    "ModuleTreeChangedError",
    "ModuleTreeFingerprint",
    "ParameterRecord",
    "check_module_tree",
    "check_unchanged_since_sharding",
    "install_first_forward_check",
    "module_tree_fingerprint",
]

logger = logging.getLogger(__name__)

#: The order every job follows; error messages quote it.
_ORDER_OF_OPERATIONS = (
    "build (or meta-init) the model -> add adapters (LoRA) and set requires_grad -> "
    "parallelize -> load weights -> build the optimizer"
)
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})
_LIMIT = 4
#: Each sharded model (the one ``apply_plan`` was given) -> its tree right after sharding.
_SHARDED: weakref.WeakKeyDictionary[nn.Module, ModuleTreeFingerprint] = weakref.WeakKeyDictionary()


class ModuleTreeChangedError(RuntimeError):
    """The model's modules or parameters changed after planning or sharding."""


@dataclass(frozen=True)
class ParameterRecord:
    """One parameter as planned: name (wrappers looked through), shape, dtype, trainable."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


@dataclass(frozen=True)
class ModuleTreeFingerprint:
    """The module paths and parameters of a model, in registration order."""

    modules: tuple[str, ...]
    parameters: tuple[ParameterRecord, ...]

    def changes(self, current: ModuleTreeFingerprint, *, after_sharding: bool = False) -> str:
        """What differs in ``current``, readably (empty when nothing that matters does;
        parameter-free modules added do not matter).

        ``after_sharding`` compares only what breaks a sharded model: parameters added or
        reshaped, and frozen ones made trainable; removing and freezing are harmless there.

        Args:
            current: the model's fingerprint now.
            after_sharding: compare only what breaks a sharded model.

        Returns:
            One line per change, or ``""``.
        """
        old = {p.name: p for p in self.parameters}
        new = {p.name: p for p in current.parameters}
        parts = []
        prefix = _common_prefix([n for n in old if n not in new], [n for n in new if n not in old])
        if prefix:
            parts.append(
                f"every parameter name now starts with {prefix!r} (the model was wrapped, "
                "e.g. by peft's get_peft_model)"
            )
            old = {prefix + n: p for n, p in old.items()}
        added = [n for n in new if n not in old]
        removed = [n for n in old if n not in new]
        both = [n for n in new if n in old]
        wrapped = [n for n in removed if _base_layer_name(n) in set(added)]
        if wrapped:
            moved = {_base_layer_name(n) for n in wrapped}
            layers = dict.fromkeys(n.rpartition(".")[0] for n in wrapped)
            parts.append(_listed("wrapped by adapters (weights moved under 'base_layer')", layers))
            added = [n for n in added if n not in moved]
            removed = [n for n in removed if n not in set(wrapped)]
            old.update({_base_layer_name(n): old[n] for n in wrapped})
            both = [n for n in new if n in old]
        if after_sharding:
            # Removing adapters from a sharded model (peft's merge_and_unload: the
            # sharded base weight takes the adapted layer's place) adds nothing FSDP
            # does not manage.
            added = [n for n in added if _base_layer_name(n) not in old]
            removed = []
        parts += [_listed("added", added), _listed("removed", removed)]
        reshaped = [n for n in both if new[n].shape != old[n].shape]
        parts.append(
            _listed("reshaped", reshaped, lambda n: f"{list(old[n].shape)} -> {list(new[n].shape)}")
        )
        if not after_sharding:
            retyped = [n for n in both if new[n].dtype != old[n].dtype]
            parts.append(_listed("retyped", retyped, lambda n: f"{old[n].dtype} -> {new[n].dtype}"))
            frozen = [n for n in both if old[n].requires_grad and not new[n].requires_grad]
            parts.append(_listed("now frozen", frozen))
        trainable = [n for n in both if new[n].requires_grad and not old[n].requires_grad]
        parts.append(_listed("now trainable", trainable))
        if not after_sharding and not prefix:
            # A plan names modules too (units): one that is gone breaks applying it.
            gone = [m for m in self.modules if m not in set(current.modules)]
            parts.append(_listed("modules removed", gone))
        return "; ".join(part for part in parts if part)


def module_tree_fingerprint(model: nn.Module) -> ModuleTreeFingerprint:
    """The fingerprint of ``model`` as it is now (global shapes for sharded parameters).

    Args:
        model: the model.

    Returns:
        Its fingerprint.
    """
    modules = dict.fromkeys(_normal(name) for name, _ in model.named_modules())
    parameters = {}
    for name, param in model.named_parameters():
        key = _normal(name)
        if key not in parameters:
            parameters[key] = ParameterRecord(
                key,
                tuple(param.shape),
                str(param.dtype).removeprefix("torch."),
                param.requires_grad,
            )
    return ModuleTreeFingerprint(tuple(modules), tuple(parameters.values()))


def check_module_tree(model: nn.Module, expected: ModuleTreeFingerprint) -> None:
    """Raise ``ModuleTreeChangedError`` if ``model`` is not the tree a plan was made for.

    Args:
        model: the model about to be sharded.
        expected: the plan's fingerprint.

    Raises:
        ModuleTreeChangedError: naming what changed.
    """
    changes = expected.changes(module_tree_fingerprint(model))
    if changes:
        raise ModuleTreeChangedError(
            f"{type(model).__name__} changed since the plan was made: {changes}. A plan "
            "holds only for the module tree it was made for; nothing was sharded. Add "
            "adapters and set requires_grad before planning and sharding, then plan the "
            f"model as it is now. The order is: {_ORDER_OF_OPERATIONS}."
        )


def install_first_forward_check(
    model: nn.Module, expected: ModuleTreeFingerprint
) -> RemovableHandle:
    """Check the tree once, at the first forward of the sharded ``model`` (the hook then
    removes itself); ``model`` is remembered weakly for ``check_unchanged_since_sharding``.

    Args:
        model: the sharded model.
        expected: its fingerprint when it was sharded.

    Returns:
        The hook's handle.
    """
    handle: RemovableHandle | None = None
    _SHARDED[model] = expected
    # What is on meta now must have values by the first forward (fsdp_core.weights_check).
    on_meta = record_meta_tensors(model)

    def check(module: nn.Module, args: object) -> None:
        _raise_if_changed(module, expected, "")
        if on_meta is not None:
            check_weights_given(module, on_meta, name=original_class(module).__name__)
        if handle is not None:
            handle.remove()

    handle = model.register_forward_pre_hook(check, prepend=True)
    return handle


def check_unchanged_since_sharding(model: nn.Module, *, where: str) -> None:
    """Raise ``ModuleTreeChangedError`` if ``model``, or a sharded model inside it (a
    ``PeftModel`` around one), changed since it was sharded.

    Args:
        model: the model (or a wrapper of it).
        where: the calling function, for the message.

    Raises:
        ModuleTreeChangedError: naming what changed.
    """
    for module in model.modules():
        expected = _SHARDED.get(module)
        if expected is not None:
            _raise_if_changed(module, expected, where)


def _raise_if_changed(module: nn.Module, expected: ModuleTreeFingerprint, where: str) -> None:
    changes = expected.changes(module_tree_fingerprint(module), after_sharding=True)
    if changes:
        at = f" ({where})" if where else ""
        raise ModuleTreeChangedError(
            f"{original_class(module).__name__} changed since it was sharded{at}: {changes}. "
            "Parameters added after sharding are not managed by FSDP (their "
            "gradients are never reduced) and sharded weights break adapter layers. "
            "Add adapters (peft's get_peft_model) and set requires_grad before "
            f"planning and sharding. The order is: {_ORDER_OF_OPERATIONS}."
        )


def _normal(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _common_prefix(removed: list[str], added: list[str]) -> str:
    """A prefix that turns every removed name into an added one (a wrapper), or ''."""
    added_set = set(added)
    for first in removed:
        forms = (first, _base_layer_name(first))
        candidates = {n[: -len(f)] for f in forms for n in added if n.endswith("." + f)}
        for prefix in sorted(candidates):
            if all({prefix + n, _base_layer_name(prefix + n)} & added_set for n in removed):
                return prefix
        if candidates:
            break
    return ""


def _base_layer_name(name: str) -> str:
    head, _, leaf = name.rpartition(".")
    return f"{head}.base_layer.{leaf}" if head else f"base_layer.{leaf}"


def _listed(what: str, names: Iterable[str], change: Callable[[str], str] | None = None) -> str:
    """``what: 'a', 'b' and 3 more``, each name followed by its ``change``; ``""`` for none."""
    text = names_text(names, _LIMIT, show=lambda n: repr(n) + (f" {change(n)}" if change else ""))
    return f"{what}: {text}" if text else ""

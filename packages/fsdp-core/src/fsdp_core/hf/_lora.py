"""Adapter-wrapped models (peft's LoRA) seen as the base model they wrap, without importing peft.

peft wraps each adapted module (``q_proj.base_layer`` beside ``q_proj.lora_A.<adapter>``;
``modules_to_save`` as ``original_module`` plus one copy per adapter). A checkpoint
under those names loads into nothing but the same wrapped model, so the export unwraps
the names (adding ``scaling * B @ A`` to each base weight: a *merged* export) or
refuses. Everything is duck-typed on the module tree: a tuner layer has a
``base_layer`` child, a peft model a ``peft_config`` and ``get_base_model``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_core.rank_wait import names_text

_LISTED = 4
#: What the error for an adapter-wrapped model tells users to do instead.
MERGE_HINT = (
    "pass merge_adapters=True to export the merged weights (W + scaling * B @ A) under the "
    "base model's names, or save the PeftModel itself (save_pretrained(peft_model, d) or "
    "peft_model.save_pretrained(d)) to export the adapter alone in peft's format"
)


def is_peft_model(model: nn.Module) -> bool:
    """A peft ``PeftModel``: a ``peft_config`` dict and a ``get_base_model`` method."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(
        getattr(model, "get_base_model", None)
    )


def base_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The model a peft model wraps and its path inside ``model`` (``model`` and "" otherwise)."""
    if not is_peft_model(model):
        return model, ""
    get_base: Any = getattr(model, "get_base_model")  # noqa: B009 (not typed on nn.Module)
    inner: Any = get_base()
    if isinstance(inner, nn.Module) and inner is not model:
        for path, module in model.named_modules():
            if module is inner:
                return inner, path
    return model, ""


def adapter_names(model: nn.Module) -> tuple[str, ...]:
    """The adapters a peft model holds (its ``peft_config`` keys)."""
    config = getattr(model, "peft_config", None)
    return tuple(str(name) for name in config) if isinstance(config, dict) else ()


def active_adapter(model: nn.Module) -> str:
    """The one active adapter of a peft model (the one its plain export writes)."""
    try:
        active = _active(model)
    except ValueError:
        active = list(adapter_names(model))[:1]
    if len(active) != 1:
        raise ValueError(
            f"{type(model).__name__} has {len(active)} active adapters {active}; export "
            "each with peft_model.save_pretrained(d, selected_adapters=[name]), or merge "
            "them with merge_adapters=True"
        )
    return active[0]


def _is_tuner_layer(module: nn.Module) -> bool:
    return "base_layer" in module._modules


def _is_saved_module_wrapper(module: nn.Module) -> bool:
    return "original_module" in module._modules


def wrapped_modules(model: nn.Module) -> tuple[str, ...]:
    """Paths of ``model``'s adapter-wrapped modules (tuner layers, saved-module wrappers)."""
    found: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{outer}.") for outer in found):
            continue
        if _is_tuner_layer(module) or _is_saved_module_wrapper(module):
            found.append(path)
    return tuple(found)


def _listed(paths: Sequence[str]) -> str:
    return names_text(sorted(paths), _LISTED, as_list=True)


def wrapped_error(model: nn.Module, paths: Sequence[str]) -> ValueError:
    """The error for a plain export of a model with adapter-wrapped modules."""
    return ValueError(
        f"{type(model).__name__} has {len(paths)} adapter-wrapped modules "
        f"{_listed(paths)}: saved as they are, their weights get names such as "
        "'<module>.base_layer.weight' and '<module>.lora_A.<adapter>.weight', which "
        "from_pretrained of the base model does not load (it would initialise those "
        f"modules at random); {MERGE_HINT}"
    )


def wrapped_names(model: nn.Module, names: Sequence[str]) -> tuple[str, ...]:
    """The wrapped modules that ``names`` reach through a wrapper's own children
    (``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``); unwrapped
    names (``q_proj.weight``) reach none."""
    found: list[str] = []
    for path in wrapped_modules(model):
        prefix = f"{path}." if path else ""
        children = model.get_submodule(path)._modules
        if any(
            name.startswith(prefix) and name[len(prefix) :].split(".", 1)[0] in children
            for name in names
        ):
            found.append(path)
    return tuple(found)


def wrapped_load_error(model: nn.Module, paths: Sequence[str]) -> ValueError:
    """The error for loading a base checkpoint into a model with adapter-wrapped modules."""
    return ValueError(
        f"{type(model).__name__} has {len(paths)} adapter-wrapped modules "
        f"{_listed(paths)}: a base checkpoint has no keys for their tensors "
        "('<module>.base_layer.weight'), and the adapters' own weights are in no base "
        "checkpoint. Load the base weights before adding adapters (from_pretrained, then "
        "get_peft_model, then parallelize), or pass key_mapping= and strict=False and "
        "initialise the adapters yourself"
    )


@dataclass(frozen=True)
class AdapterAddition:
    """One adapter's addition to a merged tensor: ``scaling * up @ down`` (``down`` None: a
    bias, ``scaling * up``; ``transpose``: peft's ``fan_in_fan_out`` layers)."""

    up: torch.Tensor
    down: torch.Tensor | None
    scaling: float
    transpose: bool = False


@dataclass(frozen=True)
class ExportView:
    """A wrapped model's exported state names -> unwrapped names (adapter tensors absent),
    and per unwrapped name the LoRA terms added to the base tensor."""

    names: Mapping[str, str]
    terms: Mapping[str, tuple[AdapterAddition, ...]]
    wrapped: tuple[str, ...]


def _active(module: nn.Module) -> list[str]:
    active: Any = getattr(module, "active_adapters", None)
    if active is None:
        active = getattr(module, "active_adapter", None)
    if isinstance(active, str):
        return [active]
    if isinstance(active, (list, tuple)) and all(isinstance(a, str) for a in active):
        return list(active)
    raise ValueError(
        f"cannot tell which adapters of {type(module).__name__} are active "
        f"(active_adapters is {active!r})"
    )


def _flag(table: object, adapter: str) -> bool:
    return isinstance(table, Mapping) and bool(table.get(adapter, False))


def _weight(module: object, what: str) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{what} has no weight tensor")
    return weight


def _lora_terms(path: str, layer: nn.Module) -> dict[str, tuple[AdapterAddition, ...]]:
    """What merging ``layer``'s active adapters adds to its base weight (and bias)."""
    kind = type(layer).__name__
    lora_a, lora_b = layer._modules.get("lora_A"), layer._modules.get("lora_B")
    scaling = getattr(layer, "scaling", None)
    if (
        not isinstance(lora_a, nn.ModuleDict)
        or not isinstance(lora_b, nn.ModuleDict)
        or not isinstance(scaling, Mapping)
    ):
        raise ValueError(
            f"{path!r} is an adapter layer of a kind the merged export does not implement "
            f"({kind}: not LoRA); only plain LoRA is merged"
        )
    base = layer._modules["base_layer"]
    if base is not None and _is_tuner_layer(base):
        raise ValueError(
            f"{path!r} ({kind}) wraps another adapter layer; nested adapters are not merged"
        )
    merged = getattr(layer, "merged_adapters", None) or []
    weight: list[AdapterAddition] = []
    bias: list[AdapterAddition] = []
    for adapter in _active(layer):
        embedding = layer._modules.get("lora_embedding_A")
        if isinstance(embedding, (nn.ParameterDict, nn.ModuleDict)) and adapter in embedding:
            raise ValueError(
                f"{path!r} ({kind}) has LoRA on an embedding; the merged export implements "
                "LoRA on linear layers only"
            )
        if adapter not in lora_a or adapter in merged:
            continue
        variant = getattr(layer, "lora_variant", None)
        dora = _flag(getattr(layer, "use_dora", None), adapter)
        if dora or (isinstance(variant, Mapping) and adapter in variant):
            name = "DoRA" if dora else "a LoRA variant"
            raise ValueError(
                f"{path!r} ({kind}) uses {name} for adapter {adapter!r}; the merged export "
                "implements plain LoRA only (W + scaling * B @ A): export the adapter alone "
                "with save_pretrained(peft_model, d)"
            )
        down = _weight(lora_a[adapter], f"{path}.lora_A.{adapter}")
        up_module = lora_b[adapter]
        up = _weight(up_module, f"{path}.lora_B.{adapter}")
        if down.dim() != 2 or up.dim() != 2:
            raise ValueError(
                f"{path!r} ({kind}) has {down.dim()}-D LoRA weights; the merged export "
                "implements LoRA on linear layers only"
            )
        factor = float(scaling[adapter])
        transpose = bool(getattr(layer, "fan_in_fan_out", False))
        weight.append(AdapterAddition(up=up, down=down, scaling=factor, transpose=transpose))
        if _flag(getattr(layer, "lora_bias", None), adapter):
            up_bias = getattr(up_module, "bias", None)
            if not isinstance(up_bias, torch.Tensor) or getattr(base, "bias", None) is None:
                raise ValueError(
                    f"{path!r} ({kind}) has lora_bias for adapter {adapter!r} but no base bias "
                    "to merge it into"
                )
            bias.append(AdapterAddition(up=up_bias, down=None, scaling=factor))
    terms = {f"{path}.weight": tuple(weight)} if weight else {}
    if bias:
        terms[f"{path}.bias"] = tuple(bias)
    return terms


def _saved_copy(path: str, wrapper: nn.Module) -> str:
    """The child whose state a saved-module wrapper exports: the active adapter's copy."""
    copies = wrapper._modules.get("modules_to_save")
    if not isinstance(copies, nn.ModuleDict):
        raise ValueError(
            f"{path!r} ({type(wrapper).__name__}) wraps {path}.original_module in a way the "
            "merged export does not implement (no modules_to_save)"
        )
    active = [a for a in _active(wrapper) if a in copies]
    if len(active) > 1:
        raise ValueError(f"{path!r} has several active modules_to_save copies {active}")
    return f"modules_to_save.{active[0]}" if active else "original_module"


def export_view(model: nn.Module) -> ExportView:
    """``model``'s persistent state under unwrapped names, with the LoRA terms to merge;
    ValueError, naming the module, for adapters it cannot merge (before any gather)."""
    layers: dict[str, str] = {}  # wrapped path -> the child prefix it exports
    terms: dict[str, tuple[AdapterAddition, ...]] = {}
    wrapped = wrapped_modules(model)
    for path in wrapped:
        module = model.get_submodule(path)
        if _is_tuner_layer(module):
            layers[path] = "base_layer"
            terms.update(_lora_terms(path, module))
        else:
            layers[path] = _saved_copy(path, module)
    names: dict[str, str] = {}
    for name in _state_names(model):
        outer = next((p for p in wrapped if name.startswith(f"{p}.")), None)
        if outer is None:
            names[name] = name
            continue
        rest = name[len(outer) + 1 :]
        keep = layers[outer] + "."
        if rest.startswith(keep):
            names[name] = f"{outer}.{rest[len(keep) :]}"
    return ExportView(names=names, terms=terms, wrapped=wrapped)


def _state_names(model: nn.Module) -> list[str]:
    names: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        names.extend(dot + n for n, p in module._parameters.items() if p is not None)
        names.extend(
            dot + n
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        )
    return names


def merged(
    base: torch.Tensor,
    additions: Sequence[tuple[torch.Tensor, torch.Tensor | None, AdapterAddition]],
) -> torch.Tensor:
    """A copy of ``base`` plus each term (with its gathered ``up`` and ``down``), computed
    as peft's merge does: in the adapter's dtype (fp32 for half precision on the CPU)."""
    out = base.clone()
    for up, down, term in additions:
        if down is None:  # a bias: peft adds it in the adapter's dtype
            out += up * term.scaling
            continue
        dtype = up.dtype
        half = up.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
        product = (up.float() @ down.float()) if half else up @ down
        delta = (product.T if term.transpose else product) * term.scaling
        out += delta.to(dtype) if half else delta
    return out

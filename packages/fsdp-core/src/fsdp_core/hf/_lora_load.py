"""A base checkpoint into a LoRA model built on ``meta``: names, and the adapters' first values.

With a ``meta`` build the adapters exist before any weight, so each
``<module>.base_layer.<t>``, ``<module>.original_module.<t>`` and
``<module>.modules_to_save.<adapter>.<t>`` reads the checkpoint's ``<module>.<t>``. The
adapters get peft's default initial values, drawn from the default CPU generator in
peft's own order as full tensors on every rank: with the same seed on every rank right
before the load they equal what ``get_peft_model`` gives a CPU model. Only
``init_lora_weights=True`` and ``"gaussian"`` need no base weight; others are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_core.hf import _lora

#: ``init_lora_weights`` values whose initial adapters need no base weight.
SUPPORTED_INITS: tuple[object, ...] = (True, "gaussian")
_ADAPTER_CHILDREN = ("lora_A", "lora_B")


@dataclass(frozen=True)
class AdapterInit:
    """One LoRA layer's adapter, initialised as peft's ``reset_lora_parameters`` does."""

    layer: str  # the tuner layer's path in the loaded model
    adapter: str
    kind: object  # True or "gaussian"
    rank: int


@dataclass(frozen=True)
class LoadView:
    """A LoRA model seen by a base-checkpoint load: state name -> name in ``target`` (the
    model the adapters wrap), the adapters to initialise in peft's order, and the adapter
    state names no base checkpoint holds."""

    target: nn.Module
    names: Mapping[str, str]
    adapters: tuple[AdapterInit, ...]
    skipped: frozenset[str]


def is_lora_model(model: nn.Module) -> bool:
    """A peft model, or a model holding adapter-wrapped modules."""
    return _lora.is_peft_model(model) or bool(_lora.wrapped_modules(model))


def _init_kind(model: nn.Module, adapter: str, path: str) -> object:
    config = getattr(model, "peft_config", None)
    if not isinstance(config, dict) or adapter not in config:
        raise ValueError(
            f"{path!r} holds adapter {adapter!r}, but {type(model).__name__} has no peft_config "
            "saying how it is initialised: pass the PeftModel (get_peft_model's result) itself"
        )
    kind = getattr(config[adapter], "init_lora_weights", True)
    if isinstance(kind, str) and kind.lower() == "gaussian":
        return "gaussian"
    if kind is True:
        return True
    raise ValueError(
        f"adapter {adapter!r} has init_lora_weights={kind!r}; loading a base checkpoint into a "
        "LoRA model computes only the initialisations that need no base weight "
        f"({list(SUPPORTED_INITS)}). Load the base weights, then add the adapters, on a model "
        "built on the CPU (from_pretrained, get_peft_model, parallelize), or load a trained "
        "adapter from an adapter export (load_pretrained(peft_model, base_dir), then "
        "load_pretrained(peft_model, adapter_dir))"
    )


def _layer_adapters(model: nn.Module, path: str, layer: nn.Module) -> list[AdapterInit]:
    kind = type(layer).__name__
    lora_a, lora_b = layer._modules.get("lora_A"), layer._modules.get("lora_B")
    if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        raise ValueError(
            f"{path!r} is an adapter layer of a kind the load does not initialise ({kind}: not "
            "LoRA); load the base weights before adding adapters, on a CPU-built model"
        )
    if _lora._is_tuner_layer(layer._modules["base_layer"] or nn.Module()):
        raise ValueError(
            f"{path!r} ({kind}) wraps another adapter layer; nested adapters are not initialised "
            "by the load: load the base weights before adding adapters, on a CPU-built model"
        )
    embedding = layer._modules.get("lora_embedding_A")
    if isinstance(embedding, (nn.ParameterDict, nn.ModuleDict)) and len(embedding):
        raise ValueError(
            f"{path!r} ({kind}) has LoRA on an embedding; the load initialises LoRA on linear "
            "layers only: load the base weights before adding adapters, on a CPU-built model"
        )
    found: list[AdapterInit] = []
    ranks = getattr(layer, "r", {})
    for adapter in lora_a:
        use_dora = getattr(layer, "use_dora", None)
        variant = getattr(layer, "lora_variant", None)
        if _lora._flag(use_dora, adapter) or (isinstance(variant, Mapping) and adapter in variant):
            raise ValueError(
                f"{path!r} ({kind}) uses DoRA or another LoRA variant for adapter {adapter!r}, "
                "whose initial values depend on the base weights; load the base weights before "
                "adding adapters, on a CPU-built model"
            )
        if adapter not in lora_b:
            raise ValueError(f"{path!r} ({kind}) has lora_A but no lora_B for {adapter!r}")
        rank = ranks.get(adapter) if isinstance(ranks, Mapping) else None
        weight = _lora._weight(lora_a[adapter], f"{path}.lora_A.{adapter}")
        found.append(
            AdapterInit(
                layer=path,
                adapter=adapter,
                kind=_init_kind(model, adapter, path),
                rank=int(rank) if isinstance(rank, int) else int(weight.shape[0]),
            )
        )
    return found


def load_view(model: nn.Module, state_names: Sequence[str], *, initialise: bool) -> LoadView:
    """How a base checkpoint loads into ``model``; with ``initialise`` refuses adapters whose
    first values need the base weights."""
    target, prefix = _lora.base_model(model)
    cut = f"{prefix}." if prefix else ""
    wrapped = _lora.wrapped_modules(target)
    adapters: list[AdapterInit] = []
    for path in wrapped:
        module = target.get_submodule(path)
        if initialise and _lora._is_tuner_layer(module):
            full = cut + path
            adapters.extend(_layer_adapters(model, full, module))
    names: dict[str, str] = {}
    skipped: set[str] = set()
    for name in state_names:
        if not name.startswith(cut):
            continue  # outside the wrapped model: no base checkpoint holds it
        inner = name[len(cut) :]
        outer = next((p for p in wrapped if inner.startswith(f"{p}.")), None)
        if outer is None:
            names[name] = inner
            continue
        child, _, rest = inner[len(outer) + 1 :].partition(".")
        if child in ("base_layer", "original_module"):
            names[name] = f"{outer}.{rest}"
        elif child == "modules_to_save":
            names[name] = f"{outer}.{rest.partition('.')[2]}"
        elif child in _ADAPTER_CHILDREN:
            skipped.add(name)
        else:
            raise ValueError(
                f"{name!r} is adapter state the load does not initialise ({child}); load the "
                "base weights before adding adapters, on a CPU-built model"
            )
    return LoadView(
        target=target, names=names, adapters=tuple(adapters), skipped=frozenset(skipped)
    )


def _kaiming(shape: Sequence[int]) -> torch.Tensor:
    """``nn.Linear``'s weight initialisation (kaiming uniform, a=sqrt(5)) on the CPU."""
    value = torch.empty(tuple(shape))
    nn.init.kaiming_uniform_(value, a=math.sqrt(5))
    return value


def _linear_draws(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """What constructing an ``nn.Linear`` of this shape draws (to keep peft's order)."""
    _kaiming(weight.shape)
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0.0
        torch.empty(tuple(bias.shape)).uniform_(-bound, bound)


#: Writes a full tensor into a (possibly sharded) tensor: this rank's part only.
CopyFull = Callable[[torch.Tensor, torch.Tensor], None]


def initialise_adapters(
    model: nn.Module, adapters: Sequence[AdapterInit], copy_full_into_: CopyFull
) -> None:
    """Give each adapter peft's initial values: full tensors drawn alike on every rank,
    each keeping its shard (``reset_parameters`` would draw the same shard everywhere)."""
    for item in adapters:
        layer = model.get_submodule(item.layer)
        down: Any = layer._modules["lora_A"]
        up: Any = layer._modules["lora_B"]
        a_weight = _lora._weight(down[item.adapter], f"{item.layer}.lora_A")
        b_module = up[item.adapter]
        b_weight = _lora._weight(b_module, f"{item.layer}.lora_B")
        b_bias = getattr(b_module, "bias", None)
        b_bias = b_bias if isinstance(b_bias, torch.Tensor) else None
        _linear_draws(a_weight, None)
        _linear_draws(b_weight, b_bias)
        if item.kind is True:
            first = _kaiming(a_weight.shape)
        else:
            first = torch.empty(tuple(a_weight.shape)).normal_(0.0, 1.0 / item.rank)
        copy_full_into_(a_weight, first)
        copy_full_into_(b_weight, torch.zeros(tuple(b_weight.shape)))
        if b_bias is not None:
            copy_full_into_(b_bias, torch.zeros(tuple(b_bias.shape)))

"""A sharded model's own ``save_pretrained``: collective, and the library's export.

transformers' ``model.save_pretrained(d)`` and peft's ``peft_model.save_pretrained(d)``
read the parameters as plain tensors and fail deep in torch on a sharded model;
users call them out of habit. When a plan is applied, the instance (and a peft
model's base model) gets its own ``save_pretrained``, bound to the library's
export (a ``functools.partial`` in the instance's ``__dict__``, so it pickles
and deep-copies with the model): every rank must call it, rank 0 writes, and the files are those of
``fsdp_core.hf.save_pretrained`` (transformers models) or the adapter export
(peft models). The class's method stays reachable as
``type(model).save_pretrained`` and is what the library runs internally to learn
checkpoint names. Keyword arguments of the original that the export cannot
honour are refused, on every rank and before anything is written.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_core.hf import _hf_model, _lora, _trainer_guard
from fsdp_core.hf._save import DEFAULT_MAX_SHARD_SIZE, export_adapter, save_pretrained
from fsdp_core.sharding import original_class

logger = logging.getLogger(__name__)

_ATTRIBUTE = "save_pretrained"


def install_collective_save(model: nn.Module) -> tuple[str, ...]:
    """Bind a collective ``save_pretrained`` to ``model`` (and a peft model's base); the paths.

    Only instances whose class defines ``save_pretrained`` are touched: a
    transformers model gets ``save_hf_model``,
    a peft model ``save_peft_model``. The transformers model also gets the flag
    that makes an unmodified ``Trainer`` refuse it (``fsdp_core.hf._trainer_guard``).
    """
    _trainer_guard.mark_sharded_by_library(model)
    targets: list[tuple[str, nn.Module, Callable[..., None]]] = []
    if _lora.is_peft_model(model):
        targets.append(("", model, save_peft_model))
        base, path = _lora.base_model(model)
        if base is not model and _hf_model.is_hf_model(base):
            targets.append((path, base, save_hf_model))
    elif _hf_model.is_hf_model(model):
        targets.append(("", model, save_hf_model))
    installed: list[str] = []
    for path, module, method in targets:
        if not callable(getattr(type(module), _ATTRIBUTE, None)):
            continue
        # A partial, not a bound method: it pickles and deep-copies with the model.
        module.__dict__[_ATTRIBUTE] = functools.partial(method, module)
        installed.append(path)
    if installed:
        logger.debug("collective save_pretrained bound to %s", [p or "<root>" for p in installed])
    return tuple(installed)


def _refuse(method: str, problems: Iterable[str]) -> None:
    found = list(problems)
    if found:
        raise ValueError(
            f"{method} on a sharded model is the library's collective export "
            f"(fsdp_core.hf.save_pretrained), which cannot honour {'; '.join(found)}. Call it on "
            "every rank without them, or call the original on an unsharded model: "
            f"type(model).{_ATTRIBUTE}(model, ...)"
        )


def _unknown(method: str, kwargs: dict[str, Any], known: Iterable[str]) -> None:
    if kwargs:
        raise TypeError(
            f"{method}() got unexpected keyword arguments {sorted(kwargs)}; it accepts "
            f"{', '.join(known)}"
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _check_save_function(kwargs: dict[str, Any]) -> None:
    """Take ``save_function`` out of ``kwargs``: accelerate's examples pass
    ``save_function=accelerator.save``, which transformers 5 and peft accept and never
    call; the export writes its own files, so it is not called either."""
    save_function = kwargs.pop("save_function", None)
    if save_function is not None and not callable(save_function):
        raise TypeError(f"save_function must be callable, got {save_function!r}")


def save_hf_model(
    self: nn.Module,
    save_directory: str | os.PathLike[str],
    is_main_process: bool = True,
    state_dict: dict[str, Any] | None = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    variant: str | None = None,
    token: str | bool | None = None,
    save_peft_format: bool = True,
    save_original_format: bool = True,
    distributed_checkpoint: bool = False,
    *,
    safe_serialization: bool = True,
    merge_adapters: bool = False,
    timeout: float | timedelta | None = None,
    **kwargs: Any,
) -> None:
    """transformers' ``save_pretrained`` on a sharded model: ``fsdp_core.hf.save_pretrained``.

    Collective: call it on every rank (``is_main_process`` is accepted and not
    needed: rank 0 writes). ``max_shard_size`` is honoured (default: the
    library's, 5GB, as for ``save_pretrained(model, d)``); ``save_function``
    (accelerate's examples pass ``accelerator.save``) is accepted and not called,
    as in transformers 5; ``merge_adapters=True`` merges LoRA-wrapped modules and
    ``timeout`` bounds the wait for the other ranks, as in the library's export.
    ``state_dict``, ``push_to_hub``, ``variant``, ``token``, ``safe_serialization=False``,
    ``save_original_format=False`` and ``distributed_checkpoint=True`` are refused;
    ``save_peft_format`` only concerns adapters loaded through transformers, which the
    export refuses unless merged.
    """
    name = f"{original_class(self).__name__}.{_ATTRIBUTE}"
    _check_save_function(kwargs)
    _unknown(
        name,
        kwargs,
        (
            "save_directory, is_main_process, max_shard_size, save_peft_format, "
            "merge_adapters, timeout, save_function (not called) (and, only at their "
            "defaults, state_dict, push_to_hub, "
            "variant, token, safe_serialization, save_original_format, distributed_checkpoint)",
        ),
    )
    for flag, value in (
        ("is_main_process", is_main_process),
        ("save_peft_format", save_peft_format),
        ("merge_adapters", merge_adapters),
    ):
        _check_bool(flag, value)
    _refuse(
        name,
        [
            text
            for text, bad in (
                ("state_dict= (it gathers the model's own tensors)", state_dict is not None),
                ("push_to_hub=True", push_to_hub is not False),
                (f"variant={variant!r}", variant is not None),
                ("token= (only used to push to the Hub)", token is not None),
                (
                    "safe_serialization=False (it writes safetensors)",
                    safe_serialization is not True,
                ),
                ("save_original_format=False", save_original_format is not True),
                ("distributed_checkpoint=True", distributed_checkpoint is not False),
            )
            if bad
        ],
    )
    save_pretrained(
        self,
        save_directory,
        max_shard_size=max_shard_size,
        merge_adapters=merge_adapters,
        timeout=timeout,
    )


def save_peft_model(
    self: nn.Module,
    save_directory: str | os.PathLike[str],
    safe_serialization: bool = True,
    selected_adapters: list[str] | None = None,
    save_embedding_layers: bool | str = "auto",
    is_main_process: bool = True,
    path_initial_model_for_weight_conversion: str | None = None,
    *,
    merge_adapters: bool = False,
    timeout: float | timedelta | None = None,
    **kwargs: Any,
) -> None:
    """peft's ``save_pretrained`` on a sharded model: the library's adapter export.

    Collective: call it on every rank (``is_main_process`` is accepted and not
    needed: rank 0 writes). Writes what peft writes, for each adapter in
    ``selected_adapters`` (default: all), ``"default"`` in ``save_directory``
    and any other in a sub-directory of its name; only the adapter tensors
    (and ``modules_to_save``) are gathered. ``save_embedding_layers`` is
    honoured; ``save_function`` is accepted and not called, as in peft;
    ``merge_adapters=True`` instead writes the merged model
    (``fsdp_core.hf.save_pretrained(model, d, merge_adapters=True)``).
    ``safe_serialization=False``, ``path_initial_model_for_weight_conversion``
    and ``state_dict`` are refused.
    """
    name = f"{original_class(self).__name__}.{_ATTRIBUTE}"
    state_dict = kwargs.pop("state_dict", None)
    _check_save_function(kwargs)
    _unknown(
        name,
        kwargs,
        (
            "save_directory, selected_adapters, save_embedding_layers, is_main_process, "
            "merge_adapters, timeout, save_function (not called) (and, only at their "
            "defaults, safe_serialization, "
            "path_initial_model_for_weight_conversion, state_dict)",
        ),
    )
    _check_bool("is_main_process", is_main_process)
    _check_bool("merge_adapters", merge_adapters)
    adapters = _selected_adapters(self, selected_adapters)
    _check_embedding_layers(save_embedding_layers)
    _refuse(
        name,
        _peft_refusals(
            state_dict=state_dict,
            safe_serialization=safe_serialization,
            path_initial_model_for_weight_conversion=path_initial_model_for_weight_conversion,
            selected_with_merge=merge_adapters and selected_adapters is not None,
        ),
    )
    if merge_adapters:
        save_pretrained(self, save_directory, merge_adapters=True, timeout=timeout)
        return
    _export_adapters(self, Path(save_directory), adapters, save_embedding_layers, timeout)


def _selected_adapters(model: nn.Module, selected_adapters: object) -> list[str]:
    """The adapters to write (default: all; a name given twice, once), checked before the
    first adapter is exported so that a bad name leaves nothing half written."""
    known = _lora.adapter_names(model)
    if selected_adapters is None:
        adapters = list(known)
    elif isinstance(selected_adapters, (list, tuple)) and all(
        isinstance(a, str) for a in selected_adapters
    ):
        adapters = list(dict.fromkeys(selected_adapters))
    else:
        raise TypeError(
            f"selected_adapters must be a list of adapter names, got {selected_adapters!r}"
        )
    unknown = [a for a in adapters if a not in known]
    if unknown or not adapters:
        raise ValueError(
            f"selected_adapters={selected_adapters!r} names no adapter or unknown ones "
            f"{unknown}; the model's adapters: {list(known)}"
        )
    return adapters


def _check_embedding_layers(save_embedding_layers: object) -> None:
    """peft's three values only (``True``, ``False``, ``"auto"``), refused before writing."""
    if save_embedding_layers != "auto" and not isinstance(save_embedding_layers, bool):
        raise TypeError(
            f"save_embedding_layers must be True, False or 'auto', got {save_embedding_layers!r}"
        )


def _peft_refusals(
    *,
    state_dict: object,
    safe_serialization: bool,
    path_initial_model_for_weight_conversion: str | None,
    selected_with_merge: bool,
) -> list[str]:
    """What peft's ``save_pretrained`` was asked that the library's export cannot honour."""
    return [
        text
        for text, bad in (
            ("state_dict= (it gathers the model's own tensors)", state_dict is not None),
            (
                "safe_serialization=False (it writes safetensors)",
                safe_serialization is not True,
            ),
            (
                "path_initial_model_for_weight_conversion=",
                path_initial_model_for_weight_conversion is not None,
            ),
            (
                "selected_adapters= with merge_adapters=True (the active adapters are merged)",
                selected_with_merge,
            ),
        )
        if bad
    ]


def _export_adapters(
    model: nn.Module,
    root: Path,
    adapters: list[str],
    save_embedding_layers: bool | str,
    timeout: float | timedelta | None,
) -> None:
    """One collective adapter export per adapter, as peft lays them out: ``"default"``
    in ``root`` (written first), any other in a sub-directory of its name."""
    for adapter in sorted(adapters, key=lambda a: a != "default"):  # "default" (the root) first
        export_adapter(
            model,
            root if adapter == "default" else root / adapter,
            adapter=adapter,
            save_embedding_layers=save_embedding_layers,
            timeout=timeout,
        )

"""A sharded model's own ``save_pretrained``: collective, and the library's export.

transformers' and peft's ``save_pretrained`` fail deep in torch on a sharded model, and
users call them out of habit. Applying a plan binds the instance (and a peft model's
base) a ``functools.partial`` of the library's export (it pickles and deep-copies with
the model); the class's method stays reachable as ``type(model).save_pretrained``.
Arguments the export cannot honour are refused on every rank before anything is written.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
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
    The transformers model also gets the flag an unmodified ``Trainer`` refuses."""
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
        module.__dict__[_ATTRIBUTE] = functools.partial(method, module)
        installed.append(path)
    if installed:
        logger.debug("collective save_pretrained bound to %s", [p or "<root>" for p in installed])
    return tuple(installed)


def _refuse(method: str, problems: dict[str, bool]) -> None:
    """Refuse every argument whose entry in ``problems`` is true."""
    found = [text for text, bad in problems.items() if bad]
    if found:
        raise ValueError(
            f"{method} on a sharded model is the library's collective export "
            f"(fsdp_core.hf.save_pretrained), which cannot honour {'; '.join(found)}. Call it on "
            "every rank without them, or call the original on an unsharded model: "
            f"type(model).{_ATTRIBUTE}(model, ...)"
        )


def _check_kwargs(method: str, kwargs: dict[str, Any], known: str, **flags: object) -> None:
    """Unknown keywords and non-bool ``flags`` refused; ``save_function`` (accelerate's
    examples pass ``accelerator.save``; transformers 5 and peft never call it) dropped."""
    save_function = kwargs.pop("save_function", None)
    if save_function is not None and not callable(save_function):
        raise TypeError(f"save_function must be callable, got {save_function!r}")
    if kwargs:
        raise TypeError(
            f"{method}() got unexpected keyword arguments {sorted(kwargs)}; it accepts {known}"
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


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

    Collective (rank 0 writes; ``is_main_process`` is not needed). ``max_shard_size``
    (default: the library's), ``merge_adapters`` and ``timeout`` are the export's;
    ``save_peft_format`` only concerns adapters the export refuses unless merged.
    """
    name = f"{original_class(self).__name__}.{_ATTRIBUTE}"
    _check_kwargs(
        name,
        kwargs,
        "save_directory, is_main_process, max_shard_size, save_peft_format, merge_adapters, "
        "timeout, save_function (not called) (and, only at their defaults, state_dict, "
        "push_to_hub, variant, token, safe_serialization, save_original_format, "
        "distributed_checkpoint)",
        is_main_process=is_main_process,
        save_peft_format=save_peft_format,
        merge_adapters=merge_adapters,
    )
    _refuse(
        name,
        {
            "state_dict= (it gathers the model's own tensors)": state_dict is not None,
            "push_to_hub=True": push_to_hub is not False,
            f"variant={variant!r}": variant is not None,
            "token= (only used to push to the Hub)": token is not None,
            "safe_serialization=False (it writes safetensors)": safe_serialization is not True,
            "save_original_format=False": save_original_format is not True,
            "distributed_checkpoint=True": distributed_checkpoint is not False,
        },
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

    Collective (rank 0 writes). Writes what peft writes for each adapter in
    ``selected_adapters`` (default: all): ``"default"`` in ``save_directory``, any other
    in a sub-directory of its name. ``merge_adapters=True`` writes the merged model
    instead (``fsdp_core.hf.save_pretrained(model, d, merge_adapters=True)``).
    """
    name = f"{original_class(self).__name__}.{_ATTRIBUTE}"
    state_dict = kwargs.pop("state_dict", None)
    _check_kwargs(
        name,
        kwargs,
        "save_directory, selected_adapters, save_embedding_layers, is_main_process, "
        "merge_adapters, timeout, save_function (not called) (and, only at their defaults, "
        "safe_serialization, path_initial_model_for_weight_conversion, state_dict)",
        is_main_process=is_main_process,
        merge_adapters=merge_adapters,
    )
    adapters = _selected_adapters(self, selected_adapters)
    if save_embedding_layers != "auto" and not isinstance(save_embedding_layers, bool):
        raise TypeError(
            f"save_embedding_layers must be True, False or 'auto', got {save_embedding_layers!r}"
        )
    _refuse(
        name,
        {
            "state_dict= (it gathers the model's own tensors)": state_dict is not None,
            "safe_serialization=False (it writes safetensors)": safe_serialization is not True,
            "path_initial_model_for_weight_conversion=": (
                path_initial_model_for_weight_conversion is not None
            ),
            "selected_adapters= with merge_adapters=True (the active adapters are merged)": (
                merge_adapters and selected_adapters is not None
            ),
        },
    )
    if merge_adapters:
        save_pretrained(self, save_directory, merge_adapters=True, timeout=timeout)
        return
    root = Path(save_directory)
    for adapter in sorted(adapters, key=lambda a: a != "default"):  # "default" (root) first
        export_adapter(
            self,
            root if adapter == "default" else root / adapter,
            adapter=adapter,
            save_embedding_layers=save_embedding_layers,
            timeout=timeout,
        )


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

"""What the checkpoint functions use of Hugging Face models, without importing transformers.

Everything here is duck-typed on the caller's model. transformers renames keys between
the module tree and the files (LLaVA's ``language_model.model.*`` for the module
``model.language_model.*``, tied aliases dropped); rather than re-implementing those
rules, the model class's own ``save_pretrained`` (peft's for an adapter) is run once on
a state dict of numbered 0-d markers, and the markers it writes tell which key each
module name becomes. Non-persistent buffers are recomputed by the owning sub-model's
``_init_weights``; the config is written by its own ``save_pretrained``.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_core.hf import _transformers as tf
from fsdp_core.hf._safetensors_dir import open_file, read_layout
from fsdp_core.sharding import original_class

logger = logging.getLogger(__name__)

_FLAG = tf.IS_HF_INITIALIZED


def is_hf_model(model: nn.Module) -> bool:
    """A model with ``save_pretrained`` and a config that has one (a transformers model)."""
    config = getattr(model, "config", None)
    return callable(getattr(model, "save_pretrained", None)) and callable(
        getattr(config, "save_pretrained", None)
    )


@contextmanager
def _original_classes(model: nn.Module) -> Iterator[None]:
    """transformers looks conversions up by class name; show it the unsharded classes."""
    swapped = [(m, type(m)) for m in model.modules() if original_class(m) is not type(m)]
    for module, _ in swapped:
        module.__class__ = original_class(module)
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


@contextmanager
def _writes_on_this_rank(model: nn.Module) -> Iterator[None]:
    """transformers saves on global rank 0 only; every rank derives the names itself."""
    if not callable(getattr(model, tf.SHOULD_SAVE_ON_THIS_RANK, None)):
        yield
        return
    model.__dict__[tf.SHOULD_SAVE_ON_THIS_RANK] = lambda is_main_process: True
    try:
        yield
    finally:
        del model.__dict__[tf.SHOULD_SAVE_ON_THIS_RANK]


@contextmanager
def _quiet(save: Any) -> Iterator[None]:
    """No progress bar from a save run only to read names (the switch is found in the
    saving function's own module, so transformers is never imported here)."""
    helpers = getattr(getattr(save, "__func__", save), "__globals__", {}).get(tf.LOGGING_GLOBAL)
    enabled = getattr(helpers, "is_progress_bar_enabled", None)
    disable = getattr(helpers, "disable_progress_bar", None)
    enable = getattr(helpers, "enable_progress_bar", None)
    if not (callable(enabled) and callable(disable) and callable(enable)) or not enabled():
        yield
        return
    disable()
    try:
        yield
    finally:
        enable()


@contextmanager
def _base_names_only(model: nn.Module) -> Iterator[None]:
    """transformers saves only adapters of a model that loaded some: the markers are base names."""
    if getattr(model, tf.HF_PEFT_CONFIG_LOADED, False) is not True:
        yield
        return
    model.__dict__[tf.HF_PEFT_CONFIG_LOADED] = False
    try:
        yield
    finally:
        model.__dict__[tf.HF_PEFT_CONFIG_LOADED] = True


def own_save(model: nn.Module) -> Any:
    """The model class's ``save_pretrained`` bound to ``model``, bypassing an instance override."""
    method: Any = type(model).save_pretrained  # type: ignore[attr-defined]
    return method.__get__(model)


@contextmanager
def _config_kept(config: Any) -> Iterator[None]:
    """``save_pretrained`` sets ``dtype`` and ``architectures`` on the config: undo it."""
    saved = {name: getattr(config, name) for name in ("dtype", "architectures")}
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def checkpoint_names(model: nn.Module, groups: Sequence[Sequence[str]]) -> dict[str, str]:
    """Module name -> checkpoint key, as the model's own ``save_pretrained`` writes them.

    ``groups`` are the model's state names, aliases of one tensor together; names the
    model would not save (a dropped tied alias) are absent from the result.
    """
    name = original_class(model).__name__
    with (
        tempfile.TemporaryDirectory(prefix="fsdp-core-names-") as tmp,
        _writes_on_this_rank(model),
        _base_names_only(model),
        _config_kept(getattr(model, "config", None)),
    ):
        _save_markers(
            model,
            groups,
            tmp,
            "the checkpoint key names",
            "; pass key_mapping= (module name -> checkpoint key)",
        )
        try:
            layout = read_layout(tmp)
        except FileNotFoundError:  # a wrapper whose save_pretrained writes something else
            raise ValueError(
                f"{name}.save_pretrained does not write model weights (no model.safetensors), "
                "so the names of its checkpoint keys cannot be derived from it; pass "
                "key_mapping= (module name -> checkpoint key)"
            ) from None
        return _read_markers(Path(tmp), groups, layout.keys_by_file(), remedy=": pass key_mapping=")


def _save_markers(
    model: nn.Module,
    groups: Sequence[Sequence[str]],
    tmp: str,
    what: str,
    remedy: str = "",
    **options: Any,
) -> None:
    """The class's ``save_pretrained`` of one numbered 0-d marker per group into ``tmp``."""
    save = own_save(model)
    markers: dict[str, torch.Tensor] = {}
    for index, group in enumerate(groups):
        marker = torch.tensor(index, dtype=torch.int64)  # one object per group: aliases share it
        markers.update(dict.fromkeys(group, marker))
    with _original_classes(model), _quiet(save):
        try:
            save(tmp, state_dict=markers, **options)
        except Exception as exc:
            raise ValueError(
                f"could not derive {what} of {original_class(model).__name__} from its "
                f"save_pretrained ({type(exc).__name__}: {exc}){remedy}"
            ) from exc


#: The adapter files ``PeftModel.save_pretrained`` writes (safetensors serialisation).
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: What an adapter export replaces in its directory (peft's pickle format included).
ADAPTER_FILES = frozenset({ADAPTER_WEIGHTS, ADAPTER_CONFIG, "adapter_model.bin"})


def adapter_checkpoint(
    model: nn.Module,
    groups: Sequence[Sequence[str]],
    *,
    adapter: str,
    save_embedding_layers: bool | str = "auto",
) -> tuple[dict[str, str], dict[str, bytes]]:
    """peft's export of one adapter: state name -> adapter key (only the names it exports),
    and ``adapter_config.json`` as peft wrote it, by file name."""
    name = original_class(model).__name__
    with tempfile.TemporaryDirectory(prefix="fsdp-core-adapter-") as tmp:
        _save_markers(
            model,
            groups,
            tmp,
            "the adapter export",
            selected_adapters=[adapter],
            save_embedding_layers=save_embedding_layers,
        )
        folder = Path(tmp) if adapter == "default" else Path(tmp) / adapter
        weights = folder / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise ValueError(
                f"{name}.save_pretrained wrote no {ADAPTER_WEIGHTS} for adapter {adapter!r}"
            )
        with open_file(weights) as handle:
            keys = sorted(handle.keys())
        table = _read_markers(folder, groups, [(ADAPTER_WEIGHTS, keys)], remedy="")
        config = folder / ADAPTER_CONFIG
        if not config.is_file():
            raise ValueError(f"{name}.save_pretrained wrote no {ADAPTER_CONFIG} for {adapter!r}")
        return table, {ADAPTER_CONFIG: config.read_bytes()}


def _read_markers(
    directory: Path,
    groups: Sequence[Sequence[str]],
    files: Iterable[tuple[str, list[str]]],
    *,
    remedy: str,
) -> dict[str, str]:
    names: dict[str, str] = {}
    seen: set[int] = set()
    for file, keys in files:
        with open_file(directory / file) as handle:
            for key in keys:
                value = handle.get_tensor(key)
                index = int(value.item()) if value.dim() == 0 and value.dtype == torch.int64 else -1
                if not 0 <= index < len(groups) or index in seen:
                    raise ValueError(
                        f"save_pretrained of this model transforms tensors (checkpoint key "
                        f"{key!r} is not one renamed state tensor); only renaming is "
                        f"supported{remedy}"
                    )
                seen.add(index)
                names.update(dict.fromkeys(groups[index], key))
    return names


def _initializer(model: nn.Module, path: str) -> Any:
    """``_init_weights`` of the innermost sub-model (with a config) that contains ``path``."""
    found = None
    module = model
    parts = path.split(".") if path else []
    for depth in range(len(parts) + 1):
        if depth:
            module = module.get_submodule(parts[depth - 1])
        init = getattr(module, tf.INIT_WEIGHTS, None)
        if callable(init) and getattr(module, "config", None) is not None:
            found = init
    return found


def recompute_buffers(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Run the owning sub-model's ``_init_weights`` on each module holding one of ``names``
    (its parameters marked initialised, so only buffers are written); the names it ran for."""
    wanted = list(names)
    ran: list[str] = []
    for path in sorted({name.rpartition(".")[0] for name in wanted}):
        init = _initializer(model, path)
        if init is None:
            continue
        module = model.get_submodule(path)
        params = list(module.parameters())
        before = [getattr(p, _FLAG, None) for p in params]
        for param in params:
            setattr(param, _FLAG, True)
        try:
            with torch.no_grad():
                init(module)
        finally:
            for param, flag in zip(params, before, strict=True):
                if flag is None:
                    delattr(param, _FLAG)
                else:
                    setattr(param, _FLAG, flag)
        ran.extend(n for n in wanted if n.rpartition(".")[0] == path)
        logger.debug("recomputed buffers of %r with %s", path, init)
    return ran


def write_configs(model: nn.Module, directory: Path, *, dtype: torch.dtype | None) -> list[str]:
    """Write the model's config (with its class and ``dtype``, as ``save_pretrained`` does,
    on a copy) and generation config next to exported weights; the files."""
    written: list[str] = []
    config: Any = getattr(model, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        config = copy.deepcopy(config)
        if hasattr(config, "architectures"):
            config.architectures = [original_class(model).__name__]
        if dtype is not None and hasattr(config, "dtype"):
            config.dtype = str(dtype).removeprefix("torch.")
        config.save_pretrained(str(directory))
        written.append("config.json")
    generation: Any = getattr(model, "generation_config", None)
    if callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(str(directory))
        written.append("generation_config.json")
    return written

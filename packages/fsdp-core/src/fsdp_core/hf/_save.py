"""``save_pretrained`` and ``export_adapter``: a (sharded) model out as a Hugging Face directory.

The implementation behind [`save_pretrained`][fsdp_core.hf.pretrained.save_pretrained];
[fsdp_core.hf.pretrained][] is the public module. Every rank gathers tensor by tensor,
rank 0 writes one output file at a time beside the old export and swaps it in.
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_core import _export_swap
from fsdp_core.collective_entry import CollectiveCall, enter_collective, whole_world_ranks
from fsdp_core.dtype_units import dominant_dtype
from fsdp_core.hf import _hf_model, _lora
from fsdp_core.hf._safetensors_dir import (
    file_names,
    is_weight_file,
    open_file,
    plan_files,
    verify_export,
    write_file,
    write_index,
)
from fsdp_core.hf._slots import (
    KeyMapping,
    PathLike,
    Slot,
    check_call,
    hf_names,
    listed,
    persistent_slots,
    renamed,
    reshard,
)
from fsdp_core.sizes import parse_size
from fsdp_core.weights_check import is_meta

# The public module's logger: the split into private modules keeps the name users configure.
logger = logging.getLogger("fsdp_core.hf.pretrained")

#: The largest export file by default, whichever way the export is called: rank 0 holds
#: one output file of full tensors at a time, so this bounds its host memory (smaller
#: than transformers' own 50GB default, which assumes the model is already in memory).
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: What to do instead of exporting a pipeline stage: one directory written by every
#: stage's first rank would be a race whose last swap leaves one stage's tensors.
_STAGES = (
    "export from a model that holds every stage (save the stages' DCP checkpoint from "
    "every rank and load it into the whole model), or write per stage: each stage's "
    "get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True)) into a "
    "sub-directory of its own, from its first rank"
)


def _gathered(
    slot: Slot, terms: Sequence[_lora.AdapterAddition], *, keep: bool
) -> torch.Tensor | None:
    """The slot's whole tensor with its LoRA ``terms`` merged in (collectives on every rank)."""
    value = _full(slot.tensor, keep=keep)
    parts = [
        (_full(t.up, keep=keep), None if t.down is None else _full(t.down, keep=keep), t)
        for t in terms
    ]
    if value is None or not parts:
        return value
    return _lora.merged(value, [(up, down, t) for up, down, t in parts if up is not None])


def _full(tensor: torch.Tensor, *, keep: bool) -> torch.Tensor | None:
    """The whole tensor on this rank's CPU when ``keep`` (a collective for DTensors)."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            full = tensor.full_tensor()
            return full.detach().cpu() if keep else None
        return tensor.detach().cpu().clone() if keep else None


def _unwrapped_slots(
    model: nn.Module, slots: Sequence[Slot], *, merge_adapters: bool
) -> tuple[nn.Module, list[Slot], _lora.ExportView]:
    """The model whose names are exported (a peft model's base when merging) and the slots
    under its unwrapped names; raises for wrapped modules not merged, or unmergeable."""
    target, prefix = _lora.base_model(model) if merge_adapters else (model, "")
    view = _lora.export_view(target)
    if view.wrapped and not merge_adapters:
        raise _lora.wrapped_error(target, view.wrapped)
    if merge_adapters and not view.wrapped:
        raise ValueError(
            f"merge_adapters=True, but {type(target).__name__} has no adapter-wrapped modules "
            "to merge; leave the option out"
        )
    return target, renamed(slots, view.names, f"{prefix}." if prefix else ""), view


def _export_keys(
    model: nn.Module,
    slots: Sequence[Slot],
    key_mapping: KeyMapping | None,
    *,
    merge_adapters: bool,
) -> tuple[nn.Module, list[tuple[str, Slot]], dict[str, tuple[_lora.AdapterAddition, ...]]]:
    """The model whose config is written, checkpoint key -> slot, and the LoRA terms
    merged into each key; raises when a merged tensor would not be saved."""
    target, slots, view = _unwrapped_slots(model, slots, merge_adapters=merge_adapters)
    if key_mapping is not None:
        entries = [(key_mapping(slot.names[0]), slot) for slot in slots]
    elif _hf_model.is_hf_model(target):
        table = hf_names(target, slots)
        entries = [(table[s.names[0]], s) for s in slots if s.names[0] in table]
    else:
        entries = [(slot.names[0], slot) for slot in slots]
    terms: dict[str, tuple[_lora.AdapterAddition, ...]] = {}
    for key, slot in entries:
        found = [view.terms[n] for n in slot.names if n in view.terms]
        if found:
            terms[key] = found[0]
    lost = sorted(set(view.terms) - {n for _, s in entries for n in s.names})
    if lost:
        raise ValueError(
            f"the merged tensors {listed(lost)} would not be saved (the model's "
            "save_pretrained drops them); no export was written"
        )
    return target, _unique(entries), terms


def _unique(entries: list[tuple[str, Slot]]) -> list[tuple[str, Slot]]:
    """``entries`` unchanged; two tensors under one key would silently overwrite: refused."""
    counts = Counter(key for key, _ in entries)
    twice = [key for key, count in counts.items() if count > 1]
    if twice:
        raise ValueError(f"several model tensors would be saved as {listed(twice)}")
    return entries


def save_pretrained(
    model: nn.Module,
    directory: PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    key_mapping: KeyMapping | None = None,
    merge_adapters: bool = False,
    timeout: float | timedelta | None = None,
) -> tuple[str, ...]:
    """Write ``model`` (sharded or not) as a directory ``from_pretrained`` loads; the files.

    Call it on every rank. Sharded parameters are gathered tensor by tensor and rank 0
    writes them in the model's dtypes, in files of at most ``max_shard_size`` (a bigger
    tensor gets its own) with an index when there are several, plus the config. Names
    are those the model's own ``save_pretrained`` writes for transformers models (tied
    aliases once), else the module names, unless ``key_mapping`` (module name ->
    checkpoint key) says otherwise. Rank 0 holds one output file of full tensors at a time.

    Collective and atomic: every rank of the model's mesh must call it (it waits at most
    ``timeout``); every precondition (options, meta tensors, names, a writable
    destination with room) is agreed before the first gather, and a failure on any rank
    is raised on every rank. Rank 0 writes into a temporary sibling of ``directory``,
    reads it back and swaps it in, so ``directory`` holds the complete old export or the
    complete new one; the user's other files there are kept.

    LoRA (peft): a ``PeftModel`` is exported as its active adapter alone, in peft's
    format, which ``PeftModel.from_pretrained(base, directory)`` loads. With
    ``merge_adapters=True`` a ``PeftModel`` (or its base model) is exported merged: each
    LoRA layer's base weight plus ``scaling * B @ A``, under the base model's names (the
    model is not changed). A model with adapter-wrapped modules is never saved under
    wrapped names: without ``merge_adapters`` that fails on every rank before anything
    is written, as do adapters the merge does not implement (DoRA and other variants,
    LoRA on embeddings or convolutions).

    Args:
        model: the model (sharded or not; a ``PeftModel`` writes its adapter).
        directory: the export directory (created, or its export replaced).
        max_shard_size: the largest file, in bytes or as ``"5GB"``.
        key_mapping: module name -> checkpoint key.
        merge_adapters: write LoRA layers merged into their base weights.
        timeout: the arrival check's timeout in seconds or a timedelta.

    Returns:
        The names of the files written.

    Raises:
        CollectiveCallError: a rank did not arrive or failed (on every rank).
        ValueError: the model is a pipeline stage (sharded over part of the world), on
            every rank before anything is written; the message says what to do instead.
    """
    ranks = whole_world_ranks(model, "save_pretrained", _STAGES)
    with enter_collective("save_pretrained", ranks=ranks, timeout=timeout) as call:
        plan = call.run(
            lambda: _plan_export(model, max_shard_size, key_mapping, merge_adapters),
            step="checking the model and the options",
        )
        if plan is None:  # a PeftModel: its adapter alone, in peft's format
            return _export_adapter(model, directory, None, "auto", call)
        with _staging_directory(call, directory, plan.total_size, replaces=is_weight_file) as work:
            written = _write_export(model, plan, work, call)
    logger.info("saved %d tensors to %s in %d files", len(plan.entries), directory, len(plan.files))
    return written


@dataclass(frozen=True)
class _ExportPlan:
    """What every rank gathers and rank 0 writes, decided before the first gather."""

    config_model: nn.Module
    entries: list[tuple[str, Slot]]
    terms: Mapping[str, tuple[_lora.AdapterAddition, ...]]  # by checkpoint key: LoRA additions
    files: list[str]
    groups: list[list[str]]
    total_size: int
    slots: list[Slot]


def _plan_export(
    model: nn.Module,
    max_shard_size: int | str,
    key_mapping: KeyMapping | None,
    merge_adapters: bool,
) -> _ExportPlan | None:
    """Every precondition of an export checked on this rank (``None``: a peft adapter)."""
    check_call(model, "save_pretrained", key_mapping)
    limit = parse_size(max_shard_size, argument="max_shard_size")
    if not isinstance(merge_adapters, bool):
        raise TypeError(f"merge_adapters must be a bool, got {merge_adapters!r}")
    if _lora.is_peft_model(model) and not merge_adapters:
        if key_mapping is not None:
            raise ValueError(
                "key_mapping= does not apply to the adapter export of a PeftModel (peft names "
                "its keys); pass merge_adapters=True to export merged weights under new names"
            )
        return None
    reshard(model)
    slots = persistent_slots(model)
    if any(is_meta(slot.tensor) for slot in slots):
        raise ValueError("the model still has tensors on the meta device: load or fill it first")
    target, entries, terms = _export_keys(model, slots, key_mapping, merge_adapters=merge_adapters)
    sizes = [(key, slot.tensor.numel() * slot.tensor.element_size()) for key, slot in entries]
    groups = plan_files(sizes, limit)
    return _ExportPlan(
        config_model=target,
        entries=entries,
        terms=terms,
        files=file_names(len(groups)),
        groups=groups,
        total_size=sum(size for _, size in sizes),
        slots=slots,
    )


def _write_export(
    model: nn.Module, plan: _ExportPlan, work: Path | None, call: CollectiveCall
) -> tuple[str, ...]:
    """Gather file by file; rank 0 (``work`` set) writes each file, then the index and
    configs, and reads the export back. The ranks agree after each file."""
    slot_of = dict(plan.entries)
    weight_map: dict[str, str] = {}
    for name, keys in zip(plan.files, plan.groups, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for key in keys:
            value = _gathered(slot_of[key], plan.terms.get(key, ()), keep=work is not None)
            if value is not None:
                tensors[key] = value.contiguous()
        if work is not None:
            weight_map.update(dict.fromkeys(keys, name))

        def write(name: str = name, tensors: dict[str, torch.Tensor] = tensors) -> None:
            if work is not None:
                write_file(work / name, tensors)

        call.run(write, step=f"writing {name}")
        del tensors
    written = list(plan.files)
    if len(plan.files) > 1:
        written.append("model.safetensors.index.json")

    def finish() -> list[str]:
        if work is None:
            return []
        if len(plan.files) > 1:
            write_index(work, weight_map, plan.total_size)
        floating = (s.tensor for s in plan.slots if s.tensor.dtype.is_floating_point)
        configs = _hf_model.write_configs(plan.config_model, work, dtype=dominant_dtype(floating))
        verify_export(work, weight_map)
        return configs

    configs = call.run(finish, step="writing the index and configs and reading them back")
    return tuple(written + configs)


def export_adapter(
    model: nn.Module,
    directory: PathLike,
    *,
    adapter: str | None = None,
    save_embedding_layers: bool | str = "auto",
    timeout: float | timedelta | None = None,
) -> tuple[str, ...]:
    """Write one adapter (default: the active one) of a (sharded) peft model as peft does;
    the files. Collective and atomic as ``save_pretrained``; only adapter files of
    ``directory`` are replaced, and peft's model card is not written."""
    ranks = whole_world_ranks(model, "export_adapter", _STAGES)
    with enter_collective("save_pretrained", ranks=ranks, timeout=timeout) as call:
        return _export_adapter(model, directory, adapter, save_embedding_layers, call)


@dataclass(frozen=True)
class _AdapterPlan:
    """What every rank gathers and rank 0 writes for one adapter, decided before a gather."""

    adapter: str
    entries: list[tuple[str, Slot]]  # sorted by key
    config: bytes  # adapter_config.json as peft writes it
    total_size: int


def _plan_adapter(
    model: nn.Module, adapter: str | None, save_embedding_layers: bool | str
) -> _AdapterPlan:
    """The adapter's keys and config, checked on this rank before any gather."""
    check_call(model, "save_pretrained")
    name = _lora.active_adapter(model) if adapter is None else adapter
    if name not in _lora.adapter_names(model):
        raise ValueError(
            f"adapter {name!r} is not one of the model's adapters "
            f"{list(_lora.adapter_names(model))}"
        )
    reshard(model)
    slots = persistent_slots(model)
    table, extra = _hf_model.adapter_checkpoint(
        model,
        [slot.names for slot in slots],
        adapter=name,
        save_embedding_layers=save_embedding_layers,
    )
    found = [(slot.names[0], slot) for slot in renamed(slots, table)]
    entries = sorted(_unique(found), key=lambda entry: entry[0])
    if any(is_meta(slot.tensor) for _, slot in entries):
        raise ValueError("the model still has tensors on the meta device: load or fill it first")
    sizes = sum(slot.tensor.numel() * slot.tensor.element_size() for _, slot in entries)
    return _AdapterPlan(name, entries, extra[_hf_model.ADAPTER_CONFIG], sizes)


def _verify_adapter(work: Path, keys: Sequence[str]) -> None:
    """Read the written adapter back: the same keys, a config."""
    path = work / _hf_model.ADAPTER_WEIGHTS
    with open_file(path) as handle:
        if sorted(handle.keys()) != sorted(keys):
            raise OSError(errno.EIO, "the written adapter holds other keys", str(path))
    if not (work / _hf_model.ADAPTER_CONFIG).is_file():
        raise OSError(errno.EIO, "the adapter config was not written", str(work))


@contextmanager
def _staging_directory(
    call: CollectiveCall, directory: PathLike, total_size: int, *, replaces: Callable[[str], bool]
) -> Iterator[Path | None]:
    """A directory beside ``directory`` for the writing rank (``None`` on the others),
    swapped in when the block ends well (replacing the files ``replaces`` accepts)."""
    root = _export_swap.destination(directory)
    work = call.run(
        lambda: _export_swap.prepare(root, total_size) if call.is_main else None,
        step=f"preparing a directory beside {str(root)!r}",
    )
    try:
        yield work
        call.run(
            lambda: (
                _export_swap.swap_in(work, root, replaces=replaces) if work is not None else None
            ),
            step=f"replacing the export in {str(root)!r}",
        )
    except BaseException:
        if work is not None and work.exists():
            _export_swap.discard(work)
        raise


def _export_adapter(
    model: nn.Module,
    directory: PathLike,
    adapter: str | None,
    save_embedding_layers: bool | str,
    call: CollectiveCall,
) -> tuple[str, ...]:
    """The adapter export inside an entered collective call (same write path as models)."""
    plan = call.run(
        lambda: _plan_adapter(model, adapter, save_embedding_layers),
        step="deriving the adapter's keys",
    )
    with _staging_directory(
        call, directory, plan.total_size, replaces=_hf_model.ADAPTER_FILES.__contains__
    ) as work:
        tensors: dict[str, torch.Tensor] = {}
        for key, slot in plan.entries:
            value = _full(slot.tensor, keep=work is not None)
            if value is not None:
                tensors[key] = value.contiguous()

        def write() -> None:
            if work is not None:
                write_file(work / _hf_model.ADAPTER_WEIGHTS, tensors)
                (work / _hf_model.ADAPTER_CONFIG).write_bytes(plan.config)
                _verify_adapter(work, [key for key, _ in plan.entries])

        call.run(write, step=f"writing {_hf_model.ADAPTER_WEIGHTS} and reading it back")
        tensors.clear()
    logger.info("saved adapter %r (%d tensors) to %s", plan.adapter, len(plan.entries), directory)
    return (_hf_model.ADAPTER_WEIGHTS, _hf_model.ADAPTER_CONFIG)

"""What one batch costs beside the parameters, from one traced step (no process group).

[`trace_activations`][multimodal_fsdp.estimate.activations.trace_activations] runs one
forward and backward of a batch on an unsharded copy of the model in the plan's compute
dtypes, and follows the live bytes: what forward and backward create and, replayed unit by
unit as FSDP2 does it, the gathered parameters, the unsharded and sharded gradients and,
with balanced towers, the exchange's buffers.
[`multimodal_fsdp.estimate.memory`][multimodal_fsdp.estimate.memory] adds the result to
the plan's other figures.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.internals import TorchDispatchMode
from fsdp_core.plan import unit_parameters
from fsdp_core.runtime import output_tensors
from multimodal_fsdp.balance._planned import BalancedTower, BalancePlanned, JoinedModule
from multimodal_fsdp.balance._step_media import data_group_media, shares_encoding
from multimodal_fsdp.estimate._data_group_trace import trace_shares
from multimodal_fsdp.estimate.compute_copy import add_cast_hooks, compute_copy
from multimodal_fsdp.estimate.exchange import (
    CallBuffers,
    LossFn,
    StepMedia,
    balance_hook,
    call_buffers,
)
from multimodal_fsdp.estimate.timeline import kept_after_forward
from multimodal_fsdp.estimate.units import (
    padded_shard_numel,
    param_compute_dtype,
    param_reduce_dtype,
)

__all__ = ["ActivationTrace", "LossFn", "exchange_buffer_bytes", "trace_activations"]

logger = logging.getLogger(__name__)


def check_shard(shard: int) -> None:
    """A ValueError unless ``shard`` is a positive int (a shard-group size)."""
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
        raise ValueError(f"shard must be a positive int (the shard-group size), got {shard!r}")


@dataclass(frozen=True)
class ActivationTrace:
    """What one batch needs beside the parameters, from
    [`trace_activations`][multimodal_fsdp.estimate.activations.trace_activations]."""

    #: Bytes saved for backward when the forward ends (the loss included).
    saved_bytes: int
    #: Peak during backward of saved activations, temporaries (activation gradients)
    #: and gradients (a unit's unsharded ones and reduce-scatter input, sharded ones).
    backward_peak_bytes: int
    #: Peak over the whole step of all that plus the gathered parameters, replayed
    #: unit by unit as FSDP2 gathers and frees them (resting bytes not included).
    step_peak_bytes: int = 0


class _LiveBytes(TorchDispatchMode):
    """Follows the bytes of storages created under it (and those handed to ``add``)
    until they are freed, plus bytes no traced tensor holds (``bump``), and keeps
    the peak of everything and of everything but gathered parameters."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.skip = skip
        self.live = 0
        self.gathered = 0
        self.peak = 0
        self.working_peak = 0
        self.seen: dict[int, int] = {}
        #: Storages autograd saved (``mark_saved``), whether or not traced yet.
        self.saved: set[int] = set()

    def add(self, tensor: torch.Tensor) -> None:
        for held in _storage_tensors(tensor):
            storage = held.untyped_storage()
            key = storage.data_ptr()
            if key in self.skip or key in self.seen or storage.nbytes() == 0:
                continue
            self.seen[key] = storage.nbytes()
            self.bump(storage.nbytes())
            weakref.finalize(storage, self._free, key, storage.nbytes())

    def mark_saved(self, tensor: torch.Tensor) -> None:
        """Follow ``tensor`` and count it among the saved bytes."""
        self.add(tensor)
        for held in _storage_tensors(tensor):
            self.saved.add(held.untyped_storage().data_ptr())

    def saved_bytes(self) -> int:
        """Bytes of the saved storages that are still alive."""
        return sum(nbytes for key, nbytes in self.seen.items() if key in self.saved)

    def bump(self, nbytes: int, *, gathered: bool = False) -> None:
        """Bytes that no traced tensor holds (FSDP's buffers, sharded gradients and,
        with ``gathered``, unsharded parameters)."""
        self.live += nbytes
        if gathered:
            self.gathered += nbytes
        self.peak = max(self.peak, self.live)
        self.working_peak = max(self.working_peak, self.live - self.gathered)

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.pop(key, None)
        self.saved.discard(key)  # the address may be reused by a tensor nobody saves
        self.live -= nbytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, tuple | list) else (out,):
            if isinstance(item, torch.Tensor):
                self.add(item)
        return out


def trace_activations(
    plan: ShardingPlan,
    model: nn.Module,
    loss_fn: LossFn,
    *,
    shard: int = 1,
    media: StepMedia | None = None,
    data_group: int = 1,
    indexed: bool = False,
) -> ActivationTrace:
    """What one training step of one batch needs beside parameters, per rank, under ``plan``.

    Runs ``loss_fn`` and its backward once on an unsharded copy of ``model``
    (materialised on the CPU if on meta) in the plan's compute dtypes, with FSDP2's casts
    at unit boundaries. Each storage autograd saves counts once (parameters excluded),
    every other tensor while it lives; each unit's gathered parameters (with the
    all-gather output FSDP2 keeps beside them) and gradients on a shard group of ``shard``
    ranks are replayed (``_Units``). Balanced tower calls add their exchange's buffers
    ([`exchange_buffer_bytes`][multimodal_fsdp.estimate.activations.exchange_buffer_bytes]);
    calls this rank only joins run no tower in the trace.

    Args:
        plan: The plan whose compute dtypes, casts and units the step follows.
        model: The model (the meta device is enough).
        loss_fn: Runs the forward of one batch and returns the scalar loss.
        shard: The shard-group size of the gradients' reduce-scatter.
        media: The step's media for the plan's balanced towers (``media.rank``'s calls).
        data_group: TP (and CP) ranks holding this rank's batch; when they share the
            encoding, the tower runs on this rank's share, plus the gather's buffers.
        indexed: The data group has CP ranks (each keeps the items it needs).

    Returns:
        The saved bytes, the backward peak and the step's peak.

    Raises:
        TypeError: ``loss_fn`` is not callable or returns no scalar tensor.
        ValueError: ``shard`` is not a positive int.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    check_shard(shard)
    twin = compute_copy(model, plan)
    live = _LiveBytes(
        {
            held.untyped_storage().data_ptr()
            for p in twin.parameters()
            for held in _storage_tensors(p)
        }
    )
    handles = []
    for unit in plan.units:
        for path in unit.paths:
            handles += add_cast_hooks(twin.get_submodule(path), unit.mp_policy)
    handles += _Units(plan, model, twin, live, shard).hooks
    hook = balance_hook(plan)
    if media is not None and hook is not None:
        if shares_encoding(hook, data_group, indexed=indexed):
            media = data_group_media(media, data_group)
            handles += trace_shares(twin, hook.towers, live, data_group, indexed=indexed)
        handles += _ExchangeBuffers(hook, twin, live, media).hooks
        # a joined layer this rank skips and another runs: the step's placeholder runs it
        handles.append(hook.replay_layers(twin, media))
    try:
        # Forward's own transients (outputs not yet consumed, values not saved) count
        # while they live, as the tracker counts them: a peak can fall in forward.
        with (
            torch.autograd.graph.saved_tensors_hooks(_packer(live), lambda tensor: tensor),
            live,
        ):
            loss = loss_fn(twin)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn must return a scalar tensor (the loss of one batch)")
        live.mark_saved(loss)
        saved = live.saved_bytes()
        live.working_peak = live.live - live.gathered
        if loss.requires_grad:
            with live:
                torch.autograd.backward(loss)
    finally:
        for handle in handles:
            if handle is not None:
                handle.remove()
    return ActivationTrace(
        saved_bytes=saved, backward_peak_bytes=live.working_peak, step_peak_bytes=live.peak
    )


class _Units:
    """Replays on the traced copy what FSDP2 holds per unit. Gathered parameters: a unit
    is gathered at its first member's pre-forward and, if it reshards, freed after its
    last member's forward; in backward a trainable unit is gathered at its pre-backward
    with the next unit in reverse order (the implicit prefetch) and freed when its
    gradients are complete. In forward FSDP2 (torch 2.13, ``wait_for_unshard``) keeps each
    all-gather's output buffer until the next unit's all-gather arrives or the root's
    forward ends (only on more than one rank); in backward it is freed at once.

    Gradients: a unit's unsharded gradients stay until its last one is accumulated, then
    its reduce-scatter input exists beside them, then both give way to the sharded ones."""

    def __init__(
        self, plan: ShardingPlan, model: nn.Module, twin: nn.Module, live: _LiveBytes, shard: int
    ) -> None:
        self.live = live
        self.hooks: list[Any] = []
        self.size: dict[int, int] = {}
        self.kept: dict[int, int] = {}
        self.held: dict[int, int] = {}
        self.members: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.order: list[int] = []
        self.started: set[int] = set()
        self.stages = shard > 1
        self.staged = 0
        self.forward_open = False
        #: Per trainable unit: the names of gradients not yet accumulated, its parameters
        #: on the copy, and the bytes of its reduce-scatter input and sharded gradients.
        self.pending: dict[int, set[str]] = {}
        self.grads: dict[int, list[nn.Parameter]] = {}
        self.reduce_bytes: dict[int, int] = {}
        self.sharded_bytes: dict[int, int] = {}
        named = dict(twin.named_parameters())
        self.hooks.append(twin.register_forward_pre_hook(self._root_pre, prepend=True))
        self.hooks.append(twin.register_forward_hook(self._root_post))
        for index, (unit, params) in enumerate(
            zip(plan.units, unit_parameters(plan, model), strict=True)
        ):
            if not params:
                continue
            size = sum(
                padded_shard_numel(p, shard)
                * shard
                * param_compute_dtype(p, unit.mp_policy).itemsize
                for _, p in params
            )
            self.size[index] = size
            self.kept[index] = kept_after_forward(unit, size, shard)
            self.held[index] = 0
            self.members[index] = len(unit.paths)
            for path in unit.paths:
                module = twin.get_submodule(path)
                self.hooks.append(module.register_forward_pre_hook(self._pre(index)))
                self.hooks.append(module.register_forward_hook(self._post(index)))
            trainable = [(n, p) for n, p in params if p.requires_grad]
            if not trainable:
                continue
            policy = unit.mp_policy
            self.pending[index] = {n for n, _ in trainable}
            self.grads[index] = [named[n] for n, _ in trainable]
            self.reduce_bytes[index] = sum(
                padded_shard_numel(p, shard) * shard * param_reduce_dtype(p, policy).itemsize
                for _, p in trainable
            )
            self.sharded_bytes[index] = sum(
                padded_shard_numel(p, shard) * p.dtype.itemsize for _, p in trainable
            )
            for name, _ in trainable:
                hook = named[name].register_post_accumulate_grad_hook
                self.hooks.append(hook(self._accumulated(index, name)))  # type: ignore[no-untyped-call]

    def _set(self, index: int, nbytes: int) -> None:
        self.live.bump(nbytes - self.held[index], gathered=True)
        self.held[index] = nbytes

    def _root_pre(self, *_: Any) -> None:
        self.forward_open = True

    def _root_post(self, *_: Any) -> None:
        """The root's post-forward frees the last unit's all-gather buffer."""
        self.forward_open = False
        self._stage(0)

    def _stage(self, nbytes: int) -> None:
        """The all-gather output kept after its copy-out replaces the previous one."""
        self.live.bump(nbytes - self.staged, gathered=True)
        self.staged = nbytes

    def _pre(self, index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if self.done.get(index, 0) != 0:
                return
            size = self.size[index]
            if self.stages and self.forward_open and self.held[index] < size:
                # The new all-gather's output arrives beside the previous one, which
                # FSDP2 frees before copying the parameters out of the new one.
                self.live.bump(size, gathered=True)
                self.live.bump(-size, gathered=True)
                self._stage(size)
            self._set(index, size)

        return hook

    def _post(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_: nn.Module, __: Any, output: Any) -> None:
            self.done[index] = self.done.get(index, 0) + 1
            if self.done[index] < self.members[index]:
                return
            self.done[index] = 0
            self._set(index, self.kept[index])
            if index not in self.pending:
                return
            if index not in self.order:
                self.order.append(index)
            for tensor in output_tensors(output):
                tensor.register_hook(self._pre_backward(index))  # type: ignore[no-untyped-call]

        return hook

    def _pre_backward(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if index in self.started:
                return
            self.started.add(index)
            self._set(index, self.size[index])
            later = self.order[: self.order.index(index)]
            waiting = [i for i in reversed(later) if i not in self.started]
            if waiting:
                self._set(waiting[0], self.size[waiting[0]])

        return hook

    def _accumulated(self, index: int, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            waiting = self.pending[index]
            waiting.discard(name)
            if waiting:
                return
            self._set(index, 0)  # the unit reshards
            self.live.bump(self.reduce_bytes[index])  # reduce-scatter input beside the grads
            for param in self.grads[index]:
                param.grad = None
            self.live.bump(self.sharded_bytes[index] - self.reduce_bytes[index])

        return hook


def exchange_buffer_bytes(
    inputs: tuple[int, int], outputs: tuple[int, int], kept: tuple[int, int] = (0, 0)
) -> tuple[int, int, int, int]:
    """The balanced exchange's buffers in one tower call that moves items (none when
    every item stays home), in the order ``multimodal_fsdp.balance.exchange`` allocates
    them; the exchange saves nothing for backward.

    Inputs, ``S`` sent and ``R`` received: the sent items gathered and their send buffer
    (``2S``), the receive buffer, its pieces and the rebuilt fields (``3R``); the
    gathered items and fields stay (``S + R``), beside the tower's input of the kept
    (``K``) and received items while it runs. Outputs (``s``, ``r``, ``k`` kept): the
    sent ones gathered, the kept ones gathered, the send buffer, ``3r`` received; then
    the joined output (``k + r``) beside the rebuilt and kept ones.

    Args:
        inputs: Input bytes this rank sends and receives.
        outputs: Output bytes this rank sends and receives.
        kept: Input and output bytes of the items it keeps.

    Returns:
        The peak while inputs are exchanged, what stays while the tower runs, what stays
        after it, and the peak while outputs are exchanged (beyond what stays after the
        tower and the tower's output).
    """
    (sent, received), (out_sent, out_received), (kept_in, kept_out) = inputs, outputs, kept
    return (
        2 * sent + 3 * received,
        sent + 2 * received + kept_in,
        sent + received,
        max(2 * out_sent + kept_out + 3 * out_received, out_sent + 2 * kept_out + 2 * out_received),
    )


class _ExchangeBuffers:
    """Bumps the traced step's live bytes by the exchange's buffers around each local
    call of a balanced tower that moves items (``exchange_buffer_bytes``; forward
    transients are not otherwise traced, saved tensors are), and in backward by the
    output gradients' exchange (send buffer, receive buffer and its pieces; the gradient
    rebuilt from them replaces the local one)."""

    def __init__(
        self, hook: BalancePlanned, twin: nn.Module, live: _LiveBytes, media: StepMedia
    ) -> None:
        self.live = live
        self.hooks: list[Any] = []
        members: tuple[BalancedTower | JoinedModule, ...] = (*hook.towers, *hook.joined)
        for tower in hook.towers:
            buffers = call_buffers(media, tower, members)
            module = twin.get_submodule(tower.path)
            calls = [0]
            self.hooks.append(module.register_forward_pre_hook(self._pre(buffers, calls)))
            self.hooks.append(module.register_forward_hook(self._post(buffers, calls)))

    @staticmethod
    def _sizes(buffers: list[CallBuffers | None], index: int) -> CallBuffers | None:
        return buffers[index] if index < len(buffers) else None

    def _pre(self, buffers: list[CallBuffers | None], calls: list[int]) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            sizes = self._sizes(buffers, calls[0])
            if sizes is not None:
                peak, held, _after, _outputs = exchange_buffer_bytes(
                    sizes.inputs, sizes.outputs, sizes.kept
                )
                self.live.bump(peak)
                self.live.bump(held - peak)

        return hook

    def _post(
        self, buffers: list[CallBuffers | None], calls: list[int]
    ) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            sizes = self._sizes(buffers, calls[0])
            calls[0] += 1
            if sizes is None:
                return
            _inputs, held, after, peak = exchange_buffer_bytes(
                sizes.inputs, sizes.outputs, sizes.kept
            )
            self.live.bump(after - held)  # the tower's input is gone
            self.live.bump(peak)
            self.live.bump(-peak - after)
            if sizes.grads is not None:
                sent, received = sizes.grads
                tensors = [t for t in output_tensors(output) if t.requires_grad]
                if tensors:
                    on_grad = self._backward(sent + 2 * received)
                    tensors[0].register_hook(on_grad)  # type: ignore[no-untyped-call]

        return hook

    def _backward(self, transient: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.live.bump(transient)
            self.live.bump(-transient)

        return hook


def _packer(live: _LiveBytes) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        live.mark_saved(tensor)
        return tensor

    return pack


def _storage_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s memory: itself, or a wrapper subclass's
    (DTensor, ``AsyncCollectiveTensor``) inner tensors, through ``__tensor_flatten__``."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return [tensor]
    names, _ = flatten(tensor)
    inner: list[torch.Tensor] = []
    for name in names:
        value = getattr(tensor, name)
        if isinstance(value, torch.Tensor):
            inner.extend(_storage_tensors(value))
    return inner

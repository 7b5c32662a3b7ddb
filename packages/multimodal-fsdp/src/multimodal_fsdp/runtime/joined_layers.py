"""Media-dependent decoder layers joined by every rank (part of ``balance_media=True``).

Some decoders skip layers without media (Mllama's cross-attention layers); when such a
layer is an FSDP unit, a text-only rank would skip its collectives. At each such
layer's place in its ``nn.ModuleList`` the ranks agree in one small ``all_reduce``
whether any of them runs it. When only some do, a second ``all_reduce`` brings the
lowest such rank's call description, and each rank that skipped the layer runs it on a
placeholder of those shapes, its output times 0 added to the next layer's input (or the
decoder's output), so the layer's units gather and reduce on every rank.

A rank that runs the layer decides at its pre-hook; one that skipped it at the next
layer's pre-hook (or after the container's owner returns).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from fsdp_core.containers import unwrap_module
from fsdp_core.internals import in_backward
from multimodal_fsdp.balance._planned import blob_words
from multimodal_fsdp.balance.exchange import zero_loss_term
from multimodal_fsdp.balance.placeholder import describe_call, placeholder_call

__all__ = ["JoinedLayers", "add_to_first_tensor", "add_to_outputs"]

logger = logging.getLogger(__name__)


def reduce_max(tensor: Tensor, group: Any) -> None:
    """The decision's all_reduce (MAX), in place."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def reduce_sum(tensor: Tensor, group: Any) -> None:
    """The description's all_reduce (SUM: one rank's words, zeros elsewhere), in place."""
    dist.all_reduce(tensor, group=group)


def _sum_terms(terms: Iterable[Tensor]) -> Tensor | None:
    """The sum of zero loss terms (on the first one's device); ``None`` for none."""
    total: Tensor | None = None
    for term in terms:
        total = term if total is None else total + term.to(total.device)
    return total


def add_to_first_tensor(value: Any, zero_term: Tensor) -> tuple[Any, bool]:
    """``value`` with ``zero_term`` added to its first floating tensor (walking tuples and
    lists); whether one was found.

    Args:
        value: a tensor, or tuples and lists holding tensors.
        zero_term: a zero-valued scalar tied to a backward that must run.

    Returns:
        The new value and whether a floating tensor took the term.
    """
    if isinstance(value, Tensor):
        if value.is_floating_point():
            return value + zero_term.to(device=value.device, dtype=value.dtype), True
        return value, False
    if isinstance(value, (tuple, list)):
        items = list(value)
        for index, item in enumerate(items):
            items[index], done = add_to_first_tensor(item, zero_term)
            if done:
                rebuilt = type(value)(items) if type(value) in (tuple, list) else items
                return rebuilt, True
    return value, False


def add_to_outputs(output: Any, zero_term: Tensor) -> Any:
    """``output`` with ``zero_term`` added to every floating tensor in it (whichever output
    the loss reads carries it).

    Args:
        output: a module's output.
        zero_term: a zero-valued scalar tied to a backward that must run.

    Returns:
        The output, with the same structure.
    """
    if isinstance(output, Tensor):
        if output.is_floating_point():
            return output + zero_term.to(device=output.device, dtype=output.dtype)
        return output
    if isinstance(output, Mapping):
        for key in list(output.keys()):
            try:
                output[key] = add_to_outputs(output[key], zero_term)  # type: ignore[index]
            except TypeError:
                return output  # an immutable mapping: leave it
        return output
    if isinstance(output, (tuple, list)) and type(output) in (tuple, list):
        return type(output)(add_to_outputs(item, zero_term) for item in output)
    return output


def _add_to_first_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], zero_term: Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments with ``zero_term`` added to their first floating tensor, or None."""
    new_args, done = add_to_first_tensor(args, zero_term)
    if done:
        return tuple(new_args), kwargs
    for key, value in kwargs.items():
        new_value, done = add_to_first_tensor(value, zero_term)
        if done:
            return args, {**kwargs, key: new_value}
    return None


class _Container:
    """One layer container: its joined layers' indices and each item's pre-hook."""

    def __init__(self, container: nn.ModuleList) -> None:
        self.container = container
        self.items: list[nn.Module] = list(container)
        self.hooks: list[RemovableHandle] = []
        self.joined: list[int] = []
        self.last = -1  # the last index run (or passed) in this run of the owner


class JoinedLayers:
    """The installed part of ``balance_media`` for media-dependent decoder layers; it
    decides in every forward of the model, never in a backward's recomputation.

    Args:
        model: the model whose decoder holds the layers.
        paths: the media-dependent layers' qualified names.
        group: the process group of the ranks that decide together.
        active: whether the model's forward is running.
        agree: how the ranks agree on a layer's decision (the all_reduce over
            ``group`` when None; the data-group rounds pass their own).

    Raises:
        ValueError: a path is not an item of an ``nn.ModuleList``.
    """

    def __init__(
        self,
        model: nn.Module,
        paths: Sequence[str],
        group: Any,
        active: Callable[[], bool],
        agree: Callable[[int, bytes | None, torch.device], bytes | None] | None = None,
    ) -> None:
        self._group = group
        self._active = active
        #: The memory model's trace passes the step's media instead of the collective.
        self._agreement = agree if agree is not None else self._agree
        self._index: dict[int, int] = {}
        self._bypass = 0
        #: Layers joined on a placeholder and layers run, in the last forward.
        self.last_joined = 0
        self.last_decisions = 0
        handles: list[RemovableHandle] = []
        containers: dict[int, tuple[nn.Module, _Container]] = {}
        for position, path in enumerate(paths):
            self._index[id(unwrap_module(model.get_submodule(path)))] = position
            parent_path, _, name = path.rpartition(".")
            container = model.get_submodule(parent_path)
            if not isinstance(container, nn.ModuleList) or not name.isdigit():
                raise ValueError(
                    f"balance_media: the media-dependent layer {path!r} is not an item of an "
                    "nn.ModuleList; only layers a decoder runs in order can be joined"
                )
            owner = model.get_submodule(parent_path.rpartition(".")[0])
            entry = containers.setdefault(id(container), (owner, _Container(container)))
            entry[1].joined.append(int(name))
        for owner, state in containers.values():
            state.joined = sorted(set(state.joined))
            handles.append(owner.register_forward_pre_hook(self._reset(state), prepend=True))
            handles.append(owner.register_forward_hook(self._after(state), always_call=True))
            state.hooks = [
                self._hook_item(state, index, item) for index, item in enumerate(state.items)
            ]
        self._handles = handles
        self._containers = [state for _, state in containers.values()]

    def _hook_item(self, state: _Container, index: int, item: nn.Module) -> RemovableHandle:
        return item.register_forward_pre_hook(
            self._before(state, index), prepend=True, with_kwargs=True
        )

    def _rehook(self, state: _Container) -> None:
        """Move each item's pre-hook to a wrapper put around it since (the layer's own
        pre-hooks would run inside an activation checkpoint's recomputation)."""
        for index, item in enumerate(state.container):
            if index < len(state.items) and item is not state.items[index]:
                state.hooks[index].remove()
                state.items[index] = item
                state.hooks[index] = self._hook_item(state, index, item)

    # -------------------------------------------------------------------- hooks
    def _on(self) -> bool:
        return not self._bypass and self._active() and not in_backward()

    def _reset(self, state: _Container) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._rehook(state)
            if self._on():
                state.last = -1

        return hook

    def _before(self, state: _Container, index: int) -> Callable[..., Any]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            if not self._on():
                return None
            zero_term = self._skipped(state, index, args, kwargs)
            if index in state.joined:
                self._decide(state.items[index], ran=(args, kwargs))
            state.last = max(state.last, index)
            if zero_term is None:
                return None
            with_term = _add_to_first_input(args, kwargs, zero_term)
            if with_term is None:
                raise RuntimeError(
                    f"balance_media: layer {index} of a container with joined layers got no "
                    "floating tensor input to carry a joined layer's zero loss term"
                )
            return with_term

        return hook

    def _after(self, state: _Container) -> Callable[..., Any]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
            if not self._on():
                return None
            if sys.exc_info()[0] is not None:  # the forward raised: no collective after it
                return None
            zero_term = self._skipped(state, len(state.items), (), {})
            state.last = -1
            if zero_term is None:
                return None
            return add_to_outputs(output, zero_term)

        return hook

    def _skipped(
        self, state: _Container, upto: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Tensor | None:
        """Decide the joined layers this rank passed without running, up to ``upto``; the
        sum of the placeholder runs' zero loss terms."""
        passed = [i for i in state.joined if state.last < i < upto]
        terms = [self._decide(state.items[i], ran=None) for i in passed]
        return _sum_terms(t for t in terms if t is not None)

    # ----------------------------------------------------------------- decisions
    def _device(self, layer: nn.Module) -> torch.device:
        for param in layer.parameters():
            if param.device.type != "meta":
                return param.device
        if dist.get_backend(self._group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _agree(self, index: int, blob: bytes | None, device: torch.device) -> bytes | None:
        """The description of the lowest rank that ran the ``index``-th joined layer when
        others skipped it, else ``None`` (``blob``: this rank's call, None if skipped)."""
        world, rank = dist.get_world_size(self._group), dist.get_rank(self._group)
        mine = blob or b""
        # MAX of: someone ran it, someone skipped it, the longest description, and -(the
        # lowest rank that ran it): one all_reduce says all four.
        flags = torch.tensor(
            [
                int(blob is not None),
                int(blob is None),
                len(mine),
                -world if blob is None else -rank,
            ],
            dtype=torch.int64,
            device=device,
        )
        reduce_max(flags, self._group)
        someone_ran, someone_skipped, longest, source = (int(x) for x in flags.tolist())
        if not (someone_ran and someone_skipped):
            return None
        words = torch.zeros(blob_words(longest), dtype=torch.int64, device=device)
        if blob is not None and -source == rank:
            padded = blob + bytes(words.numel() * 8 - len(blob))
            words.copy_(torch.frombuffer(bytearray(padded), dtype=torch.int64))
        reduce_sum(words, self._group)  # only the source rank's words are non-zero
        return words.cpu().numpy().tobytes()

    def _decide(
        self, layer: nn.Module, *, ran: tuple[tuple[Any, ...], dict[str, Any]] | None
    ) -> Tensor | None:
        """Decide one joined layer; on a rank that skipped it while another ran it, the
        placeholder run's zero loss term."""
        device = self._device(layer)
        blob = describe_call(*ran) if ran is not None else None
        source = self._agreement(self._index[id(unwrap_module(layer))], blob, device)
        self.last_decisions += 1
        if source is None or ran is not None:
            return None
        args, kwargs = placeholder_call(source, device)
        self._bypass += 1
        try:
            output = layer(*args, **kwargs)
        finally:
            self._bypass -= 1
        self.last_joined += 1
        return zero_loss_term(output)

    def remove(self) -> None:
        """Remove every hook this installed (the layers run as without balancing)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for state in self._containers:
            for handle in state.hooks:
                handle.remove()
            state.hooks.clear()
        self._containers.clear()

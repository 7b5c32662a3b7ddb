"""Balanced calls: exchange item sizes, send items, encode a share, send back.

Every rank of ``group`` takes part in every *round*: each brings at most one call of one
of the protocol's modules (``Rounds``: the balanced towers, then the joined modules, in
a fixed order), or none. One metadata gather tells every rank who calls what; the round
runs the call of the lowest module called, and a rank that brought another module's
call joins this one and brings its own again next round. A caller runs the module after
its pre-forward hooks (FSDP's gather of a unit), so a rank without the call gathers such
a module right after the metadata.

- a **balanced** module (a tower with a layout adapter): ``route_call`` assigns its items
  to ranks (the decision the cost model counts too). When nothing moves and no rank must
  run a placeholder, each caller runs its own call. Otherwise the moved items' inputs go
  out in one ``all_to_all`` (overlapped with encoding the kept items when the tower owns
  no units), every rank encodes its share (or a placeholder), a status ``all_gather``
  turns an error on one rank into an error on all, and one ``all_to_all`` brings the
  outputs back;
- a **joined** module (a projector with FSDP units): its callers run it on their inputs,
  every other rank on a placeholder shaped like the first caller's
  (``multimodal_fsdp.balance.placeholder``) whose output counts zero, so its units'
  collectives run on every rank.

Collectives, in order:

1. ``all_gather`` of the slot (``SLOT_INTS`` int64 per rank), plus one of every rank's
   item table, padded to the longest, when one exceeds ``INLINE_INTS`` words. A round
   in which no rank calls (the last of ``join_remaining_calls``) ends here.
2. Per balanced call that exchanges: ``all_to_all_single`` (uint8) of the moved inputs,
   ``all_gather`` of the status (``STATUS_INTS`` int64), ``all_to_all_single`` of the
   outputs encoded away from their owner.
3. With a data group (``data``) and a call of at least as many items as it has ranks:
   two ``all_gather`` on the data group (``multimodal_fsdp.balance._data_group``).

Backward, when gradients are needed (a trainable tower, an input or, on some rank, an
output requiring grad): one ``all_to_all_single`` of the output gradients along the
inverse route, led by one has-gradient byte per output tensor to every rank (an output
no rank has a gradient for gets ``None`` everywhere, as in one process); then, when an
input requires grad, one of the input gradients.

[exchange_traffic][multimodal_fsdp.balance.traffic.exchange_traffic] predicts each
rank's list with its bytes. Under the fake process group every rank looks like the
calling one, so the same code runs there. Tensors travel as raw bytes: one collective
carries every field whatever its dtype, and a rank with nothing to send still takes part.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from multimodal_fsdp.balance._data_group import DataGroup, gather_outputs, select_items, splits
from multimodal_fsdp.balance._exchanged import Exchanged
from multimodal_fsdp.balance._metadata import Entry, RoundTable, exchange_round
from multimodal_fsdp.balance.assign import route_call
from multimodal_fsdp.balance.context_parallel import split_frames, take_needs
from multimodal_fsdp.balance.layouts import CallSpec, MediaCall, MediaLayout
from multimodal_fsdp.balance.placeholder import describe_call, placeholder_call
from multimodal_fsdp.balance.registry import media_layout_for

__all__ = [
    "balanced_call",
    "join_without_call",
    "join_remaining_calls",
    "Member",
    "Rounds",
    "EnteredCall",
    "zero_loss_term",
]

logger = logging.getLogger(__name__)

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class EnteredCall:
    """A call ``Rounds.enter`` brought to its round: the member, the round's table, the
    call's items (a balanced member; with a data group this rank's share of ``whole``)
    and the metadata's device."""

    index: int
    table: RoundTable
    call: MediaCall | None
    device: torch.device
    whole: MediaCall | None = None


@dataclass(frozen=True)
class Member:
    """One module of the round protocol: a balanced tower (``layout``) or a joined
    module (``layout=None``); ``identity``: what ranks check they agree on;
    ``run_when_empty``: it owns FSDP units, so a rank with nothing runs a placeholder;
    ``runner`` runs it inside a rank's own call (a hook's original forward), ``joiner``
    on a rank that joins the call."""

    module: nn.Module
    identity: str
    layout: MediaLayout | None
    run_when_empty: bool
    runner: Callable[..., Any]
    joiner: Callable[..., Any] | None = None

    def run(self, own: bool) -> Callable[..., Any]:
        """The runner of a rank that made the call (``own``) or joined it.

        Args:
            own: whether this rank made the call.

        Returns:
            ``runner`` for a caller, ``joiner`` (if any) for a rank that joined.
        """
        return self.runner if own or self.joiner is None else self.joiner


def zero_loss_term(output: Any) -> Tensor | None:
    """Every floating tensor of ``output`` summed, times 0: added to the loss, it makes a
    placeholder run's backward (its units' collectives) run.

    Args:
        output: a placeholder run's output.

    Returns:
        The zero scalar, or None when no output needs a gradient.
    """
    leaves: list[Tensor] = []
    _tensors(output, leaves)
    needed = [t for t in leaves if t.is_floating_point() and t.requires_grad]
    return _total([t.sum().float() * 0 for t in needed])


def _total(terms: Sequence[Tensor]) -> Tensor | None:
    """The terms summed on the first one's device (None without terms)."""
    total: Tensor | None = None
    for term in terms:
        total = term if total is None else total + term.to(total.device)
    return total


def _tensors(value: Any, leaves: list[Tensor], depth: int = 0) -> None:
    if depth > 8:
        return
    if isinstance(value, Tensor):
        leaves.append(value)
    elif isinstance(value, Mapping):
        for item in value.values():
            _tensors(item, leaves, depth + 1)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, leaves, depth + 1)
    elif hasattr(value, "to_tuple") and callable(value.to_tuple):  # a transformers ModelOutput
        _tensors(value.to_tuple(), leaves, depth + 1)


def _weights(call: MediaCall) -> list[int]:
    return [item.fields[0].shape[0] for item in call.items]


def _device(members: Sequence[Member], call: MediaCall | None, group: Any) -> torch.device:
    if call is not None:
        for item in call.items:
            return item.fields[0].device
    for member in members:
        for param in member.module.parameters():
            if param.device.type != "meta":
                return param.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Rounds:
    """The round protocol over ``members`` on ``group`` (see the module docstring).

    Args:
        members: the protocol's modules, in round order (every rank the same).
        group: the balance group (with ``data``: spanning the data groups).
        data: this rank's data group (``multimodal_fsdp.balance._data_group``), when
            ranks hold the same batch: each brings its share of a balanced call.
    """

    def __init__(
        self, members: Sequence[Member], group: Any, *, data: DataGroup | None = None
    ) -> None:
        self.members = tuple(members)
        self.group = group
        self.data = data

    def enter(
        self, index: int, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None
    ) -> tuple[EnteredCall, list[Tensor]]:
        """The rounds of this rank's call of member ``index`` up to the one that runs it
        (collective), joining other modules' calls on the way. A hook calls ``enter``
        before the module's pre-forward hooks (FSDP's all-gather) and ``finish`` inside
        its forward, so every rank issues the module's collectives at the same point.

        Args:
            index: the member this rank calls.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.

        Returns:
            The entered call (for ``finish``) and the zero loss terms of the rounds joined
            on the way.
        """
        member = self.members[index]
        named = dict(kwargs or {})
        error: BaseException | None = None
        trainable = any(p.requires_grad for p in member.module.parameters())
        call: MediaCall | None = None
        whole: MediaCall | None = None
        blob = b""
        try:
            if member.layout is not None:
                call = member.layout.split_call(member.module, tuple(args), named)
                call = split_frames(member.layout, call)
                if self.data is not None and splits(len(call.items), self.data.size):
                    whole, call = call, self.data.share_of(call)
            else:
                blob = describe_call(tuple(args), named)
        except (ValueError, TypeError) as raised:
            error = raised
            call = MediaCall(spec=CallSpec(fields=()), items=()) if member.layout else None
        entry = Entry(
            module=index, identity=member.identity, trainable=trainable, call=call, blob=blob
        )
        device = _device([member], call, self.group)
        zero_terms: list[Tensor] = []
        while True:
            table = exchange_round(entry, error, group=self.group, device=device)
            chosen = min(table.called())
            if chosen == index:
                return EnteredCall(index, table, call, device, whole), zero_terms
            zero_term = self._join_module(chosen, table, device)
            if zero_term is not None:
                zero_terms.append(zero_term)

    def finish(
        self, entered: EnteredCall, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None
    ) -> tuple[Any, Tensor | None]:
        """This rank's call of the member ``enter`` brought to its round.

        Args:
            entered: what ``enter`` returned.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.

        Returns:
            The output of this rank's call, and its zero loss term (or None).

        Raises:
            Exception: what a joined member's own call raised, after the other ranks were
                told (they raise in their next round).
        """
        member = self.members[entered.index]
        original: Call = (tuple(args), dict(kwargs or {}))
        if member.layout is None:  # joined: the caller's own call, as without balancing
            return self._own(member, original, entered.device)
        layout, share, needs = member.layout, entered.call, take_needs()
        assert share is not None  # a balanced entered call has its items
        own: Call | None = original  # unsplit: every rank of a data group encodes all of it
        if entered.whole is not None:  # this rank's share of a call split over its data group
            own = layout.build_call(share.spec, share.items) if share.items else None
        output, zero_term = self._balanced(
            member, entered.table, entered.index, share, own, entered.device
        )
        if self.data is not None:
            weights = _weights(entered.whole or share)
            output = gather_outputs(layout, self.data, output, weights, entered.device, needs)
            return output, zero_term
        if needs is not None:  # CP without a data group: this rank encoded every item
            output = select_items(layout, output, _weights(share), needs)
        return output, zero_term

    def call(
        self,
        index: int,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any] | None,
        *,
        zero_terms: list[Tensor] | None = None,
    ) -> Any:
        """This rank's call of member ``index``: ``enter`` then ``finish`` (collective).
        With no pre-forward hook between them, a member that is an FSDP unit is gathered
        here, where a rank joining the call gathers it.

        Args:
            index: the member this rank calls.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
            zero_terms: a list that receives the zero loss terms.

        Returns:
            The output of this rank's call.
        """
        entered, made = self.enter(index, args, kwargs)
        self._gather_unit(self.members[index])
        output, zero_term = self.finish(entered, args, kwargs)
        if zero_terms is not None:
            zero_terms.extend(made)
            if zero_term is not None:
                zero_terms.append(zero_term)
        return output

    def join_one(self) -> tuple[list[Tensor], bool]:
        """One round without a call of this rank's own.

        Returns:
            The zero loss terms of the call joined, and whether any rank called.
        """
        device = _device(self.members, None, self.group)
        table = exchange_round(None, None, group=self.group, device=device)
        if not table.called():
            return [], False
        zero_term = self._join_module(min(table.called()), table, device)
        return ([zero_term] if zero_term is not None else []), True

    def join(self) -> tuple[Tensor | None, int]:
        """Rounds without a call of this rank's own until one in which no rank calls.

        Returns:
            The summed zero loss terms (or None) and the number of rounds joined.
        """
        terms: list[Tensor] = []
        joined = 0
        while True:
            made, called = self.join_one()
            if not called:
                return _total(terms), joined
            joined += 1
            terms += made

    def _join_module(self, module: int, table: RoundTable, device: torch.device) -> Tensor | None:
        """Member ``module``'s call in this round on a rank that does not make it: its zero
        loss term (a placeholder run, or the exchange's)."""
        member = self.members[module]
        self._gather_unit(member)  # the callers' pre-forward gathered it after the metadata
        if member.layout is not None:
            return self._balanced(member, table, module, None, None, device)[1]
        if not member.run_when_empty:
            return None
        blob = table.module_table(module, balanced=False).blob
        try:
            args, kwargs = placeholder_call(blob, device)
            output = member.run(own=False)(*args, **kwargs)
        except Exception as raised:
            self._fail(raised, device)
        return zero_loss_term(output)

    @staticmethod
    def _gather_unit(member: Member) -> None:
        """All-gather a member that is an FSDP unit run on every rank."""
        if isinstance(member.module, FSDPModule) and member.run_when_empty:
            member.module.unshard()

    def _fail(self, error: BaseException, device: torch.device) -> NoReturn:
        """Tell every rank of a local failure (their next round raises), then raise."""
        exchange_round(None, error, group=self.group, device=device)
        raise error  # exchange_round re-raises it; this line keeps the type checker sure

    def _own(self, member: Member, original: Call, device: torch.device) -> tuple[Any, None]:
        """The caller's own call, as without balancing."""
        try:
            return member.run(own=True)(*original[0], **original[1]), None
        except Exception as raised:
            self._fail(raised, device)

    def _balanced(
        self,
        member: Member,
        table: RoundTable,
        module: int,
        call: MediaCall | None,
        original: Call | None,
        device: torch.device,
    ) -> tuple[Any, Tensor | None]:
        t = table.module_table(module)
        if self.data is not None and t.grad_enabled and any(t.input_grads):
            # Every rank of the round sees the same table, so every rank raises here.
            raise ValueError(
                f"balance_media: a call of {type(member.module).__name__} has inputs that "
                "require a gradient, but on a mesh with TP or CP ranks each rank of a data "
                "group encodes only its share of the call, so those ranks would get the "
                "inputs' gradient for their share alone; detach the tower's inputs, or "
                "parallelize without balance_media"
            )
        route = route_call(t.costs, run_when_empty=member.run_when_empty)
        if route is None:  # every item stays home: the caller's own call, nothing exchanged
            return (None, None) if original is None else self._own(member, original, device)
        if logger.isEnabledFor(logging.DEBUG):
            loads = [0] * t.world
            for r, costs in enumerate(t.costs):
                for i, cost in enumerate(costs):
                    loads[route.owners[r][i]] += cost
            logger.debug(
                "balanced call of %s: cost per rank %s -> %s",
                type(member.module).__name__,
                [sum(costs) for costs in t.costs],
                loads,
            )
        assert member.layout is not None  # a balanced member has a layout
        return Exchanged(member, member.layout, t, route, call, device, self.group).run()


def _single(
    tower: nn.Module,
    layout: MediaLayout | None,
    group: Any,
    run_when_empty: bool,
    runner: Callable[..., Any] | None,
) -> Rounds:
    chosen = layout if layout is not None else media_layout_for(tower)
    member = Member(
        module=tower,
        identity=chosen.name,
        layout=chosen,
        run_when_empty=run_when_empty,
        runner=runner or tower,
    )
    return Rounds((member,), group)


def balanced_call(
    tower: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    layout: MediaLayout | None = None,
    group: Any = None,
    run_when_empty: bool = False,
    runner: Callable[..., Any] | None = None,
    zero_terms: list[Tensor] | None = None,
) -> Any:
    """``tower(*args, **kwargs)``, with the items of every rank's call spread evenly over
    the ranks of ``group`` (collective: every rank calls this or ``join_without_call``).
    Gradients flow back to the encoding ranks and, where inputs require grad, to the
    inputs.

    Args:
        tower: the tower (or encoder) called.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
        layout: the tower's layout (chosen for it when None).
        group: the ranks that balance (the default group when None).
        run_when_empty: run the tower on a placeholder whose output counts 0 when this
            rank gets no item (towers that own FSDP units).
        runner: runs the tower on this rank's share (``tower`` when None; a hook that
            replaces the tower's forward passes the original).
        zero_terms: a list that receives the call's zero loss term when gradients flow
            back: add it to the loss so this rank runs the exchange's backward even when
            its loss reads none of the outputs.

    Returns:
        The tower's output for this rank's items, built from pieces encoded anywhere
        (``None`` for a call without items while other ranks have some).
    """
    rounds = _single(tower, layout, group, run_when_empty, runner)
    return rounds.call(0, tuple(args), kwargs, zero_terms=zero_terms)


def join_without_call(
    tower: nn.Module,
    *,
    layout: MediaLayout | None = None,
    group: Any = None,
    run_when_empty: bool = False,
    runner: Callable[..., Any] | None = None,
) -> Tensor:
    """Take part in a balanced call of ``tower`` on a rank whose forward has no call of
    it (a text-only batch): this rank may still encode others' items.

    Args:
        tower: the tower other ranks call.
        layout: the tower's layout (chosen for it when None).
        group: the ranks that balance (the default group when None).
        run_when_empty: run the tower on a placeholder when this rank gets no item.
        runner: runs the tower on this rank's share (``tower`` when None).

    Returns:
        A zero scalar to add to the loss (this rank then joins the backward collectives).
    """
    made, _ = _single(tower, layout, group, run_when_empty, runner).join_one()
    return sum((term.to("cpu") for term in made), torch.zeros(()))


def join_remaining_calls(
    tower: nn.Module,
    *,
    layout: MediaLayout | None = None,
    group: Any = None,
    run_when_empty: bool = False,
    runner: Callable[..., Any] | None = None,
) -> tuple[Tensor, int]:
    """Join, as a rank without a call, every balanced call of ``tower`` that other ranks
    still make, until a round in which no rank calls (collective: every rank calls this
    once it has made all of its own calls of this forward, e.g. just before the decoder),
    so ranks need not know each other's number of calls. The last round costs one
    ``all_gather`` of the slot.

    Args:
        tower: the tower other ranks call.
        layout: the tower's layout (chosen for it when None).
        group: the ranks that balance (the default group when None).
        run_when_empty: run the tower on a placeholder when this rank gets no item.
        runner: runs the tower on this rank's share (``tower`` when None).

    Returns:
        The summed zero loss terms (add them to a tensor the loss depends on, before the
        decoder, so the backward collectives keep their order) and the calls joined.
    """
    total, joined = _single(tower, layout, group, run_when_empty, runner).join()
    return (total if total is not None else torch.zeros(())), joined

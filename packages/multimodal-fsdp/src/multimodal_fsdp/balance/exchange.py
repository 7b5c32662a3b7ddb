"""Balanced calls: exchange item sizes, send items, encode a share, send back.

Every rank of ``group`` takes part in every *round*: in a round each rank brings at
most one call of one of the protocol's modules (``Rounds``: the balanced towers, then
the joined modules, in a fixed order), or none (a rank joining the others' calls). One
metadata gather tells every rank who calls what; the round then runs the call of the
lowest module called (a rank that brought another module's call runs that one as a
rank without it, and brings its own again in the next round). A rank's own call of the
module runs after the module's pre-forward hooks (FSDP gathers a module that is a unit
there), so a rank without the call gathers such a module right after the metadata. The
module's call runs as follows:

- a **balanced** module (a tower with a layout adapter): ``route_call`` assigns its
  items to ranks (the one decision the cost model counts too). When every item stays on
  its rank and no rank that would encode nothing must run the module (a tower without
  FSDP units, or every rank has an item), each caller simply runs its own call: nothing
  more is exchanged. Otherwise the items that change rank are exchanged (one
  ``all_to_all`` of their inputs, which a rank overlaps with encoding the items it
  keeps when the tower owns no units), every rank encodes its share (or a placeholder,
  for a tower with units), a status ``all_gather`` makes an error on one rank an error
  on every rank, and one ``all_to_all`` sends the outputs of moved items back;
- a **joined** module (a projector with FSDP units of its own): its callers run it on
  their own inputs; every other rank runs it on a placeholder shaped like the first
  caller's inputs (``multimodal_fsdp.balance.placeholder``), whose output counts zero,
  so the module's units issue their collectives on every rank.

Collectives, in order (``W`` ranks):

1. ``all_gather`` of the slot: ``SLOT_INTS`` int64 per rank (``W * SLOT_INTS * 8``
   bytes received); when some rank's item table and blob exceed ``INLINE_INTS`` words,
   one more ``all_gather`` of every rank's table, padded to the longest. A round in
   which no rank calls (the last round of ``join_remaining_calls``) ends here.
2. Per balanced module with moved items (or a rank that must run a placeholder):
   ``all_to_all_single`` (uint8) of the inputs of the items that change rank (a rank
   sends nothing to itself), ``all_gather`` of the status (``STATUS_INTS`` int64), and
   ``all_to_all_single`` of the outputs of the items encoded away from their owner.
3. With a data group (``data``) and a call of at least as many items as it has ranks,
   after the call: two ``all_gather`` on the data group, a fixed header and the shares'
   outputs (``multimodal_fsdp.balance._data_group``).

Backward, for a balanced module that exchanged and when gradients are needed (grad
mode on and the tower trainable, some rank's floating input requiring grad, or some
rank's tower outputs requiring grad, which the status gather tells every rank): one
``all_to_all_single`` with the output gradients along the inverse route of the
outputs, led by ``L`` flag bytes to every rank, itself included (``L`` output tensors:
whether this rank has a gradient for each, for the items it kept or got back; an output
no rank has one for gets ``None`` on every rank, so parameters that feed only unread
outputs keep no gradient, as in one process); then, when some rank's floating input
requires grad, one with the input gradients along the inverse route of the inputs.

[exchange_traffic][multimodal_fsdp.balance.traffic.exchange_traffic] computes each
rank's list with its bytes. Under the fake process group every rank looks like the
calling one (the gathers start from its own values), so the same code runs there.

All tensors are sent as raw bytes, so one collective carries every field or output
tensor whatever their dtypes, and a rank that sends and receives nothing still takes
part with empty buffers.
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
from multimodal_fsdp.balance.layouts import (
    CallSpec,
    MediaCall,
    MediaLayout,
)
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
    call split into items (a balanced member) and the device of the metadata; with a
    data group, ``call`` is this rank's share and ``whole`` the call it is a share of."""

    index: int
    table: RoundTable
    call: MediaCall | None
    device: torch.device
    whole: MediaCall | None = None


@dataclass(frozen=True)
class Member:
    """One module of the round protocol: a balanced tower (``layout``) or a joined
    module (``layout=None``); ``identity`` is what ranks check they agree on (its path
    and kind); ``run_when_empty``: it owns FSDP units, so a rank with nothing of its own
    runs it on a placeholder; ``runner`` runs it on a rank inside its own call (the
    original forward, for a hook), ``joiner`` on a rank that joins the call (through
    the module's ``__call__``)."""

    module: nn.Module
    identity: str
    layout: MediaLayout | None
    run_when_empty: bool
    runner: Callable[..., Any]
    #: Runs it on a rank without a call of its own in the round (default ``runner``).
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
    """Every floating tensor of ``output`` summed, times 0: a scalar to add to the loss
    so that a placeholder run's backward (its units' collectives) runs; ``None`` when no
    output needs a gradient.

    Args:
        output: a placeholder run's output.

    Returns:
        The zero scalar, or None.
    """
    leaves: list[Tensor] = []
    _tensors(output, leaves)
    parts = [t.sum().float() * 0 for t in leaves if t.is_floating_point() and t.requires_grad]
    if not parts:
        return None
    total = parts[0]
    for part in parts[1:]:
        total = total + part.to(total.device)
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
    """Each item's weight (its main field's rows), as the output specs read them."""
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
    ``data``: the ranks holding this rank's batch (``multimodal_fsdp.balance._data_group``),
    ``group`` then spans their data groups; each brings its share of a balanced call.

    Args:
        members: the protocol's modules, in round order (every rank the same).
        group: the balance group.
        data: this rank's data group, when ranks hold the same batch.
    """

    def __init__(
        self, members: Sequence[Member], group: Any, *, data: DataGroup | None = None
    ) -> None:
        self.members = tuple(members)
        self.group = group
        self.data = data

    # ------------------------------------------------------------------ entry points
    def enter(
        self, index: int, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None
    ) -> tuple[EnteredCall, list[Tensor]]:
        """The rounds of this rank's call of member ``index`` up to the one that runs it
        (collective): a round whose lowest called module is another runs that module's
        call here, as a rank without it (its zero loss terms are returned), and this rank brings
        its call again in the next round. Then ``finish`` runs the call: a hook calls
        ``enter`` before the module's own pre-forward hooks (FSDP's all-gather of a module
        that is a unit) and ``finish`` inside its forward, so every rank issues the
        module's collectives at the same point of the round.

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
                entered = EnteredCall(
                    index=index, table=table, call=call, device=device, whole=whole
                )
                return entered, zero_terms
            zero_term = self._join_module(chosen, table, device)
            if zero_term is not None:
                zero_terms.append(zero_term)

    def finish(
        self, entered: EnteredCall, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None
    ) -> tuple[Any, Tensor | None]:
        """This rank's call of the member ``enter`` brought to its round: the output and,
        for a balanced call that exchanged with gradients flowing back, its zero_term.

        Args:
            entered: what ``enter`` returned.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.

        Returns:
            The output of this rank's call, and its zero loss term (or None).

        Raises:
            Exception: what a joined member's own call raised, after the other ranks were
                told (they raise in their next round).
            RuntimeError: a balanced entered call without its layout or share (a bug).
        """
        member = self.members[entered.index]
        original: Call = (tuple(args), dict(kwargs or {}))
        if member.layout is None:  # joined: the caller's own call, as without balancing
            try:
                return member.run(own=True)(*original[0], **original[1]), None
            except Exception as raised:
                self._fail(raised, entered.device)
        layout, share, needs = member.layout, entered.call, take_needs()
        if layout is None or share is None:  # pragma: no cover - a balanced call has both
            raise RuntimeError("balanced call of a joined module")
        data = self.data
        if data is None:
            output, zero_term = self._balanced(
                member, entered.table, entered.index, share, original, entered.device
            )
            if needs is not None:  # CP without a data group: this rank encoded every item
                output = select_items(layout, output, _weights(share), needs)
            return output, zero_term
        own: Call | None = original  # an unsplit call: every rank of the group encodes all of it
        if entered.whole is not None:
            own = layout.build_call(share.spec, share.items) if share.items else None
        output, zero_term = self._balanced(
            member, entered.table, entered.index, share, own, entered.device
        )
        weights = _weights(entered.whole or share)
        return gather_outputs(layout, data, output, weights, entered.device, needs), zero_term

    def call(
        self,
        index: int,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any] | None,
        *,
        zero_terms: list[Tensor] | None = None,
    ) -> Any:
        """This rank's call of member ``index``: ``enter`` then ``finish`` (collective);
        the zero loss terms of the rounds' exchanges and placeholder runs go to ``zero_terms``.

        A direct caller has no pre-forward hook between ``enter`` and ``finish``, so a
        member that is an FSDP unit is gathered here, at the point where a rank joining
        the call gathers it (``_join_module``); its own pre-forward then gathers nothing.

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
        """One round without a call of this rank's own: the zero loss terms of what it joined
        and whether any rank called.

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
        """Rounds without a call of this rank's own until one in which no rank calls:
        the sum of their zero loss terms (``None`` if none) and the number of rounds joined.

        Returns:
            The summed zero loss terms (or None) and the number of rounds joined.
        """
        total: Tensor | None = None
        joined = 0
        while True:
            made, called = self.join_one()
            if not called:
                return total, joined
            joined += 1
            for zero_term in made:
                total = zero_term if total is None else total + zero_term.to(total.device)

    # ------------------------------------------------------------------ one round
    def _join_module(self, module: int, table: RoundTable, device: torch.device) -> Tensor | None:
        """Member ``module``'s call in this round, on a rank that does not make it. A
        member that is an FSDP unit itself is gathered first: its callers' pre-forward
        hooks gathered it right after the round's metadata."""
        member = self.members[module]
        self._gather_unit(member)
        if member.layout is None:
            _, zero_term = self._joined(member, table, module, None, device)
        else:
            _, zero_term = self._balanced(member, table, module, None, None, device)
        return zero_term

    @staticmethod
    def _gather_unit(member: Member) -> None:
        """All-gather a member that is an FSDP unit run on every rank, at the point of the
        round where each rank's module collectives start (the callers' pre-forward)."""
        if isinstance(member.module, FSDPModule) and member.run_when_empty:
            member.module.unshard()

    def _fail(self, error: BaseException, device: torch.device) -> NoReturn:
        """A local run failed: tell every rank in one more round (their next round
        raises), then raise here."""
        exchange_round(None, error, group=self.group, device=device)
        raise error  # exchange_round re-raises it; this line keeps the type checker sure

    # ------------------------------------------------------------------ joined
    def _joined(
        self,
        member: Member,
        table: RoundTable,
        module: int,
        original: Call | None,
        device: torch.device,
    ) -> tuple[Any, Tensor | None]:
        if original is not None:  # a caller: its own call, as without balancing
            try:
                return member.run(own=True)(*original[0], **original[1]), None
            except Exception as raised:
                self._fail(raised, device)
        if not member.run_when_empty:
            return None, None
        t = table.module_table(module, balanced=False)
        try:
            args, kwargs = placeholder_call(t.blob, device)
            output = member.run(own=False)(*args, **kwargs)
        except Exception as raised:
            self._fail(raised, device)
        return None, zero_loss_term(output)

    # ------------------------------------------------------------------ balanced
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
            if original is None:
                return None, None
            try:
                return member.run(own=True)(*original[0], **original[1]), None
            except Exception as raised:
                self._fail(raised, device)
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
        layout = member.layout
        if layout is None:  # pragma: no cover - members with a layout only
            raise RuntimeError("balanced call of a joined module")
        return Exchanged(member, layout, t, route, call, device, self.group).run()


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

    Returns what the tower would have returned for this rank's items, built from pieces
    encoded anywhere (``None`` for a call with no items while other ranks have some:
    use ``join_without_call`` there); gradients flow back to the encoding ranks and,
    where inputs require grad, to the inputs. ``runner`` runs the tower on the local share (default
    ``tower`` itself; a hook that replaces the tower's forward passes the original).
    ``run_when_empty``: run the tower on a placeholder whose output counts 0 when this
    rank gets nothing to encode (for towers that own FSDP units). ``zero_terms``: a list
    that gets the call's zero loss term when gradients flow back; add it to the loss (as
    ``join_without_call``'s) so this rank runs the exchange's backward collectives even
    when its loss reads none of the outputs, as the ranks that joined do.

    Args:
        tower: the tower (or encoder) called.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
        layout: the tower's layout (chosen for it when None).
        group: the ranks that balance (the default group when None).
        run_when_empty: run the tower on a placeholder when this rank gets no item.
        runner: runs the tower on this rank's share (``tower`` when None).
        zero_terms: a list that receives the call's zero loss term.

    Returns:
        The tower's output for this rank's call.
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
    it (a text-only batch): this rank may still encode others' items. Returns a zero
    scalar; add it to the loss so this rank joins the exchange's backward collectives.

    Args:
        tower: the tower other ranks call.
        layout: the tower's layout (chosen for it when None).
        group: the ranks that balance (the default group when None).
        run_when_empty: run the tower on a placeholder when this rank gets no item.
        runner: runs the tower on this rank's share (``tower`` when None).

    Returns:
        A zero scalar to add to the loss.
    """
    rounds = _single(tower, layout, group, run_when_empty, runner)
    made, _ = rounds.join_one()
    total = torch.zeros(())
    for zero_term in made:
        total = total + zero_term.to(total.device)
    return total


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
    once it has made all of its own calls of this forward, e.g. just before the decoder).

    Ranks need not know each other's number of calls (text-only batches, an image call
    here and an image and a video call there, one call per image). Returns the sum of the
    zero loss terms (add it to a tensor the loss depends on, before the decoder, so the
    backward collectives keep their order) and the number of calls joined. The last
    round costs one ``all_gather`` of the slot.

    Args:
        tower: the tower other ranks call.
        layout: the tower's layout (chosen for it when None).
        group: the ranks that balance (the default group when None).
        run_when_empty: run the tower on a placeholder when this rank gets no item.
        runner: runs the tower on this rank's share (``tower`` when None).

    Returns:
        The summed zero loss terms and the number of calls joined.
    """
    rounds = _single(tower, layout, group, run_when_empty, runner)
    total, joined = rounds.join()
    return (total if total is not None else torch.zeros(())), joined

"""The installed ``balance_media`` hook: the members' forwards, the join site, ``generate``.

It runs the exchange's rounds during the steps; its public name and the rules of when a
call is balanced live in
[`multimodal_fsdp.runtime.balance_media`][multimodal_fsdp.runtime.balance_media].
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from fsdp_core.containers import unwrap_module
from fsdp_core.internals import in_backward
from multimodal_fsdp.balance import MediaLayout, media_layout_for
from multimodal_fsdp.balance._data_group import DataGroup
from multimodal_fsdp.balance._planned import BALANCE_MEDIA, BalancedTower, JoinedModule
from multimodal_fsdp.balance.context_parallel import own_items
from multimodal_fsdp.balance.exchange import EnteredCall, Member, Rounds
from multimodal_fsdp.runtime.joined_layers import (
    JoinedLayers,
    _add_to_first_input,
    _sum_terms,
    add_to_outputs,
)

__all__ = ["BalanceMedia"]

#: The hook's messages keep the logger of the module that publishes it.
logger = logging.getLogger("multimodal_fsdp.runtime.balance_media")


def _outermost(model: nn.Module, path: str) -> str:
    """The path of the outermost wrapper (``checkpoint_wrapper``, ``torch.compile``) of the
    module at ``path``: a hook inside an activation checkpoint would break recomputation."""
    inner = unwrap_module(model.get_submodule(path))
    while path:
        parent = path.rpartition(".")[0]
        if unwrap_module(model.get_submodule(parent)) is not inner:
            break
        path = parent
    return path


#: A balanced or joined module, the outermost wrapper its hook goes on, its path, layout
#: and ``run_when_empty``.
_Found = tuple[nn.Module, nn.Module, str, MediaLayout | None, bool]


def _balanced_modules(
    model: nn.Module, towers: Sequence[BalancedTower], joined: Sequence[JoinedModule]
) -> list[_Found]:
    """Each balanced or joined module with its hook's module, path, layout and
    ``run_when_empty``, all checked before any is changed."""
    found: list[_Found] = []
    for tower in towers:
        module = model.get_submodule(tower.path)
        layout = media_layout_for(module, name=tower.layout)
        site = model.get_submodule(_outermost(model, tower.path))
        found.append((module, site, tower.path, layout, tower.run_when_empty))
    for item in joined:
        site = model.get_submodule(_outermost(model, item.path))
        found.append((model.get_submodule(item.path), site, item.path, None, True))
    for _, module, path, _, _ in found:
        if "forward" in vars(module):
            raise ValueError(
                f"balance_media: module {path!r} already has an instance forward "
                "(another hook or a patch); it cannot be balanced"
            )
    return found


class BalanceMedia:
    """The installed hook: the members' forwards, the join site's pre-hook and the joined
    decoder layers. ``remove`` restores the modules' own forwards.

    Args:
        model: the sharded model.
        towers: the balanced towers (plan data).
        join_site: the path of the module whose pre-hook joins the remaining calls.
        group: the balance group.
        joined: the joined modules (projectors with units).
        layers: the media-dependent decoder layers with units.
        layer_group: the group the joined layers decide over (``group`` if None).
        data: this rank's data group, when ranks hold the same batch.
    """

    name: str = BALANCE_MEDIA

    def __init__(
        self,
        model: nn.Module,
        towers: tuple[BalancedTower, ...],
        join_site: str,
        group: Any,
        *,
        joined: tuple[JoinedModule, ...] = (),
        layers: tuple[str, ...] = (),
        layer_group: Any = None,
        data: DataGroup | None = None,
    ) -> None:
        self.towers = towers
        self.joined = joined
        self.join_site = join_site

        self._modules: list[tuple[nn.Module, Member]] = []
        self._in_forward = 0
        self._training = False
        self._joined = True
        self._bypass = 0
        self._warned: set[str] = set()
        #: Calls balanced and rounds joined in the last forward (for tests and benchmarks).
        self.last_calls = 0
        self.last_joined = 0
        #: This forward's zero loss terms, added at the join site so that every rank runs
        #: every exchange's backward.
        self._zero_terms: list[Tensor] = []
        found = _balanced_modules(model, towers, joined)
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._start, prepend=True),
            model.register_forward_hook(self._end, always_call=True),
        ]
        #: The module whose forward pre-hook joins, and that hook (see ``_place_join``).
        self._site: nn.Module | None = None
        self._site_handle: RemovableHandle | None = None
        self._place_join(model)
        #: Per member, the calls its pre-hook brought to their round.
        self._entered: list[list[EnteredCall]] = [[] for _ in found]
        members = [self._install_member(index, *entry) for index, entry in enumerate(found)]
        self._rounds = Rounds(members, group, data=data)
        decide_over = group if layer_group is None else layer_group
        self._layers: JoinedLayers | None = None
        if layers:
            self._layers = JoinedLayers(model, layers, decide_over, lambda: bool(self._in_forward))
        #: (module, the instance ``generate`` it replaced, the wrapper) per wrapped module.
        self._generators: list[tuple[nn.Module, Any, Callable[..., Any]]] = []
        if any(member.run_when_empty for member in members) or layers:
            # Each generate() is one balanced scope: its tower calls before the first
            # forward would otherwise gather on some ranks only.
            for module in model.modules():
                if callable(getattr(type(module), "generate", None)):
                    self._wrap_generate(module)

    def _install_member(
        self,
        index: int,
        module: nn.Module,
        site: nn.Module,
        path: str,
        layout: MediaLayout | None,
        empty: bool,
    ) -> Member:
        """Send one module's calls through the rounds: on its outermost wrapper ``site``,
        a prepended pre-hook enters the round (before FSDP's all-gather), its instance
        forward finishes the call."""
        original = site.forward
        kind = layout.name if layout is not None else "joined"
        member = Member(
            module=module,
            identity=f"{path}|{kind}",
            layout=layout,
            run_when_empty=empty,
            runner=original,
            joiner=self._runner(site),
        )
        self._modules.append((site, member))
        self._handles.append(
            site.register_forward_pre_hook(
                self._enter(index, member), prepend=True, with_kwargs=True
            )
        )
        site.forward = self._balanced_forward(index, member, path, original)
        return member

    # ------------------------------------------------------------- decisions
    def _active(self, member: Member) -> bool:
        return member.run_when_empty or self._training

    def _balances(self, member: Member) -> bool:
        idle = not self._in_forward or self._joined or self._bypass or in_backward()
        return not idle and self._active(member)

    def _place_join(self, model: nn.Module) -> None:
        """Put the join on the outermost wrapper of the join site (also one applied after
        install): inside an activation checkpoint the join would break recomputation."""
        if not self.join_site:
            return
        outermost = model.get_submodule(_outermost(model, self.join_site))
        if outermost is self._site:
            return
        if self._site_handle is not None:
            self._site_handle.remove()
        self._site = outermost
        self._site_handle = outermost.register_forward_pre_hook(
            self._join_hook, prepend=True, with_kwargs=True
        )

    def _start(self, module: nn.Module, _args: Any) -> None:
        self._in_forward += 1
        if self._in_forward == 1:
            self._place_join(module)
            self._training = module.training and torch.is_grad_enabled()
            self._joined = in_backward()
            self.last_calls = 0
            self.last_joined = 0
            self._zero_terms.clear()
            if self._layers is not None:
                self._layers.last_joined = 0
                self._layers.last_decisions = 0

    def _end(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        self._in_forward = max(0, self._in_forward - 1)
        if sys.exc_info()[0] is not None:  # the forward raised: no collective after it
            self._joined = True
            return None
        if self._in_forward or self._joined:
            return None
        zero_term = self._join_all()
        if zero_term is None:
            return None
        return add_to_outputs(output, zero_term)

    # --------------------------------------------------------------- calling
    def _enter(self, index: int, member: Member) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self._balances(member):
                return
            entered, zero_terms = self._rounds.enter(index, args, kwargs)
            self._zero_terms.extend(zero_terms)
            self._entered[index].append(entered)

        return hook

    def _balanced_forward(
        self, index: int, member: Member, path: str, original: Callable[..., Any]
    ) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            entered_calls = self._entered[index]
            if self._bypass or not entered_calls:
                if self._in_forward and self._joined and member.run_when_empty:
                    self._warn_late(path)
                output = original(*args, **kwargs)
                if self._bypass or not self._in_forward or in_backward() or member.layout is None:
                    return output
                return own_items(member.layout, member.module, args, kwargs, output)  # CP
            self.last_calls += 1
            output, zero_term = self._rounds.finish(entered_calls.pop(), args, kwargs)
            if zero_term is not None:
                self._zero_terms.append(zero_term)
            return output

        return forward

    def _warn_late(self, path: str) -> None:
        """Warn once: a module with units called after the join site runs locally."""
        if self._bypass or in_backward() or path in self._warned:
            return
        self._warned.add(path)
        logger.warning(
            "balance_media: module %r was called after %s; it runs locally there, so every "
            "rank must make the same calls of it",
            path,
            repr(self.join_site) if self.join_site else "the end of the forward",
        )

    def _runner(self, module: nn.Module) -> Callable[..., Any]:
        """How a rank joins a call it does not make: ``module(...)``, not balanced again."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self._bypass += 1
            try:
                return module(*args, **kwargs)
            finally:
                self._bypass -= 1

        return run

    def _wrap_generate(self, module: nn.Module) -> None:
        """Make ``module.generate(...)`` one balanced scope, up to its first forward's join
        site or its return; nested calls run as they are."""
        previous = vars(module).get("generate")
        original: Callable[..., Any] = module.generate  # type: ignore[assignment]

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            if self._in_forward or in_backward():
                return original(*args, **kwargs)
            self._in_forward = 1
            self._training = False
            self._joined = False
            self.last_calls = 0
            self.last_joined = 0
            try:
                output = original(*args, **kwargs)
            except BaseException:
                self._joined = True  # the call raised: no collective after it
                raise
            finally:
                self._in_forward = 0
            if not self._joined:
                self._join_all()
            return output

        object.__setattr__(module, "generate", generate)
        self._generators.append((module, previous, generate))

    # --------------------------------------------------------------- joining
    def _join_all(self) -> Tensor | None:
        """Join every round other ranks still run; the summed zero loss term of the calls
        made and joined (``None`` when there were none)."""
        self._joined = True
        for entered_calls in self._entered:
            entered_calls.clear()  # a call whose forward raised after its round
        terms, self._zero_terms = self._zero_terms, []
        if in_backward():
            return None
        if any(self._active(member) for _, member in self._modules):
            joined_term, joined = self._rounds.join()
            self.last_joined += joined
            if joined_term is not None:
                terms.append(joined_term)
        return _sum_terms(terms)

    def _join_hook(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._in_forward or self._joined:
            return None
        zero_term = self._join_all()
        if zero_term is None:
            return None
        with_term = _add_to_first_input(args, kwargs, zero_term)
        if with_term is not None:
            return with_term
        raise RuntimeError(
            f"balance_media: the join site {self.join_site!r} got no floating tensor input to "
            "carry the exchange's zero loss term; plan the hook with another join site"
        )

    @property
    def layers_joined(self) -> int:
        """Media-dependent layers this rank ran on a placeholder in the last forward."""
        return 0 if self._layers is None else self._layers.last_joined

    def remove(self) -> None:
        """Take every hook off and give the modules their own forwards back."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._site_handle is not None:
            self._site_handle.remove()
            self._site_handle = None
            self._site = None
        if self._layers is not None:
            self._layers.remove()
        for module, _ in self._modules:
            vars(module).pop("forward", None)
        self._modules.clear()
        for module, previous, wrapper in self._generators:
            if vars(module).get("generate") is wrapper:  # not replaced or removed since
                if previous is None:
                    del vars(module)["generate"]
                else:
                    object.__setattr__(module, "generate", previous)
        self._generators.clear()

"""The plan-time probe: does a layout fit a tower, and what does it cut?

A layout that does not fit its tower must be found when the plan is made, not at the
first step. ``probe_layout`` runs the tower on the layout's two tiny probe calls (one
item, then two with the same first) on the meta device, or on its real, unsharded
weights when they are small (``REAL_PROBE_PARAMETERS``) or it cannot run on meta (eval
mode, no gradients, random state kept), and checks what balancing relies on: the
layout splits the calls into 1 and 2 items and each output into a whole number of rows
per item; an item's piece has the same shape (and, on real weights, values) beside
another item (batch norms using batch statistics are refused outright); the pieces join
back into the call's structure and shapes. The report (``ProbeReport.summary``) is the
plan's description of the tower; results are kept per tower and layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import Tensor, nn
from torch.func import functional_call

from multimodal_fsdp.balance._tree import take_tensors_out
from multimodal_fsdp.balance.layouts import MediaLayout, ProbeCall

__all__ = ["ProbeReport", "probe_layout"]

logger = logging.getLogger(__name__)

#: Towers up to this many parameters are probed on their real weights (values too:
#: items encoded apart give the same output); bigger ones on the meta device (shapes
#: only) unless they cannot run there.
REAL_PROBE_PARAMETERS: Final = 50_000_000

FITS: Final = "fits"
MISFIT: Final = "misfit"
UNPROBED: Final = "unprobed"


@dataclass(frozen=True)
class ProbeReport:
    """What the probe found for one layout and tower: ``status`` (``"fits"``,
    ``"misfit"``: the layout does not fit, ``reason`` says why, or ``"unprobed"``: the
    probe could not run, ``reason`` says why), where it ran (``"meta"`` or the weights'
    device type), the per-item inputs (name, rows of the probe's first item), each
    output tensor's rows per item, and ``error``: the error of the first (likeliest)
    probe call of a tower that ran on none of them (a refusal shows it; the plan's note
    of a trusted layout does not, its calls being checked at the first step)."""

    layout: str
    status: str
    ran_on: str = ""
    inputs: tuple[tuple[str, int], ...] = ()
    outputs: tuple[str, ...] = ()
    reason: str = ""
    error: str = ""

    @property
    def fits(self) -> bool:
        return self.status == FITS

    def summary(self) -> str:
        """One line for the plan.

        Returns:
            The line.
        """
        if self.status != FITS:
            detail = f": {self.error}" if self.error else ""
            return f"{self.layout}: {self.status} ({self.reason}{detail})"
        inputs = ", ".join(
            f"{name} {rows} row{'' if rows == 1 else 's'}" for name, rows in self.inputs
        )
        outputs = "; ".join(f"[{i}] {how}" for i, how in enumerate(self.outputs))
        where = "on the meta device" if self.ran_on == "meta" else f"on {self.ran_on} weights"
        return (
            f"{self.layout}, probed {where}: per item {inputs}; output tensors per item: {outputs}"
        )


class _MisfitError(Exception):
    """The layout does not fit the tower (the message says why)."""


# ------------------------------------------------------------------------ running
def _sharded(tower: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in tower.modules()) or any(
        isinstance(p, DTensor) for p in tower.parameters()
    )


def _map(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with ``fn`` applied to the tensors of its tuples, lists and mappings."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _numpy_random() -> Any:
    """numpy's global random module, when numpy is installed (transformers models draw
    from it: Phi-4's audio encoder in training)."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - torch installs numpy in practice
        return None
    return numpy.random


@contextlib.contextmanager
def _quietly(tower: nn.Module) -> Iterator[None]:
    """Eval mode and no gradients for a probe run, every module's mode and the random
    states (torch's, numpy's) restored after it."""
    modes = [(m, m.training) for m in tower.modules()]
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    devices = [p.device for p in tower.parameters() if p.device.type == "cuda"]
    try:
        with torch.random.fork_rng(devices=devices[:1]), torch.no_grad():
            tower.train(False)
            yield
    finally:
        for module, training in modes:
            module.training = training
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)


def _run_meta(tower: nn.Module, call: ProbeCall, *, integers: bool) -> Any:
    state = {
        name: torch.empty_like(t, device="meta")
        for name, t in (*tower.named_parameters(), *tower.named_buffers())
    }

    def meta(t: Tensor) -> Tensor:
        return t.to("meta") if t.is_floating_point() or integers else t

    with _quietly(tower):
        kwargs = _map(dict(call.kwargs), meta)
        return functional_call(tower, state, _map(call.args, meta), kwargs, strict=False)


def _run_real(tower: nn.Module, call: ProbeCall) -> Any:
    device = next((p.device for p in tower.parameters()), torch.device("cpu"))

    def to(t: Tensor) -> Tensor:
        return t.to(device)

    with _quietly(tower):
        return tower(*_map(call.args, to), **_map(dict(call.kwargs), to))


def _outputs(
    tower: nn.Module, pair: tuple[ProbeCall, ProbeCall], real: bool
) -> tuple[str, tuple[Any, Any]]:
    """The outputs of the pair's two calls and where they ran: on real weights when the
    tower has them and is small (``REAL_PROBE_PARAMETERS``) or cannot run on the meta
    device, else on the meta device; raises the last error when it ran nowhere."""
    error: BaseException | None = None
    small = sum(p.numel() for p in tower.parameters()) <= REAL_PROBE_PARAMETERS
    if not (real and small):
        for integers in (True, False):
            try:
                return "meta", (
                    _run_meta(tower, pair[0], integers=integers),
                    _run_meta(tower, pair[1], integers=integers),
                )
            except Exception as raised:  # any failure: try the next way of running it
                error = raised
    if real:
        try:
            outs = (_run_real(tower, pair[0]), _run_real(tower, pair[1]))
        except Exception as raised:  # the probe's input does not suit the tower
            error = raised
        else:
            device = next((p.device.type for p in tower.parameters()), "cpu")
            return device, outs
    assert error is not None
    raise error


#: The public batch-norm classes (their shared base class is private to torch).
_BATCH_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
)


def _mixing(tower: nn.Module) -> str:
    """Modules that mix the items of a call in training, which a probe in eval mode
    cannot see: batch norms that track batch statistics."""
    found = [
        name
        for name, module in tower.named_modules()
        if isinstance(module, _BATCH_NORMS) and (module.training or not module.track_running_stats)
    ]
    if not found:
        return ""
    return (
        f"batch norms {found[:3]} normalise over the items of a call, so an item's output "
        "depends on the others"
    )


# ------------------------------------------------------------------------ checking
def _shapes(output: Any) -> list[tuple[int, ...]]:
    leaves: list[Tensor] = []
    take_tensors_out(output, leaves)
    return [tuple(t.shape) for t in leaves]


def _check(
    tower: nn.Module,
    layout: MediaLayout,
    pair: tuple[ProbeCall, ProbeCall],
    outs: tuple[Any, Any],
    *,
    values: bool,
) -> ProbeReport:
    pieces: list[tuple[Tensor, ...]] = []
    spec = None
    inputs: tuple[tuple[str, int], ...] = ()
    for count, call, out in zip((1, 2), pair, outs, strict=True):
        try:
            split = layout.split_call(tower, tuple(call.args), dict(call.kwargs))
        except (ValueError, TypeError) as error:
            raise _MisfitError(f"it cannot split the probe's call: {error}") from None
        if len(split.items) != count:
            raise _MisfitError(f"it splits a call of {count} items into {len(split.items)}")
        weights = [item.fields[0].shape[0] for item in split.items]
        try:
            spec, cut = layout.split_output(out, weights)
        except ValueError as error:
            raise _MisfitError(str(error)) from None
        pieces.append(cut[0])
        if count == 2:
            inputs = tuple(
                (name, int(t.shape[0]))
                for name, t in zip(split.spec.fields, split.items[0].fields, strict=True)
                if name not in split.spec.scalars
            )
            try:
                joined = layout.join_output(spec, cut)
            except (ValueError, RuntimeError) as error:
                raise _MisfitError(f"its pieces do not join back: {error}") from None
            want, got = _shapes(out), _shapes(joined)
            if want != got:
                raise _MisfitError(
                    f"its pieces join into tensors of shapes {got}, not the call's {want}"
                )
    alone, together = pieces
    shapes = (_shapes(alone), _shapes(together))
    if shapes[0] != shapes[1]:
        raise _MisfitError(
            "an item's output rows depend on the other items of the call: "
            f"{shapes[0]} alone, {shapes[1]} beside another item"
        )
    if values:
        for index, (a, b) in enumerate(zip(alone, together, strict=True)):
            if not a.is_floating_point():
                continue
            scale = max(1.0, float(a.detach().abs().max())) if a.numel() else 1.0
            if not torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-4 * scale):
                raise _MisfitError(
                    f"output tensor {index} of an item differs when another item is in "
                    "the call (the tower mixes items, so it cannot encode them apart)"
                )
    assert spec is not None
    return ProbeReport(
        layout=layout.name,
        status=FITS,
        inputs=inputs,
        outputs=tuple(spec.describe(i) for i in range(len(spec.dtypes))),
    )


# ------------------------------------------------------------------------ entry
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], ProbeReport]] = (
    weakref.WeakKeyDictionary()
)


def _fingerprint(tower: nn.Module, layout: MediaLayout) -> tuple[Any, ...]:
    return (
        type(layout),
        layout.name,
        sum(1 for _ in tower.modules()),
        tuple((p.shape, p.dtype, p.device.type) for p in tower.parameters()),
    )


def probe_layout(tower: nn.Module, layout: MediaLayout) -> ProbeReport:
    """Whether ``layout`` (bound to ``tower``) fits ``tower``, from its probe calls (see
    the module docstring); never raises for a layout that does not fit or a tower that
    cannot run: the report says so.

    Args:
        tower: the tower to probe.
        layout: the candidate layout.

    Returns:
        Whether it fits, what it cuts, or why it could not tell.
    """
    key = _fingerprint(tower, layout)
    cached = _CACHE.setdefault(tower, {})
    if key not in cached:
        cached[key] = _probe(tower, layout)
        logger.debug("probe of %s: %s", type(tower).__name__, cached[key].summary())
    return cached[key]


def _probe(tower: nn.Module, layout: MediaLayout) -> ProbeReport:
    if _sharded(tower):
        return ProbeReport(layout.name, UNPROBED, reason="the tower is already sharded")
    mixing = _mixing(tower)
    if mixing:
        return ProbeReport(layout.name, MISFIT, reason=mixing)
    try:
        pairs: Sequence[tuple[ProbeCall, ProbeCall]] = layout.probe_calls(tower)
    except Exception as error:  # a layout's guess that fails is no probe
        return ProbeReport(layout.name, UNPROBED, reason=f"no probe calls: {error}")
    if not pairs:
        return ProbeReport(
            layout.name, UNPROBED, reason="the layout cannot make a probe call for this tower"
        )
    real = all(t.device.type != "meta" for t in (*tower.parameters(), *tower.buffers()))
    first = ""
    for pair in pairs:
        try:
            ran_on, outs = _outputs(tower, pair, real)
        except Exception as error:  # this input shape does not suit the tower
            # The first input is the likeliest (from the config): its error is the one
            # that says why the tower runs on none (a config whose widths disagree), where
            # the last guess's says only that an image is not a clip.
            first = first or f"{type(error).__name__}: {error}".splitlines()[0][:300]
            continue
        try:
            report = _check(tower, layout, pair, outs, values=ran_on != "meta")
        except _MisfitError as misfit:
            return ProbeReport(layout.name, MISFIT, ran_on=ran_on, reason=str(misfit))
        return dataclasses.replace(report, ran_on=ran_on)
    where = "on the meta device" + (" or on its weights" if real else "")
    return ProbeReport(
        layout.name,
        UNPROBED,
        reason=f"the tower ran on none of the {len(pairs)} probe inputs {where}",
        error=first,
    )

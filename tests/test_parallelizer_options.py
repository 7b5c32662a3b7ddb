"""Every parallelizer accepts every option of its base classes, with the same default.

Error messages tell users to pass base options (``uneven_media=True``,
``disabled_hooks=...``) whatever parallelizer they use, so a subclass that drops
one breaks the advice. Checked by signature for every parallelizer class of every
package, found by walking the subclasses of ``fsdp_core.ModelParallelizer``; and the
exact ``disabled_hooks=(...)`` that ``FSDPInternalsError`` proposes works with each.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

import fsdp_core
import model_deepseek_v41
import multimodal_fsdp
from fsdp_core import FSDPInternalsError, ModelParallelizer, build_mesh, internals
from fsdp_core.fake_group import fake_process_group

DIM = 8
PACKAGES = ("fsdp_core", "multimodal_fsdp", "model_deepseek_v41")

#: A valid non-default value for each option of a library parallelizer.
NON_DEFAULTS: dict[str, Any] = {
    "dtype_safe": False,
    "disabled_hooks": ("unused_params",),
    "frozen_multimodal_sharding": "replicate",
    "extra_tower_names": ("extra_tower",),
    "extra_projector_names": ("extra_projector",),
    "exclude": ("some.module",),
    "sync_replicated": False,
    "uneven_media": True,
    "balance_media": True,
    "balance_media_group": 8,
    "offload": {"tower": CPUOffloadPolicy(pin_memory=False)},
}


def parallelizer_classes() -> list[type[fsdp_core.ModelParallelizer]]:
    # multimodal_fsdp and model_deepseek_v41 are imported above for their subclasses.
    assert {multimodal_fsdp.__name__, model_deepseek_v41.__name__} <= set(PACKAGES)
    found: list[type[fsdp_core.ModelParallelizer]] = []
    todo: list[type[fsdp_core.ModelParallelizer]] = [fsdp_core.ModelParallelizer]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] in PACKAGES and cls not in found:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__qualname__)


def keyword_options(cls: type) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_every_package_has_its_parallelizer() -> None:
    names = {cls.__name__ for cls in parallelizer_classes()}
    assert {
        "ModelParallelizer",
        "MultimodalParallelizer",
        "DeepseekV41ModelParallelizer",
    } <= names


@pytest.mark.parametrize("cls", parallelizer_classes(), ids=lambda c: c.__name__)
def test_every_base_option_is_accepted_with_the_same_default(cls: type) -> None:
    mine = keyword_options(cls)
    for base in cls.__mro__[1:]:
        if not (isinstance(base, type) and issubclass(base, fsdp_core.ModelParallelizer)):
            continue
        for name, default in keyword_options(base).items():
            assert name in mine, f"{cls.__name__} drops {base.__name__}'s option {name!r}"
            assert mine[name] == default, (
                f"{cls.__name__}({name}=) defaults to {mine[name]!r}, "
                f"{base.__name__} to {default!r}"
            )


@pytest.mark.parametrize("cls", parallelizer_classes(), ids=lambda c: c.__name__)
def test_every_option_can_be_passed(cls: type) -> None:
    for name in keyword_options(cls):
        assert name in NON_DEFAULTS, f"add a non-default value for {name!r} to NON_DEFAULTS"
        value = NON_DEFAULTS[name]
        if name == "uneven_media":
            made = cls(uneven_media=True, frozen_multimodal_sharding="root")
        else:
            made = cls(**{name: value})
        if isinstance(value, bool):
            assert getattr(made, name) is value, (cls.__name__, name)
        if name == "disabled_hooks":
            assert made.disabled_hooks == frozenset(value)
        if hasattr(made, "with_options") and name != "frozen_multimodal_sharding":
            # Copies with another frozen-tower policy keep every other option.
            copy = made.with_options(frozen_multimodal_sharding="root")
            assert getattr(copy, name) == getattr(made, name), (cls.__name__, name)


# --- the advice of FSDPInternalsError, for every parallelizer -----------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture
def fake2() -> Iterator[None]:
    with fake_process_group(2):
        yield


@pytest.mark.parametrize("cls", parallelizer_classes(), ids=lambda c: c.__name__)
def test_disabled_hooks_advice_works_for_every_parallelizer(
    fake2: None, monkeypatch: pytest.MonkeyPatch, cls: type[ModelParallelizer]
) -> None:
    renamed = internals.Probe("group", "renamed_in_a_future_torch")
    for hook in cls.HOOKS:
        monkeypatch.setattr(hook, "reads", (*hook.reads, renamed))
    with pytest.raises(FSDPInternalsError) as info:
        cls().parallelize(Net(), mesh=build_mesh())
    found = re.search(r"disabled_hooks=(\([^)]*\))", str(info.value))
    assert found, str(info.value)
    disabled = ast.literal_eval(found.group(1))
    model = Net()
    cls(disabled_hooks=disabled).parallelize(model, mesh=build_mesh())  # type: ignore[call-arg]
    model(torch.randn(2, DIM)).sum().backward()

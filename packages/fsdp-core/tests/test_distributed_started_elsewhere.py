"""init_distributed() accepts a default group another library started.

accelerate on CPU calls ``init_process_group()`` without a backend: torch picks gloo for
the CPU, but ``dist.get_backend()`` then reads ``'undefined'``; ``init_distributed()``
refused that group (``no mesh device known for backend 'undefined'``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from fsdp_core.distributed import destroy_distributed, init_distributed


@pytest.fixture
def bare_group(clean_env: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-process default group started without naming a backend."""
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        destroy_distributed()


def test_the_group_reads_undefined(bare_group: None) -> None:
    assert dist.get_backend() == "undefined"


def test_a_group_without_a_backend_name_is_accepted(bare_group: None) -> None:
    ctx = init_distributed()
    assert ctx.backend == "cpu:gloo"
    assert ctx.device == torch.device("cpu")
    assert (ctx.rank, ctx.world_size) == (0, 1)
    assert init_distributed() == ctx


def test_the_backend_it_runs_may_be_named(bare_group: None) -> None:
    assert init_distributed(backend="gloo").backend == "cpu:gloo"


def test_another_backend_is_still_refused(bare_group: None) -> None:
    with pytest.raises(ValueError, match=r"initialised with backend 'cpu:gloo'; cannot switch"):
        init_distributed(backend="fake")

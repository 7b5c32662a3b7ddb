"""One tensor walker (``fsdp_core.runtime.nested_tensors``) for the runtime hooks' output
watch and the activation replay."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_core.runtime import nested_tensors, output_tensors


@dataclass
class Output:
    logits: torch.Tensor
    extra: tuple[torch.Tensor, ...]


def test_every_nesting_is_walked_in_order() -> None:
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    value = [a, (b, {"x": Output(c, (d,))}), "text", None]
    assert [id(t) for t in nested_tensors(value)] == [id(a), id(b), id(c), id(d)]


def test_output_tensors_keep_those_that_need_a_gradient() -> None:
    grad = torch.zeros(1, requires_grad=True)
    assert output_tensors({"loss": grad, "ids": torch.zeros(1)}) == [grad]

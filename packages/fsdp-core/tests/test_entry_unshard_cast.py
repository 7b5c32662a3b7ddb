"""Inputs of a module called outside the model's forward keep their container types.

The entry-unshard hook casts floating inputs as a unit's mixed-precision policy would.
transformers' ``generate()`` passes ``mm_encoder_outputs={"image": BaseModelOutputWithPooling}``
to the forward of a model that runs outside the root forward (the model inside a
``PeftModel``): turning the ``ModelOutput`` into a plain dict broke the forward
(``'dict' object has no attribute 'pooler_output'``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch

from fsdp_core.entry_unshard import _cast


class Output(OrderedDict[str, Any]):
    """A dict subclass with attribute access, like transformers' ``ModelOutput``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dict_subclass_keeps_its_type_and_values_are_cast(dtype: torch.dtype) -> None:
    value = {"image": Output(pooler_output=torch.ones(2, 3), ids=torch.arange(2))}
    cast = _cast(value, dtype)
    assert type(cast) is dict
    assert type(cast["image"]) is Output
    assert cast["image"].pooler_output.dtype == dtype
    assert cast["image"].ids.dtype == torch.int64
    assert value["image"].pooler_output.dtype == torch.float32  # the caller's left alone


def test_a_transformers_model_output_keeps_its_type() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    out = outputs.BaseModelOutputWithPooling(
        last_hidden_state=torch.ones(1, 2, 4), pooler_output=torch.ones(2, 4)
    )
    cast = _cast({"image": out}, torch.bfloat16)
    assert type(cast["image"]) is outputs.BaseModelOutputWithPooling
    assert cast["image"].pooler_output.dtype == torch.bfloat16
    assert cast["image"].last_hidden_state.dtype == torch.bfloat16


def test_a_namedtuple_keeps_its_type() -> None:
    from typing import NamedTuple

    class Pair(NamedTuple):
        hidden: torch.Tensor
        ids: torch.Tensor

    cast = _cast((Pair(torch.ones(2), torch.arange(2)),), torch.bfloat16)
    assert type(cast[0]) is Pair
    assert cast[0].hidden.dtype == torch.bfloat16
    assert cast[0].ids.dtype == torch.int64

"""Predicted memory held to measured memory, with the tolerances of issue 13: parameter,
gradient and optimizer bytes within 2% (they are exact today), activations within 25%,
the peak total within 10%. Shared by every test that compares a memory prediction."""

from __future__ import annotations

from multimodal_fsdp.measure.memory import MemoryMeasurement

#: Figures the model predicts exactly (2% tolerance).
EXACT = (
    "sharded_param_bytes",
    "replicated_param_bytes",
    "peak_gathered_forward_bytes",
    "peak_gathered_backward_bytes",
    "gradient_bytes",
    "optimizer_bytes",
)


def relative(predicted: int, measured: int) -> float:
    return abs(predicted - measured) / max(measured, 1)


def check_memory(result: MemoryMeasurement) -> None:
    """Every predicted figure of ``result`` within its tolerance of the measured one."""
    predicted, measured = result.costs.memory, result.measured
    assert predicted is not None
    report = f"predicted {predicted.as_dict()}\nmeasured {measured.as_dict()}"
    for name in EXACT:
        assert relative(getattr(predicted, name), getattr(measured, name)) <= 0.02, (
            f"{name}\n{report}"
        )
    assert predicted.activation_bytes is not None
    assert relative(predicted.activation_bytes, measured.activation_bytes) <= 0.25, report
    assert predicted.backward_activation_bytes is not None
    assert (
        relative(predicted.backward_activation_bytes, measured.backward_activation_bytes) <= 0.25
    ), report
    assert relative(predicted.peak_bytes, measured.peak_bytes) <= 0.10, report

"""A predicted and a measured step report their shared figures through one list
(``multimodal_fsdp.estimate.memory.memory_figures``), so the two dicts read side by side."""

from __future__ import annotations

from multimodal_fsdp.estimate.memory import MemoryEstimate
from multimodal_fsdp.measure.memory import MeasuredMemory


def test_predicted_and_measured_memory_report_the_same_figures_in_order() -> None:
    """``MemoryEstimate.as_dict`` and ``MeasuredMemory.as_dict`` share one list of figures."""
    figures = dict.fromkeys(
        (
            "sharded_param_bytes",
            "replicated_param_bytes",
            "peak_gathered_forward_bytes",
            "peak_gathered_backward_bytes",
            "gradient_bytes",
            "optimizer_bytes",
            "activation_bytes",
            "backward_activation_bytes",
        ),
        7,
    )
    predicted = MemoryEstimate(optimizer="adamw", **figures).as_dict()
    measured = MeasuredMemory(optimizer="adamw", peak_bytes=9, **figures).as_dict()
    shared = ["optimizer", *figures]
    assert list(predicted)[1:10] == list(measured)[1:10] == shared
    assert {k: predicted[k] for k in shared} == {k: measured[k] for k in shared}
    assert (predicted["source"], measured["source"]) == ("predicted", "measured")
    assert list(predicted)[10:] == [
        "step_peak_bytes",
        "resting_bytes",
        "peak_bytes",
        "peak_includes_activations",
        "host_param_bytes",
        "host_gradient_bytes",
        "host_optimizer_bytes",
    ]
    assert list(measured)[10:] == [
        "peak_bytes",
        "peak_breakdown",
        "host_param_bytes",
        "host_gradient_bytes",
        "host_optimizer_bytes",
    ]

"""One real step of a plan under the fake process group, compared with the estimates.

[`multimodal_fsdp.measure.comm`][multimodal_fsdp.measure.comm] counts collectives and bytes;
[`multimodal_fsdp.measure.memory`][multimodal_fsdp.measure.memory] tracks memory.
"""

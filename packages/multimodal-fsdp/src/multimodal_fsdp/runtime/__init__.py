"""Runtime hooks of multimodal plans: what runs during training steps.

Each hook is a [`fsdp_core.runtime.RuntimeHook`][fsdp_core.runtime.RuntimeHook] whose data
the planner computed: the prefetch guard for frozen tower units
([`multimodal_fsdp.runtime.prefetch_guard`][multimodal_fsdp.runtime.prefetch_guard]) and the
schedule check for media regions
([`multimodal_fsdp.runtime.schedule_check`][multimodal_fsdp.runtime.schedule_check]).
"""

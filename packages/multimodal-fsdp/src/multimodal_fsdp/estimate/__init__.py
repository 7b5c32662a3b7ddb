"""What a plan costs before it runs: collectives, bytes, memory and the policy chooser.

Everything here reads a [`fsdp_core.plan.ShardingPlan`][fsdp_core.plan.ShardingPlan] and the
(meta) model; nothing needs a process group. The measured counterparts live in
[`multimodal_fsdp.measure`][multimodal_fsdp.measure].
"""

"""Expert parallelism on 4 gloo ranks: the DeepSeek-V4.1 reference model with routed experts.

A ``('dp', 'ep')`` 2x2 mesh. EP borrows data-parallel ranks (as torchtitan's does): all
four ranks hold different batches; ``model_deepseek_v41.moe.shard_experts`` places each
layer's 4 experts ``Shard(0)`` over ``ep`` (2 per rank), and the library shards the rest
over ``dp`` and ``ep`` flattened, keeping the experts out of its units and reducing their
gradients over ``dp`` (``fsdp_core.replica_grad``). ``ep_deepseek_moe`` runs the vision
tower frozen under each policy and trainable; ``ep_nemo_calls`` calls
``fully_shard_deepseek_v41`` and ``PARALLELIZER._fully_shard_module`` the way NeMo
Automodel's MoE parallelizer does; ``torchtitan_dp_ep`` goes through the torchtitan
adapter with torchtitan's own ``ParallelDims(dp_shard=4, ep=2)`` on the meta model.
``tests/test_ep_distributed.py`` compares each with one process on the mean of the four
batches' losses (losses, first-step gradients, parameters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdp_core import DistributedContext
from fsdp_core.runtime import installed_hooks
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41, make_batch
from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer, fully_shard_deepseek_v41
from model_deepseek_v41.moe import MoE, shard_experts

STEPS = 2
LR = 0.05
WORLD = 4
CONFIG = DeepseekV41Config.tiny(num_experts=4, experts_per_token=2, expert_intermediate=32)
#: The cases of ``ep_deepseek_moe``: the frozen-tower policy, or ``trainable``.
CASES = ("root", "per_layer", "replicate", "trainable")
EXPERT = "model.layers.0.mlp.experts.gate_up"


def ep_batches() -> list[list[dict[str, torch.Tensor]]]:
    """``batches[step][rank]``: every rank its own batch (EP ranks are data-parallel)."""
    return [
        [
            dict(make_batch(CONFIG, batch_size=2, seq_len=24, seed=100 * step + rank))
            for rank in range(WORLD)
        ]
        for step in range(STEPS)
    ]


def build_ep_model(case: str) -> torch.nn.Module:
    """The tiny MoE model; its vision tower frozen unless ``case`` is ``trainable``."""
    model = build_deepseek_v41(CONFIG, seed=0)
    if case != "trainable":
        model.vision.requires_grad_(False)
    return model


@scenario("ep_deepseek_moe")
def ep_deepseek_moe(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """See the module docstring; ``accumulate``: ``root`` with two micro-batches per step,
    the first without gradient sync (FSDP reduces the rest once, the experts' hook after
    each backward: the sums agree)."""
    results = {case: _library_case(ctx, case) for case in CASES}
    results["accumulate"] = _library_case(ctx, "root", micro=2)
    return results


def _library_case(ctx: DistributedContext, case: str, *, micro: int = 1) -> dict[str, Any]:
    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "ep"))
    model = build_ep_model(case).to(ctx.device)
    sharded = shard_experts(model, world["ep"])
    policy = "root" if case == "trainable" else case
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
    plan = parallelizer.plan(model)
    parallelizer.apply_plan(model, plan, mesh=world, dp_dims="dp")
    expert = model.get_parameter(EXPERT)
    assert isinstance(expert, DTensor)
    result = _train(model, ctx, micro=micro)
    managed = {
        id(p)
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for p in m.parameters()
        if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names != ("ep",)
    }
    result.update(
        sharded=sharded,
        ignored=[n for n in plan.ignored_param_names if n in sharded],
        experts_in_units=[n for n in sharded if id(model.get_parameter(n)) in managed],
        expert_mesh=list(expert.device_mesh.mesh_dim_names or ()),
        expert_placements=[str(p) for p in expert.placements],
        expert_local_experts=expert.to_local().shape[0],
        hooks=sorted(installed_hooks(model)),
        planned_hooks=list(plan.hook_names()),
    )
    return result


@scenario("ep_nemo_calls")
def ep_nemo_calls(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """NeMo Automodel's MoE parallelizer, step by step, on the reference model: experts
    placed over ``ep`` and FSDP-sharded over ``ep_shard``; then each decoder layer with
    ``fully_shard_deepseek_v41(layer, mesh=, reshard_after_forward=, mp_policy=,
    offload_policy=, ignored_params=<the experts>)``; each vision block and the tower with
    ``PARALLELIZER._fully_shard_module(module, mesh=, mp_policy=)``; then the embeddings,
    the LM head, the text model and the root like the layers, without ignored_params."""
    moe_mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("ep_shard", "ep"))
    fsdp_mesh = init_device_mesh(ctx.device.type, (WORLD,), mesh_dim_names=("dp_shard_cp",))
    model = build_ep_model("trainable").to(ctx.device)
    shard_experts(model, moe_mesh["ep"])
    mp_policy = MixedPrecisionPolicy()

    def shard(module: torch.nn.Module, **extra: Any) -> None:
        returned = fully_shard_deepseek_v41(
            module,
            mesh=fsdp_mesh,
            reshard_after_forward=False,
            mp_policy=mp_policy,
            offload_policy=None,
            **extra,
        )
        assert returned is module

    for layer in model.model.layers:
        moe = layer.mlp
        assert isinstance(moe, MoE)
        # NeMo shards grouped experts over ep_shard on dim 1 (more shards than experts).
        fully_shard(
            moe.experts,
            mesh=moe_mesh["ep_shard"],
            shard_placement_fn=lambda p: Shard(1),
            reshard_after_forward=False,
            mp_policy=mp_policy,
        )
        # Their FSDP group (ep_shard) is smaller than the dense one: divide like FSDP
        # divides the rest (torchtitan's fsdp_gradient_divide_factor does the same);
        # summed, then divided, because gloo has no PREMUL_SUM.
        experts = moe.experts
        assert isinstance(experts, FSDPModule)
        experts.set_gradient_divide_factor(float(WORLD))
        experts.set_force_sum_reduction_for_comms(True)
        shard(layer, ignored_params=set(moe.experts.parameters()))
    for block in model.vision.blocks:
        assert PARALLELIZER._fully_shard_module(block, mesh=fsdp_mesh, mp_policy=mp_policy) is block
    assert (
        PARALLELIZER._fully_shard_module(model.vision, mesh=fsdp_mesh, mp_policy=mp_policy)
        is model.vision
    )
    shard(model.model.embed_tokens)
    shard(model.lm_head)
    shard(model.model)
    shard(model)
    expert = model.get_parameter(EXPERT)
    assert isinstance(expert, DTensor)
    result = _train(model, ctx)
    result.update(
        expert_mesh=list(expert.device_mesh.mesh_dim_names or ()),
        expert_placements=[str(p) for p in expert.placements],
    )
    return result


@scenario("torchtitan_dp_ep")
def torchtitan_dp_ep(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """torchtitan's ParallelDims(dp_shard=4, ep=2): the adapter runs the caller's EP plan
    on its ``ep`` mesh, then the library over its sparse mesh (``efsdp``, ``ep``); the
    meta model is then materialised and initialised as torchtitan does."""
    from torchtitan.config.configs import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import parallel_dims as parallel_dims_module

    from fsdp_core.integrations.torchtitan import parallelize_fn

    parallel_dims_module.device_type = ctx.device.type  # torchtitan assumes an accelerator
    parallel_dims = parallel_dims_module.ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=2, world_size=ctx.world_size
    )
    model = build_deepseek_v41(CONFIG, device="meta")
    fn = parallelize_fn(
        PARALLELIZER.with_options(frozen_multimodal_sharding="root"), expert_parallel=shard_experts
    )
    model = fn(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(),
    )
    model.to_empty(device=ctx.device)
    model.init_weights(seed=0)
    expert = model.get_parameter(EXPERT)
    assert isinstance(expert, DTensor)
    result = _train(model, ctx)
    result.update(
        expert_mesh=list(expert.device_mesh.mesh_dim_names or ()),
        expert_placements=[str(p) for p in expert.placements],
        hooks=sorted(installed_hooks(model)),
    )
    return result


#: Images per sample on each rank of ``ep_balance_media``: ranks 0 and 2 (one ``ep``
#: coordinate) hold twice the images of ranks 1 and 3, so balancing over ``dp`` alone
#: leaves 4, 2, 4, 2 images per rank where balancing over all four gives 3 each.
BALANCE_IMAGES = (2, 1, 2, 1)
#: The cases of ``ep_balance_media``: the frozen-tower policy, or ``trainable``.
BALANCE_CASES = ("root", "per_layer", "trainable")


def ep_balance_batches() -> list[list[dict[str, torch.Tensor]]]:
    """``batches[step][rank]`` of ``ep_balance_media``: uneven images (``BALANCE_IMAGES``)."""
    return [
        [
            dict(
                make_batch(
                    CONFIG,
                    batch_size=2,
                    seq_len=24,
                    num_images_per_sample=BALANCE_IMAGES[rank],
                    seed=100 * step + rank,
                )
            )
            for rank in range(WORLD)
        ]
        for step in range(STEPS)
    ]


@scenario("ep_balance_media")
def ep_balance_media(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """``balance_media=True`` on the ``('dp', 'ep')`` 2x2 mesh with uneven media
    (``BALANCE_IMAGES``): every rank holds its own batch, so the four ranks balance their
    images together. Per case: losses, first-step gradients, final parameters and the
    images each rank's tower encoded in the first step (a forward pre-hook on
    ``vision.patch_embed``), gathered."""
    return {case: _balance_case(ctx, case) for case in BALANCE_CASES}


def _balance_case(ctx: DistributedContext, case: str) -> dict[str, Any]:
    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "ep"))
    model = build_ep_model(case).to(ctx.device)
    shard_experts(model, world["ep"])
    policy = "root" if case == "trainable" else case
    DeepseekV41ModelParallelizer(frozen_multimodal_sharding=policy, balance_media=True).parallelize(
        model, mesh=world, dp_dims="dp"
    )
    rows = [0]

    def count(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        rows[0] += int(args[0].shape[0])

    handle = model.get_submodule("vision.patch_embed").register_forward_pre_hook(count)
    result = _train(model, ctx, batches=ep_balance_batches(), after_first=handle.remove)
    gathered: list[int] = [0] * ctx.world_size
    dist.all_gather_object(gathered, rows[0])
    result.update(rows=gathered, hooks=sorted(installed_hooks(model)))
    return result


def micro_batches(batch: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` split into ``micro`` equal micro-batches of samples (one image each);
    the batch itself for one (whatever its images per sample)."""
    if micro == 1:
        return [batch]
    size = batch["input_ids"].shape[0] // micro
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(micro)]


def _train(
    model: torch.nn.Module,
    ctx: DistributedContext,
    *,
    micro: int = 1,
    batches: list[list[dict[str, torch.Tensor]]] | None = None,
    after_first: Any = None,
) -> dict[str, Any]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step, per_rank in enumerate(ep_batches() if batches is None else batches):
        batch = {k: v.to(ctx.device) for k, v in per_rank[ctx.rank].items() if v is not None}
        total = torch.zeros(())
        for index, part in enumerate(micro_batches(batch, micro)):
            if micro > 1:
                model.set_requires_gradient_sync(index == micro - 1)  # type: ignore[operator]
            loss = model(**part) / micro
            loss.backward()
            total += loss.detach().cpu()
        if step == 0:
            if after_first is not None:
                after_first()
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return {
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in model.named_parameters() if p.requires_grad},
    }

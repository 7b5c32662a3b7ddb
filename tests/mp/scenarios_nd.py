"""N-D meshes: the library's data parallelism beside tensor parallelism applied first.

4 gloo ranks on a ``('dp', 'tp')`` 2x2 mesh. torch's ``parallelize_module`` shards the
language model's MLPs of the tiny DeepSeek-V4.1 reference model over ``tp``
(``tensor_parallel.tensor_parallel_mlps``); then the library shards over ``dp``, given
either the sub-mesh ``world['dp']`` or the whole mesh with ``dp_dims='dp'``, under each
frozen-tower policy, with and without ``balance_media``. The two ranks of a TP group
hold the same batch (their DP coordinate's), so the run must train like one process on
the two DP batches of each step: ``tests/test_nd_distributed.py`` compares losses,
first-step gradients and final parameters (full tensors) with that reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from tensor_parallel import tensor_parallel_mlps
from torch.distributed.device_mesh import init_device_mesh
from vlm import LR, build_vlm, to_device, vlm_batches, vlm_loss

from fsdp_core import DistributedContext
from fsdp_core.runtime import installed_hooks
from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer
from model_deepseek_v41.tensor_parallel import deepseek_v41_tp_plan
from multimodal_fsdp.tensor_parallel import apply_tensor_parallel

STEPS = 3
#: Images per sample on each DP coordinate: uneven, so balancing moves some.
IMAGES = [2, 1]
POLICIES = ("root", "per_layer", "replicate")
#: How the library is given the mesh.
GIVEN = ("submesh", "whole")


def nd_cases() -> list[str]:
    return [
        f"{given}/{policy}/{'balanced' if balanced else 'plain'}"
        for given in GIVEN
        for policy in POLICIES
        for balanced in (False, True)
    ]


def _case(ctx: DistributedContext, given: str, policy: str, balanced: bool) -> dict[str, Any]:
    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = world["dp"].get_local_rank()
    model = build_vlm(dtype=torch.float32, frozen_tower=True).to(ctx.device)
    tensor_parallel_mlps(model, world["tp"])
    parallelizer = DeepseekV41ModelParallelizer(
        frozen_multimodal_sharding=policy, balance_media=balanced
    )
    if given == "submesh":
        parallelizer.parallelize(model, mesh=world["dp"])
    else:
        parallelizer.parallelize(model, mesh=world, dp_dims="dp")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step, per_dp in enumerate(vlm_batches(STEPS, 2, images=IMAGES)):
        loss = vlm_loss(model, to_device(per_dp[dp_rank], ctx.device))  # type: ignore[arg-type]
        loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # both ranks of a TP group hold their DP coordinate's loss
        losses.append(total.item() / ctx.world_size)
    hooks = installed_hooks(model)
    agreement = hooks["forward_agreement"]
    schedule = hooks.get("schedule_check")
    return {
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "hooks": sorted(hooks),
        "arrival_ranks": list(agreement.ranks),  # type: ignore[attr-defined]
        # The schedule check meets at the same agreement as the forward's (one sequence).
        "agreement_ranks": list(
            getattr(schedule, "agreement", agreement.agreement).ranks  # type: ignore[attr-defined]
        ),
        "unused_ranks": sorted(
            int(r)
            for r in hooks["unused_params"].mesh.mesh.flatten().tolist()  # type: ignore[attr-defined]
        ),
        "tp_mesh_dims": model.get_parameter("model.layers.0.mlp.gate_up.weight").device_mesh.ndim,
    }


@scenario("nd_dp_tp")
def nd_dp_tp(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Every case of ``nd_cases`` (see the module docstring)."""
    results: dict[str, Any] = {}
    for name in nd_cases():
        given, policy, balanced = name.split("/")
        results[name] = _case(ctx, given, policy, balanced == "balanced")
    return results


def _gather(mine: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


@scenario("nd_tp_peer_empty_batch")
def nd_tp_peer_empty_batch(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 1, the TP peer of rank 0, calls the model with an empty batch. The step
    agreement runs over the ranks that run the forward together (all four), so every
    rank raises ``EmptyBatchError`` before any collective of the forward; agreeing over
    the data-parallel ranks only ({1, 3}) would stop ranks 1 and 3 while ranks 0 and 2
    waited in the TP collectives of the forward. Then every rank with rows trains on."""
    from fsdp_core.step_agreement import is_empty_batch

    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = world["dp"].get_local_rank()
    model = build_vlm(dtype=torch.float32, frozen_tower=True).to(ctx.device)
    tensor_parallel_mlps(model, world["tp"])
    DeepseekV41ModelParallelizer(frozen_multimodal_sharding="root").parallelize(
        model, mesh=world["dp"]
    )
    batch = to_device(vlm_batches(1, 2, images=IMAGES)[0][dp_rank], ctx.device)
    empty = {k: (v[:0] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    mine = empty if ctx.rank == 1 else batch
    assert is_empty_batch((), mine) == (ctx.rank == 1)
    error: tuple[str, str] = ("", "")
    try:
        vlm_loss(model, mine).backward()  # type: ignore[arg-type]
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    errors = _gather(error)
    vlm_loss(model, batch).backward()  # type: ignore[arg-type]
    alive = torch.ones(1)
    dist.all_reduce(alive)
    return {"errors": errors, "alive": float(alive)}


#: Images per sample on each DP coordinate, per media distribution of
#: ``nd_encoder_work``: even, uneven, and all media on one data group (the other
#: text-only).
ENCODER_MEDIA = {"even": [1, 1], "uneven": [2, 1], "one": [2, 0]}
#: Steps of each ``nd_encoder_work`` case (the images are counted in the first).
ENCODER_STEPS = 2
#: ``single``: one sample of one image per DP coordinate, a tower call of fewer items
#: than a TP group has ranks (not split: both TP ranks encode it, one carries gradients).
SINGLE = "single"


def encoder_batches(name: str) -> list[list[dict[str, Any]]]:
    """``batches[step][dp_rank]`` of the ``nd_encoder_work`` distribution ``name``."""
    if name != SINGLE:
        return vlm_batches(ENCODER_STEPS, 2, images=ENCODER_MEDIA[name])  # type: ignore[return-value]
    return [
        [{k: v[:1] for k, v in batch.items()} for batch in per_dp]
        for per_dp in vlm_batches(ENCODER_STEPS, 2, images=[1, 1])
    ]


def encoder_cases() -> list[str]:
    """``media/policy/variant``: every distribution balanced under each frozen-tower
    policy, plain under ``root``, and balanced with a trainable tower."""
    return [
        *(f"{name}/root/plain" for name in ENCODER_MEDIA),
        *(f"{name}/{policy}/balanced" for name in ENCODER_MEDIA for policy in POLICIES),
        *(f"{name}/per_layer/trainable" for name in [*ENCODER_MEDIA, SINGLE]),
    ]


#: ``nd_tp_tower``: the vision tower's MLPs tensor-parallel too
#: (``deepseek_v41_tp_plan(include_vision=True)``), the tower frozen (``root``) or
#: trainable, balanced. Its TP collectives pair the ranks of a TP group, so they must
#: run the same items: balanced over the data-parallel ranks only, each image encoded
#: once per TP rank, and the tower's gradients not summed over TP.
TP_TOWER_CASES = ("uneven/root/tp_tower", "uneven/per_layer/tp_tower_trainable")


def _encoder_case(ctx: DistributedContext, name: str, policy: str, variant: str) -> dict[str, Any]:
    """One case of ``encoder_cases`` (or ``TP_TOWER_CASES``) on the ``('dp', 'tp')`` 2x2
    mesh: losses, first-step gradients, final parameters and the images each rank's tower
    encoded in the first step (a forward pre-hook on the tower's first layer counts its
    rows), gathered."""
    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = world["dp"].get_local_rank()
    trainable = variant.endswith("trainable")
    model = build_vlm(dtype=torch.float32, frozen_tower=not trainable).to(ctx.device)
    if variant.startswith("tp_tower"):
        plan = deepseek_v41_tp_plan(model, tp_size=2, include_vision=True, include_frozen=True)
        assert any(path.startswith("vision.") for path in plan)
        apply_tensor_parallel(model, world["tp"], plan)
    else:
        tensor_parallel_mlps(model, world["tp"])
    DeepseekV41ModelParallelizer(
        frozen_multimodal_sharding=policy, balance_media=variant != "plain"
    ).parallelize(model, mesh=world["dp"])
    rows = [0]

    def count(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        rows[0] += int(args[0].shape[0])

    handle = model.get_submodule("vision.patch_embed").register_forward_pre_hook(count)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    batches = encoder_batches(name)
    for step, per_dp in enumerate(batches):
        loss = vlm_loss(model, to_device(per_dp[dp_rank], ctx.device))  # type: ignore[arg-type]
        loss.backward()
        if step == 0:
            handle.remove()
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # both ranks of a TP group hold their DP coordinate's loss
        losses.append(total.item() / ctx.world_size)
    return {
        "hooks": sorted(installed_hooks(model)),
        "rows": [int(n) for n in _gather(rows[0])],
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in model.named_parameters()},
    }


@scenario("nd_encoder_work")
def nd_encoder_work(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Every case of ``encoder_cases`` (``tests/test_nd_encoder_work.py``)."""
    return {case: _encoder_case(ctx, *case.split("/")) for case in encoder_cases()}


@scenario("nd_tp_tower")
def nd_tp_tower(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Every case of ``TP_TOWER_CASES`` (``tests/test_nd_encoder_work.py``)."""
    return {case: _encoder_case(ctx, *case.split("/")) for case in TP_TOWER_CASES}


@scenario("nd_balanced_input_grads")
def nd_balanced_input_grads(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """``pixel_values`` that require a gradient on the ``('dp', 'tp')`` 2x2 mesh with
    ``balance_media``: each rank of a TP group encodes only its share of the images, so
    it could not return the whole input gradient; every rank raises the same ValueError
    at the same round instead of one rank raising while the others wait."""
    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = world["dp"].get_local_rank()
    model = build_vlm(dtype=torch.float32, frozen_tower=True).to(ctx.device)
    tensor_parallel_mlps(model, world["tp"])
    DeepseekV41ModelParallelizer(frozen_multimodal_sharding="root", balance_media=True).parallelize(
        model, mesh=world["dp"]
    )
    batch = to_device(vlm_batches(1, 2, images=IMAGES)[0][dp_rank], ctx.device)
    batch["pixel_values"] = batch["pixel_values"].clone().requires_grad_(True)
    error: tuple[str, str] = ("", "")
    try:
        vlm_loss(model, batch).backward()  # type: ignore[arg-type]
    except ValueError as exc:
        error = (type(exc).__name__, str(exc))
    alive = torch.ones(1)
    dist.all_reduce(alive)
    return {"errors": _gather(error), "alive": float(alive)}

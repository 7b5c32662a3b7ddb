"""Routed experts for the reference model's language layers, and the EP plan that shards them.

A MoE layer (``model.layers[i].mlp`` when ``DeepseekV41Config.num_experts > 0``) is a
``router`` Linear (a dense parameter, sharded by FSDP like the rest) and ``experts``
([`RoutedExperts`][model_deepseek_v41.moe.RoutedExperts]): ``num_experts`` SwiGLU experts
stored as two stacked weights whose dimension 0 is the expert. Each token goes to its
``experts_per_token`` best experts, weighted by their renormalised router probabilities.

Expert parallelism is the caller's plan, applied before the library shards:
[`shard_experts`][model_deepseek_v41.moe.shard_experts] makes each stacked weight a
``DTensor`` placed ``Shard(0)`` on an ``ep`` mesh, so a rank keeps ``num_experts / ep``
experts. The forward then sees the placement and sends each token to the rank that holds
its expert and back (two ``all_to_all`` per layer, whose backward routes the gradients
the inverse way). The library keeps these parameters out of its data-parallel units and
reduces their gradients over the ranks that hold the same shard
(``fsdp_core.expert_parallel``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn import functional

from model_deepseek_v41.config import DeepseekV41Config

__all__ = ["MoE", "RoutedExperts", "shard_experts"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward sends the gradient back
    along the inverse route (public API only)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    out: Tensor = _AllToAll.apply(x, out_splits, in_splits, group)  # type: ignore[no-untyped-call]
    return out


class RoutedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked weights: ``gate_up`` ``[E, hidden,
    2 * intermediate]`` and ``down`` ``[E, intermediate, hidden]`` (dimension 0: the
    expert, the dimension expert parallelism shards).

    Args:
        num_experts: how many experts.
        hidden: the model width.
        intermediate: each expert's hidden width.

    Args:
        num_experts: how many experts.
        hidden: the model width.
        intermediate: each expert's hidden width.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.down = nn.Parameter(torch.empty(num_experts, intermediate, hidden))

    def forward(self, tokens: Tensor, expert_ids: Tensor) -> Tensor:
        """``tokens`` ``[N, hidden]`` (grouped by expert), ``expert_ids`` ``[N]`` ->
        each token through its expert, ``[N, hidden]``. With EP-sharded weights each
        token is computed on the rank that holds its expert."""
        gate_up, down = self.gate_up, self.down
        if not isinstance(gate_up, DTensor):
            return _run_experts(tokens, expert_ids, gate_up, down)
        if not isinstance(down, DTensor) or gate_up.placements != (Shard(0),):
            raise ValueError(
                "RoutedExperts' weights must both be placed (Shard(0),) on a 1-D ep mesh "
                f"(model_deepseek_v41.moe.shard_experts); got {gate_up.placements}"
            )
        mesh = gate_up.device_mesh
        group, ep = mesh.get_group(), mesh.size()
        local = self.num_experts // ep
        counts = torch.bincount(expert_ids, minlength=self.num_experts).view(ep, local)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=group)
        send, recv = counts.sum(1).tolist(), received.sum(1).tolist()
        arrived = _all_to_all(tokens, recv, send, group)
        # Tokens arrive per source rank, each grouped by this rank's experts.
        local_ids = torch.repeat_interleave(
            torch.arange(local, device=tokens.device).repeat(ep), received.reshape(-1)
        )
        out = _run_experts(arrived, local_ids, gate_up.to_local(), down.to_local())
        return _all_to_all(out, send, recv, group)


def _run_experts(tokens: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Each row of ``tokens`` through expert ``ids`` of the stacked weights. Every
    expert runs, also on no rows, so each weight gets a gradient on every rank."""
    out = tokens.new_zeros(tokens.shape)
    gate_up, down = gate_up.to(tokens.dtype), down.to(tokens.dtype)
    for expert in range(gate_up.shape[0]):
        rows = (ids == expert).nonzero().squeeze(1)
        gate, up = (tokens[rows] @ gate_up[expert]).chunk(2, dim=-1)
        out = out.index_add(0, rows, (functional.silu(gate) * up) @ down[expert])
    return out


class MoE(nn.Module):
    """Top-k routed SwiGLU experts in place of a dense MLP.

    Args:
        config: the model's configuration (``num_experts`` > 0).

    Args:
        config: the model's configuration (``num_experts`` > 0).
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.router = nn.Linear(config.text_hidden, config.num_experts, bias=False)
        self.experts = RoutedExperts(
            config.num_experts, config.text_hidden, config.expert_intermediate
        )

    def forward(self, x: Tensor) -> Tensor:
        hidden = x.shape[-1]
        flat = x.reshape(-1, hidden)
        probs = functional.softmax(self.router(flat).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        order = torch.argsort(ids.reshape(-1), stable=True)
        source = order // self.top_k
        out = self.experts(flat[source], ids.reshape(-1)[order])
        weighted = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        combined = flat.new_zeros(flat.shape).index_add(0, source, weighted)
        return combined.reshape(x.shape)


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh) -> list[str]:
    """The reference model's EP plan: place every ``RoutedExperts`` weight ``Shard(0)``
    on ``ep_mesh`` (each rank keeps ``num_experts / ep`` experts). Run it before the
    library shards the model; every rank must have built the same weights.

    Args:
        model: a model with [`RoutedExperts`][model_deepseek_v41.moe.RoutedExperts]
            (real or on the meta device).
        ep_mesh: a 1-D mesh of the expert-parallel ranks (``world["ep"]``).

    Returns:
        The names of the sharded parameters.

    Raises:
        ValueError: ``ep_mesh`` is not 1-D, the model has no routed experts, or the
            ep size does not divide a module's number of experts.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be a 1-D mesh, got dimensions {ep_mesh.mesh_dim_names}")
    ep = ep_mesh.size()
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]
    if not experts:
        raise ValueError("the model has no RoutedExperts: build it with num_experts > 0")
    sharded = []
    for path, module in experts:
        if module.num_experts % ep:
            divisors = [d for d in range(1, module.num_experts + 1) if module.num_experts % d == 0]
            raise ValueError(
                f"ep size {ep} does not divide {path}'s {module.num_experts} experts; "
                f"sizes that do: {divisors}"
            )
        for name, param in list(module.named_parameters(recurse=False)):
            placed = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
            sharded.append(f"{path}.{name}")
    return sharded

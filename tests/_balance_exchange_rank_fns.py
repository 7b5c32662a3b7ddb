"""Run on spawned gloo ranks by ``test_balance_exchange`` (importable by the children).

Each case builds the same tiny tower on every rank, gives each rank its items (or none:
``join_without_call``), runs one balanced call and a backward, and compares with a
single-process reference computed on the rank itself: the outputs of the rank's items,
the gradients of its inputs, and the parameter gradients summed over ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fsdp_core.internals import TorchDispatchMode
from multimodal_fsdp.balance import (
    balanced_call,
    exchange_traffic,
    join_remaining_calls,
    join_without_call,
    media_layout_for,
)


class _Collectives(TorchDispatchMode):
    """Names of the c10d ops run inside the block, and their bytes (sent, received)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []
        self.sizes: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            op = func._schema.name.split("::")[-1]
            self.ops.append(op)
            if op == "allgather_":
                sent = sum(t.nbytes for t in args[1])
                received = sum(t.nbytes for slots in args[0] for t in slots)
            else:
                sent, received = args[1].nbytes, args[0].nbytes
            self.sizes.append((sent, received))
        return func(*args, **(kwargs or {}))


def _clip() -> nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
    )
    return CLIPVisionModel(config)


def _qwen() -> nn.Module:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    config = Qwen2VLVisionConfig(
        depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=2, temporal_patch_size=1
    )
    return Qwen2VisionTransformerPretrainedModel(config)


def _clip_items(count: int, seed: int) -> list[dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"pixels": torch.randn(1, 3, 16, 16, generator=generator)} for _ in range(count)]


def _qwen_items(grids: list[tuple[int, int, int]], seed: int) -> list[dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "pixels": torch.randn(t * h * w, 3 * 2 * 2, generator=generator),
            "grid": torch.tensor([[t, h, w]]),
        }
        for t, h, w in grids
    ]


def _clip_call(items: list[dict[str, Tensor]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """LLaVA's call: pixels positional, ``return_dict`` and all hidden states."""
    pixels = torch.cat([i["pixels"] for i in items])
    return (pixels,), {"return_dict": True, "output_hidden_states": True}


def _qwen_call(items: list[dict[str, Tensor]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    pixels = torch.cat([i["pixels"] for i in items])
    return (pixels,), {"grid_thw": torch.cat([i["grid"] for i in items])}


def _clip_loss(output: Any, weights: Tensor) -> Tensor:
    """Per-item weights, so an item's output landing on the wrong item changes the loss;
    reads a middle hidden state as LLaVA does."""
    hidden = output.hidden_states[-2]
    per_item = (hidden * hidden).mean(dim=(1, 2)) + output.pooler_output.sum(dim=1)
    return (per_item * weights).sum()


def _middle_hidden_loss(output: Any, weights: Tensor) -> Tensor:
    """LLaVA's read: only a middle hidden state, so the last encoder layer and the
    post-layernorm feed outputs no loss reads (one process leaves their grads None)."""
    hidden = output.hidden_states[-2]
    return ((hidden * hidden).mean(dim=(1, 2)) * weights).sum()


def _params_without_grad(tower: nn.Module) -> list[str]:
    return sorted(name for name, p in tower.named_parameters() if p.grad is None)


def _qwen_loss(output: Any, rows: list[int], weights: Tensor) -> Tensor:
    pieces = torch.split(output.pooler_output, [r // 4 for r in rows])
    return sum(
        ((piece * piece).mean() * w for piece, w in zip(pieces, weights, strict=True)),
        start=torch.zeros(()),
    )


def _case(
    *,
    rank: int,
    tower_kind: str,
    counts: list[int | None],
    trainable: bool,
    input_grad: bool,
    run_when_empty: bool = False,
    reads: str = "all",
) -> dict[str, Any]:
    """``counts[r]``: items of rank r (``None``: no call, join_without_call); ``reads``:
    ``"all"`` or ``"middle"`` (the loss reads one middle hidden state only)."""
    world = dist.get_world_size()
    build = _clip if tower_kind == "clip" else _qwen
    tower, reference = build(), build()
    tower.requires_grad_(trainable)
    reference.requires_grad_(trainable)
    grid_pool = [(1, 2, 2), (2, 2, 4), (1, 4, 4), (1, 2, 6), (2, 2, 2), (1, 4, 2)]
    per_rank: list[list[dict[str, Tensor]]] = []
    for r in range(world):
        n = counts[r] or 0
        if tower_kind == "clip":
            per_rank.append(_clip_items(n, seed=100 + r))
        else:
            per_rank.append(_qwen_items(grid_pool[r : r + n], seed=100 + r))
    for items in per_rank:
        for item in items:
            item["pixels"].requires_grad_(input_grad)
    weights = [
        torch.arange(1, len(items) + 1, dtype=torch.float32) * (r + 1)
        for r, items in enumerate(per_rank)
    ]

    def loss_of(output: Any, items: list[dict[str, Tensor]], w: Tensor) -> Tensor:
        if reads == "middle":
            return _middle_hidden_loss(output, w)
        if tower_kind == "clip":
            return _clip_loss(output, w)
        return _qwen_loss(output, [int(i["grid"].prod()) for i in items], w)

    make_call = _clip_call if tower_kind == "clip" else _qwen_call
    layout = media_layout_for(tower)  # before counting: finding it may run the tower
    runs = []
    tower.register_forward_hook(lambda *_: runs.append(1))
    counter = _Collectives()
    mine = per_rank[rank]
    with counter:
        if counts[rank] is None:
            loss = join_without_call(tower, layout=layout, run_when_empty=run_when_empty)
            output = None
        else:
            args, kwargs = make_call(mine)
            output = balanced_call(
                tower, args, kwargs, layout=layout, run_when_empty=run_when_empty
            )
            loss = loss_of(output, mine, weights[rank])
        forward_ops = list(counter.ops)
        if torch.is_grad_enabled() and (trainable or input_grad):
            loss.backward()
    backward_ops = counter.ops[len(forward_ops) :]
    result: dict[str, Any] = {
        "tower_runs": len(runs),
        "forward_ops": forward_ops,
        "backward_ops": backward_ops,
        "measured_bytes": counter.sizes,
    }
    # The single-process reference: every rank's items through one tower.
    everything = [item for items in per_rank for item in items]
    ref_items = [
        {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in i.items()}
        for i in everything
    ]
    args, kwargs = make_call(ref_items)
    ref_output = reference(*args, **kwargs)
    start = sum(len(items) for items in per_rank[:rank])
    predicted = _predicted(
        reference,
        make_call,
        per_rank,
        counts,
        ref_output,
        rank,
        trainable,
        input_grad,
        run_when_empty,
    )
    result["predicted_bytes"] = [(c.sent, c.received) for c in predicted]
    result["predicted_ops"] = [
        ("allgather_" if c.kind == "all_gather" else "alltoall_base_", c.phase) for c in predicted
    ]
    if output is not None:
        if tower_kind == "clip":
            got = [output.last_hidden_state, output.pooler_output, *output.hidden_states]
            want = [
                ref_output.last_hidden_state,
                ref_output.pooler_output,
                *ref_output.hidden_states,
            ]
            want = [t[start : start + len(mine)] for t in want]
        else:
            rows = [int(i["grid"].prod()) for i in everything]
            begin, n = sum(rows[:start]), sum(rows[start : start + len(mine)])
            got = [output.last_hidden_state, output.pooler_output]
            want = [
                ref_output.last_hidden_state[begin : begin + n],
                ref_output.pooler_output[begin // 4 : (begin + n) // 4],
            ]
        result["output_diff"] = max(
            float((g - w).detach().abs().max()) for g, w in zip(got, want, strict=True)
        )
        result["output_shapes_equal"] = all(
            g.shape == w.shape for g, w in zip(got, want, strict=True)
        )
        result["output_type"] = type(output).__name__
    if trainable or input_grad:
        ref_loss = sum(
            (
                loss_of(
                    _slice_output(
                        ref_output,
                        tower_kind,
                        everything,
                        sum(len(x) for x in per_rank[:r]),
                        len(per_rank[r]),
                    ),
                    per_rank[r],
                    weights[r],
                )
                for r in range(world)
                if per_rank[r]
            ),
            start=torch.zeros(()),
        )
        ref_loss.backward()
    if trainable:
        result["params_without_grad"] = _params_without_grad(tower)
        result["reference_params_without_grad"] = _params_without_grad(reference)
        diffs = []
        for (_name, p), q in zip(tower.named_parameters(), reference.parameters(), strict=True):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            want = q.grad if q.grad is not None else torch.zeros_like(q)
            diffs.append(float((grad - want).abs().max()))
        result["param_grad_diff"] = max(diffs)
        result["param_grad_norm"] = float(
            sum(float(q.grad.norm()) for q in reference.parameters() if q.grad is not None)
        )
    if input_grad and mine:
        result["input_grad_diff"] = max(
            float((item["pixels"].grad - ref["pixels"].grad).abs().max())  # type: ignore[operator]
            for item, ref in zip(mine, ref_items[start : start + len(mine)], strict=True)
        )
    return result


def _predicted(
    tower: nn.Module,
    make_call: Any,
    per_rank: list[list[dict[str, Tensor]]],
    counts: list[int | None],
    ref_output: Any,
    rank: int,
    trainable: bool,
    input_grad: bool,
    run_when_empty: bool,
) -> list[Any]:
    """``exchange_traffic`` from the item sizes: field bytes from each rank's split call,
    output bytes from the reference output split per item."""
    layout = media_layout_for(tower)
    calls = [layout.split_call(tower, *make_call(items)) if items else None for items in per_rank]
    costs = [[item.cost for item in c.items] if c else [] for c in calls]
    inputs = [[sum(t.nbytes for t in item.fields) for item in c.items] if c else [] for c in calls]
    floating = [
        [sum(t.nbytes for t in item.fields if t.is_floating_point()) for item in c.items]
        if c
        else []
        for c in calls
    ]
    weights = [item.fields[0].shape[0] for c in calls if c for item in c.items]
    _, pieces = layout.split_output(ref_output, weights)
    sizes = iter([sum(t.nbytes for t in piece) for piece in pieces])
    outputs = [[next(sizes) for _ in items] for items in per_rank]
    spec = next((c.spec for c in calls if c is not None), None)
    traffic = exchange_traffic(
        costs,
        rank=rank,
        spec=spec,
        input_bytes=inputs,
        output_bytes=outputs,
        input_grad_bytes=floating if input_grad else None,
        output_grad_bytes=outputs if (trainable or input_grad) else None,
        output_tensors=len(pieces[0]),
        run_when_empty=run_when_empty,
        callers=[r for r, count in enumerate(counts) if count is not None],
    )
    return traffic


def _slice_output(
    output: Any, kind: str, everything: list[dict[str, Tensor]], start: int, n: int
) -> Any:
    """The reference output restricted to items ``start .. start+n`` (the same type)."""
    if kind == "clip":
        return type(output)(
            last_hidden_state=output.last_hidden_state[start : start + n],
            pooler_output=output.pooler_output[start : start + n],
            hidden_states=tuple(h[start : start + n] for h in output.hidden_states),
        )
    rows = [int(i["grid"].prod()) for i in everything]
    begin, size = sum(rows[:start]), sum(rows[start : start + n])
    return type(output)(
        last_hidden_state=output.last_hidden_state[begin : begin + size],
        pooler_output=output.pooler_output[begin // 4 : (begin + size) // 4],
    )


CASES: dict[str, dict[str, Any]] = {
    "clip_all_on_one_rank": {
        "tower_kind": "clip",
        "counts": [4, None],
        "trainable": True,
        "input_grad": True,
    },
    "clip_three_to_one": {
        "tower_kind": "clip",
        "counts": [3, 1],
        "trainable": True,
        "input_grad": True,
    },
    "clip_frozen_text_only_rank": {
        "tower_kind": "clip",
        "counts": [3, None],
        "trainable": False,
        "input_grad": False,
    },
    "clip_frozen_even": {
        "tower_kind": "clip",
        "counts": [2, 2],
        "trainable": False,
        "input_grad": False,
    },
    "clip_fewer_than_ranks": {
        "tower_kind": "clip",
        "counts": [1, None],
        "trainable": True,
        "input_grad": True,
        "run_when_empty": True,
    },
    "qwen_three_to_one": {
        "tower_kind": "qwen",
        "counts": [3, 1],
        "trainable": True,
        "input_grad": True,
    },
    "qwen_text_only_rank": {
        "tower_kind": "qwen",
        "counts": [None, 3],
        "trainable": True,
        "input_grad": False,
    },
    "clip_reads_a_middle_hidden_state": {
        "tower_kind": "clip",
        "counts": [3, 1],
        "trainable": True,
        "input_grad": False,
        "reads": "middle",
    },
    "clip_reads_a_middle_hidden_state_placeholder": {
        "tower_kind": "clip",
        "counts": [1, None],
        "trainable": True,
        "input_grad": True,
        "run_when_empty": True,
        "reads": "middle",
    },
}

#: Cases whose loss leaves some tower outputs unread.
UNREAD_CASES = sorted(name for name, spec in CASES.items() if spec.get("reads") == "middle")


class _MaskedClip(nn.Module):
    """A CLIP tower whose forward names a per-image ``pixel_attention_mask`` (as Idefics2's
    and SmolVLM's towers do), so the balanced call must split it with the images; a mask
    that reaches a tower only through ``**kwargs`` is left out of balanced calls."""

    def __init__(self) -> None:
        super().__init__()
        self.clip = _clip()

    def forward(
        self, pixel_values: Tensor, pixel_attention_mask: Tensor | None = None, **kwargs: Any
    ) -> Any:
        return self.clip(pixel_values, **kwargs)


def _bad_call_on_one_rank(rank: int) -> dict[str, Any]:
    """Rank 1's call cannot be split (a mask with the wrong rows): every rank raises, and
    the group still works afterwards."""
    tower = _MaskedClip()
    pixels = torch.randn(2, 3, 16, 16)
    kwargs: dict[str, Any] = {"return_dict": True}
    if rank == 1:
        kwargs["pixel_attention_mask"] = torch.ones(3, 16, 16)
    outcome: dict[str, Any] = {"type": None, "message": ""}
    try:
        balanced_call(tower, (pixels,), kwargs)
    except Exception as error:
        outcome = {"type": type(error).__name__, "message": str(error)}
    value = torch.ones(1)
    dist.all_reduce(value)
    outcome["group_works"] = bool(value.item() == dist.get_world_size())
    return outcome


def run_cases(rank: int, world_size: int, out_dir: str) -> None:
    results = {name: _case(rank=rank, **spec) for name, spec in CASES.items()}
    results["bad_call_on_one_rank"] = _bad_call_on_one_rank(rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _plain_loss(output: Any, weights: Tensor, *, pooled: bool = True) -> Tensor:
    """Without hidden states: transformers 5.24 records them by the tower's class name,
    which ``fully_shard`` changes, so a sharded tower returns none. ``pooled=False``:
    the pooled output is not read (the post-layernorm then gets no gradient)."""
    last = output.last_hidden_state
    per_item = (last * last).mean(dim=(1, 2))
    if pooled:
        per_item = per_item + output.pooler_output.sum(dim=1)
    return (per_item * weights).sum()


def _slice_plain(output: Any, kind: str, everything: Any, start: int, n: int) -> Any:
    return type(output)(
        last_hidden_state=output.last_hidden_state[start : start + n],
        pooler_output=output.pooler_output[start : start + n],
    )


def _sharded_case(rank: int, counts: list[int | None], *, pooled: bool = True) -> dict[str, Any]:
    """A trainable tower with FSDP units per encoder layer (as ``per_layer`` shards it):
    every rank must run it, a rank with nothing to encode on a placeholder. Gradients
    (averaged by FSDP's reduce-scatter) equal the one-process ones over the world size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    tower, reference = _clip(), _clip()
    mesh = init_device_mesh("cpu", (world,))
    for layer in tower.encoder.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(tower, mesh=mesh)
    per_rank = [_clip_items(counts[r] or 0, seed=200 + r) for r in range(world)]
    weights = [
        torch.arange(1, len(i) + 1, dtype=torch.float32) * (r + 1) for r, i in enumerate(per_rank)
    ]
    runs: list[int] = []
    tower.register_forward_hook(lambda *_: runs.append(1))
    counter = _Collectives()
    with counter:
        if counts[rank] is None:
            loss = join_without_call(tower, run_when_empty=True)
        else:
            args, kwargs = _clip_call(per_rank[rank])
            kwargs.pop("output_hidden_states")
            loss = _plain_loss(
                balanced_call(tower, args, kwargs, run_when_empty=True),
                weights[rank],
                pooled=pooled,
            )
        loss.backward()
    everything = [item for items in per_rank for item in items]
    args, kwargs = _clip_call(everything)
    kwargs.pop("output_hidden_states")
    ref_output = reference(*args, **kwargs)
    ref_loss = sum(
        (
            _plain_loss(
                _slice_plain(
                    ref_output,
                    "clip",
                    everything,
                    sum(len(x) for x in per_rank[:r]),
                    len(per_rank[r]),
                ),
                weights[r],
                pooled=pooled,
            )
            for r in range(world)
            if per_rank[r]
        ),
        start=torch.zeros(()),
    )
    ref_loss.backward()
    diffs = []
    for p, q in zip(tower.parameters(), reference.parameters(), strict=True):
        grad = p.grad.full_tensor() if p.grad is not None else torch.zeros(q.shape)  # type: ignore[attr-defined]
        want = q.grad if q.grad is not None else torch.zeros_like(q)
        diffs.append(float((grad * world - want).abs().max()))
    return {
        "tower_runs": len(runs),
        "param_grad_diff": max(diffs),
        "param_grad_norm": float(
            sum(float(q.grad.norm()) for q in reference.parameters() if q.grad is not None)
        ),
        "ops": counter.ops,
        "params_without_grad": _params_without_grad(tower),
        "reference_params_without_grad": _params_without_grad(reference),
    }


SHARDED_CASES: dict[str, list[int | None]] = {
    "sharded_fewer_than_ranks": [1, None],
    "sharded_three_to_one": [3, 1],
}

#: Sharded towers whose loss does not read the pooled output.
SHARDED_UNREAD_CASES: dict[str, list[int | None]] = {
    "sharded_unread_pooler_fewer_than_ranks": [1, None],
    "sharded_unread_pooler_three_to_one": [3, 1],
}


class _ToyVLM(nn.Module):
    """A tower whose pooled features join the text embeddings before FSDP-sharded decoder
    layers (reduce-scatters in backward): a text-only rank joins where the tower would
    run and adds the zero anchor to its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = _clip()
        torch.manual_seed(1)
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.head = nn.Linear(32, 50)

    def forward(self, ids: Tensor, pixels: Tensor | None, balanced: bool | str) -> Tensor:
        x = self.embed(ids)
        anchor = torch.zeros(())
        if balanced == "per_image":  # one call per image, then every rank at the barrier
            for image in pixels if pixels is not None else []:
                out = balanced_call(
                    self.vision_tower, (image[None],), {"return_dict": True}, run_when_empty=True
                )
                x = x + out.pooler_output.sum(0)
            anchor, self.joined = join_remaining_calls(self.vision_tower, run_when_empty=True)
            x = x + anchor
            anchor = torch.zeros(())
        elif balanced and pixels is None:
            anchor = join_without_call(self.vision_tower, run_when_empty=True)
        elif balanced:
            out = balanced_call(
                self.vision_tower, (pixels,), {"return_dict": True}, run_when_empty=True
            )
            x = x + out.pooler_output.sum(0)
        elif pixels is not None:
            x = x + self.vision_tower(pixels, return_dict=True).pooler_output.sum(0)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        loss: Tensor = nn.functional.cross_entropy(self.head(x), ids) + anchor
        return loss


def _vlm_case(rank: int, tower_units: bool, mode: bool | str = True) -> dict[str, Any]:
    """Rank 1 text-only; every decoder layer its own unit; the tower in the root unit or
    with a unit per encoder layer. Gradients (FSDP averages) equal one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    torch.manual_seed(0)
    model, reference = _ToyVLM(), _ToyVLM()
    mesh = init_device_mesh("cpu", (world,))
    if tower_units:
        for layer in model.vision_tower.encoder.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    generator = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 50, (6,), generator=generator) for _ in range(world)]
    pixels: list[Tensor | None] = [torch.randn(3, 3, 16, 16, generator=generator)]
    pixels += [None] * (world - 1)
    model(ids[rank], pixels[rank], mode).backward()
    sum((reference(ids[r], pixels[r], False) for r in range(world)), torch.zeros(())).backward()
    diffs = [
        float((p.grad.full_tensor() * world - q.grad).abs().max())  # type: ignore[attr-defined,union-attr,operator]
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        if q.grad is not None
    ]
    return {
        "param_grad_diff": max(diffs),
        "params_with_grad": len(diffs),
        "joined": getattr(model, "joined", None),
    }


def run_sharded_cases(rank: int, world_size: int, out_dir: str) -> None:
    results: dict[str, Any] = {
        name: _sharded_case(rank, counts) for name, counts in SHARDED_CASES.items()
    }
    for name, counts in SHARDED_UNREAD_CASES.items():
        results[name] = _sharded_case(rank, counts, pooled=False)
    results["vlm_text_only_rank_tower_in_root"] = _vlm_case(rank, tower_units=False)
    results["vlm_text_only_rank_tower_units"] = _vlm_case(rank, tower_units=True)
    results["vlm_call_per_image_and_barrier"] = _vlm_case(rank, tower_units=True, mode="per_image")
    Path(out_dir, f"sharded{rank}.json").write_text(json.dumps(results))


class _DetachedFeaturesVLM(nn.Module):
    """A trainable tower whose features reach the loss detached: no gradient reaches any
    of its outputs on any rank (one process leaves the tower without gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = _clip()
        torch.manual_seed(1)
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, 50)

    def forward(self, ids: Tensor, pixels: Tensor | None) -> Tensor:
        x = self.embed(ids)
        if pixels is not None:
            features = self.vision_tower(pixels, return_dict=True).pooler_output
            x = x + features.detach().sum(0)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        loss: Tensor = nn.functional.cross_entropy(self.head(x), ids)
        return loss


def run_all_cases(rank: int, world_size: int, out_dir: str) -> None:
    """``run_cases`` then ``run_sharded_cases`` in one spawn of the ranks."""
    run_cases(rank, world_size, out_dir)
    run_sharded_cases(rank, world_size, out_dir)


def run_unread_everywhere(rank: int, world_size: int, out_dir: str) -> None:
    """Through the ``balance_media`` hook: rank 0 has three images, rank 1 none (it joins
    at the first decoder layer and encodes some of rank 0's). No rank's loss reads a tower
    output, so every rank must run the same backward collectives (or none): the joining
    rank's anchor is in its loss, so the calling rank's exchange must be too."""
    from multimodal_fsdp.runtime.balance_media import BalancedTower, BalanceMedia

    model = _DetachedFeaturesVLM()
    tower = BalancedTower(
        path="vision_tower", layout="batch-first", run_when_empty=False, trainable=True
    )
    hook = BalanceMedia(model, (tower,), "layers.0", dist.group.WORLD)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 50, (6,), generator=generator)
    pixels = torch.randn(3, 3, 16, 16, generator=generator) if rank == 0 else None
    counter = _Collectives()
    with counter:
        loss = model(ids, pixels)
        forward_ops = len(counter.ops)
        loss.backward()
    hook.remove()
    result = {
        "calls": hook.last_calls,
        "joined": hook.last_joined,
        "backward_ops": counter.ops[forward_ops:],
        "tower_params_with_grad": sorted(
            n for n, p in model.vision_tower.named_parameters() if p.grad is not None
        ),
        "decoder_grad_norm": float(model.layers[0].weight.grad.norm()),  # type: ignore[union-attr]
    }
    Path(out_dir, f"unread{rank}.json").write_text(json.dumps(result))

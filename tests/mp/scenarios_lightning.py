"""Lightning on 2 ranks (issue 25): the Trainer's ``ModelParallelStrategy`` with the
library called in ``configure_model()``, and Fabric's ``ModelParallelStrategy(
parallelize_fn=...)`` with a user's loop, both through ``fsdp_core.integrations.
lightning.parallelize_fn``.

Each case of ``framework_cases`` trains for its steps (AdamW, clipping where the case
clips) and reports the losses (mean over ranks), the first step's gradients before
clipping and the final parameters; ``lightning_resume`` trains 2 steps, saves with
``trainer.save_checkpoint``, and a new Trainer resumes with ``fit(ckpt_path=...)`` for
the third. The scenarios run inside the suite's process group (Lightning takes it over:
torchrun's environment, an initialised default group). Without Lightning installed they
report ``skipped``.

``lightning_dp_tp`` (4 ranks, issue 34): ``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=2)``; ``configure_model()`` applies the user's TP
(``tensor_parallel.tensor_parallel_mlps`` on the tiny DeepSeek-V4.1 model's language
MLPs) on ``self.device_mesh["tensor_parallel"]``, then the library on
``self.device_mesh``. Each rank trains its DP coordinate's batches, so the run compares
with ``scenarios_nd``'s reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from framework_cases import FABRIC, LIGHTNING, WORLD, FrameworkCase
from registry import scenario
from scenarios_core import full
from scenarios_loops import _parallelizer
from torch import nn

from fsdp_core import DistributedContext
from fsdp_core.integrations.lightning import data_parallel_mesh, parallelize_fn
from fsdp_core.parallel_dims import ParallelDims
from fsdp_core.runtime import installed_hooks

#: The quiet Trainer options every case uses (no logger, no progress bar, no sanity pass).
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


def _lightning() -> Any:
    try:
        import lightning
    except ImportError:
        return None
    return lightning


class _Batches(torch.utils.data.Dataset[dict[str, Any]]):
    """Item ``i`` is rank ``i % WORLD``'s batch of step ``i // WORLD``."""

    def __init__(self, case: FrameworkCase) -> None:
        self.case = case

    def __len__(self) -> int:
        return self.case.loop.steps * WORLD

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.case.batch(index // WORLD, index % WORLD)


class _StepSampler(torch.utils.data.Sampler[int]):
    """One batch per epoch, rank ``rank``'s of step ``epoch`` (Lightning calls
    ``set_epoch``): every checkpoint is then an end-of-epoch one, which Lightning resumes
    exactly (mid-epoch it restarts a dataloader that is not resumable from its start)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        yield self.epoch * WORLD + self.rank

    def __len__(self) -> int:
        return 1


def _mean(loss: torch.Tensor) -> float:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _module(lightning: Any, case: FrameworkCase, record: dict[str, Any]) -> Any:
    """The LightningModule a user writes: the library in configure_model()."""

    class Module(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = case.loop.build_model()

        def configure_model(self) -> None:
            parallelize_fn(_parallelizer(case.loop))(self.model, self.device_mesh)

        def training_step(self, batch: dict[str, Any], index: int) -> torch.Tensor:
            loss = case.loss(self.model, batch)
            record["losses"].append(_mean(loss))
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            if self.global_step == 0:  # before clipping, which comes after this hook
                record["grads0"] = _grads(self.model)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            return case.loop.optimizer_fn()(trainable)

    return Module()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _trainer(lightning: Any, case: FrameworkCase, steps: int, root: Path) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return lightning.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        max_steps=steps,
        gradient_clip_val=case.max_norm,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        default_root_dir=root,
        **QUIET,
    )


def _loader(case: FrameworkCase) -> torch.utils.data.DataLoader[dict[str, Any]]:
    """The reference's batches, in order (Lightning's own sampler would shuffle them)."""
    sampler = _StepSampler(dist.get_rank())
    return torch.utils.data.DataLoader(_Batches(case), batch_size=None, sampler=sampler)


def run_lightning(case: FrameworkCase, out: Path) -> dict[str, Any]:
    lightning = _lightning()
    if lightning is None:
        return {"skipped": "lightning is not installed"}
    record: dict[str, Any] = {"losses": []}
    root = out / case.name
    steps = case.loop.steps
    if case.name.endswith("_resume"):
        first = _module(lightning, case, record)
        trainer = _trainer(lightning, case, steps - 1, root)
        trainer.fit(first, _loader(case))
        trainer.save_checkpoint(root / "resume.ckpt")
        module = _module(lightning, case, record)
        _trainer(lightning, case, steps, root).fit(
            module, _loader(case), ckpt_path=root / "resume.ckpt"
        )
    else:
        module = _module(lightning, case, record)
        _trainer(lightning, case, steps, root).fit(module, _loader(case))
    record["params"] = {n: full(p) for n, p in module.model.named_parameters()}
    return record


def run_fabric(case: FrameworkCase) -> dict[str, Any]:
    lightning = _lightning()
    if lightning is None:
        return {"skipped": "lightning is not installed"}
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize_fn(_parallelizer(case.loop)),
        data_parallel_size=WORLD,
        tensor_parallel_size=1,
    )
    fabric = lightning.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    model = fabric.setup(case.loop.build_model())
    optimizer = fabric.setup_optimizers(
        case.loop.optimizer_fn()([p for p in model.parameters() if p.requires_grad])
    )
    record: dict[str, Any] = {"losses": []}
    for step in range(case.loop.steps):
        loss = case.loss(model, case.batch(step, fabric.global_rank))
        fabric.backward(loss)
        record["losses"].append(_mean(loss))
        if step == 0:
            record["grads0"] = _grads(model.module)
        if case.max_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=case.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record["params"] = {n: full(p) for n, p in model.module.named_parameters()}
    return record


for _name in LIGHTNING:

    def _run(ctx: DistributedContext, out: Path, _case: str = _name) -> dict[str, Any]:
        return run_lightning(LIGHTNING[_case], out)

    scenario(_name)(_run)

for _name in FABRIC:

    def _run_fabric(ctx: DistributedContext, out: Path, _case: str = _name) -> dict[str, Any]:
        return run_fabric(FABRIC[_case])

    scenario(_name)(_run_fabric)


@scenario("lightning_dp_tp")
def lightning_dp_tp(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """The Trainer on a 2x2 (data_parallel, tensor_parallel) mesh (module docstring)."""
    lightning = _lightning()
    if lightning is None:
        return {"skipped": "lightning is not installed"}
    from lightning.pytorch.strategies import ModelParallelStrategy
    from scenarios_nd import IMAGES, STEPS
    from tensor_parallel import tensor_parallel_mlps
    from vlm import LR, build_vlm, to_device, vlm_batches, vlm_loss

    from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer

    record: dict[str, Any] = {"losses": []}

    class Module(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = build_vlm(dtype=torch.float32, frozen_tower=True)

        def configure_model(self) -> None:
            mesh = self.device_mesh
            tensor_parallel_mlps(self.model, mesh["tensor_parallel"])
            parallelizer = DeepseekV41ModelParallelizer(frozen_multimodal_sharding="per_layer")
            parallelize_fn(parallelizer)(self.model, mesh)
            record["dims"] = ParallelDims.from_mesh(data_parallel_mesh(mesh)).describe()

        def training_step(self, batch: dict[str, Any], index: int) -> torch.Tensor:
            loss = vlm_loss(self.model, batch)  # type: ignore[arg-type]
            record["losses"].append(_mean(loss))  # TP peers hold the same loss: the DP mean
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            if self.global_step == 0:
                record["grads0"] = _grads(self.model)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            return torch.optim.SGD(trainable, lr=LR)

    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=ctx.world_size,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        max_steps=STEPS,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        default_root_dir=out / "lightning_dp_tp",
        **QUIET,
    )
    # The strategy's mesh is (data_parallel, tensor_parallel) row-major: rank // 2 is
    # this rank's data-parallel coordinate.
    dp_rank = ctx.rank // 2
    batches = [
        to_device(per_dp[dp_rank], ctx.device) for per_dp in vlm_batches(STEPS, 2, images=IMAGES)
    ]
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    hooks = installed_hooks(module.model)
    record["params"] = {n: full(p) for n, p in module.model.named_parameters()}
    record["arrival_ranks"] = list(hooks["forward_agreement"].ranks)  # type: ignore[attr-defined]
    record["dp_coordinate"] = module.device_mesh["data_parallel"].get_local_rank()
    record["dp_rank"] = dp_rank
    return record

"""The tiny LLaVA fine-tune that the trainer-integration scenarios run, and its one-process
reference.

A dataset of LLaVA samples (``SEQ`` tokens each; a sample with an image starts with its
16 image tokens), a collator that stacks the rows and concatenates the images, and the
run's settings. With ``train_sampling_strategy="sequential"`` and ``PER_DEVICE`` samples
per micro-batch, accelerate gives rank ``r`` the micro-batches ``r, r + world, ...`` in
order, so optimizer step ``k`` of a 2-rank run with ``ACCUMULATION`` micro-batches reads
samples ``[k * STEP_SAMPLES, (k + 1) * STEP_SAMPLES)``. ``images_on_rank0`` puts images
only in the samples of rank 0's micro-batches (rank 1 is text-only).

:func:`reference_run` is one process on the global batch: the same model built the same
way, every step's samples in one forward (LLaVA's loss is the mean over all label
tokens, which is what Trainer's ``num_items_in_batch`` normalisation gives on any number
of ranks and micro-batches), ``clip_grad_norm_``, AdamW, and Trainer's linear schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hf_vlms import LLAVA_IMAGE_TOKEN, LLAVA_PATCHES, build_llava
from torch import nn

WORLD = 2
PER_DEVICE = 2
ACCUMULATION = 2
STEP_SAMPLES = WORLD * PER_DEVICE * ACCUMULATION
STEPS = 3
SEQ = 24
LR = 1e-3
#: Small enough that the first steps are clipped (the clipping path runs).
MAX_GRAD_NORM = 0.5
TRAINABLE_TOWER = "model.vision_tower"

#: name -> (model, policy, balance_media, training images, trainer, evaluation images)
CASES: dict[str, tuple[str, str, bool, str, str, str]] = {
    "root": ("frozen", "root", False, "all", "trainer", "rank0"),
    "per_layer": ("frozen", "per_layer", False, "all", "trainer", "all"),
    "balance_media": ("frozen", "per_layer", True, "rank0", "trainer", "rank0"),
    "lora": ("lora", "root", False, "all", "trainer", "rank0"),
    "sft": ("frozen", "root", False, "rank0", "sft", "rank0"),
}
#: The scenarios of ``scenarios_trainer`` (all in the 2-rank launch).
SCENARIOS = (
    *(f"trainer_{name}" for name in CASES),
    "trainer_resume",
    "trainer_checkpoint_variants",
    "trainer_unmodified",
    "accelerate_loop",
    "accelerate_fsdp2_plugin",
    "accelerate_exports",
    "accelerate_exports_lora",
)


def _rank_of(index: int) -> int:
    """The rank whose micro-batch holds sample ``index`` (sequential sampling)."""
    return (index // PER_DEVICE) % WORLD


def sample(index: int, *, images: str) -> dict[str, torch.Tensor]:
    """Sample ``index``: ``images`` is ``"all"`` (one image each) or ``"rank0"``."""
    gen = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(4, 131, (SEQ,), generator=gen)
    with_image = images == "all" or (images == "rank0" and _rank_of(index) == 0)
    item = {"input_ids": ids}
    if with_image:
        ids[:LLAVA_PATCHES] = LLAVA_IMAGE_TOKEN
        item["pixel_values"] = torch.randn(1, 3, 32, 32, generator=gen)
    item["labels"] = ids.masked_fill(ids == LLAVA_IMAGE_TOKEN, -100)
    return item


class LlavaSamples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, count: int, *, images: str) -> None:
        self.items = [sample(i, images=images) for i in range(count)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Rows stacked, images concatenated in row order (LLaVA's layout)."""
    ids = torch.stack([torch.as_tensor(x["input_ids"]) for x in items])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.stack([torch.as_tensor(x["labels"]) for x in items]),
    }
    pixels = [torch.as_tensor(x["pixel_values"]) for x in items if "pixel_values" in x]
    if pixels:
        batch["pixel_values"] = torch.cat(pixels)
    return batch


def hf_dataset(count: int, *, images: str) -> Any:
    """The samples as a ``datasets.Dataset`` (what TRL's ``SFTTrainer`` takes)."""
    import datasets

    rows = []
    for i in range(count):
        item = sample(i, images=images)
        row: dict[str, Any] = {k: v.tolist() for k, v in item.items()}
        row.setdefault("pixel_values", [])
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """:func:`collate` for ``datasets`` rows (lists; no image: an empty list)."""
    items = []
    for row in rows:
        item = {k: torch.tensor(v) for k, v in row.items() if k != "pixel_values" or v}
        items.append(item)
    return collate(items)


def tokenizer() -> Any:
    """A word-level tokenizer over LLaVA's 131 ids (SFTTrainer needs a processing class)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<image>": 3, **{f"t{i}": i for i in range(4, 131)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def build_frozen_tower() -> nn.Module:
    model = build_llava()
    model.get_submodule(TRAINABLE_TOWER).requires_grad_(False)
    return model


def build_lora() -> nn.Module:
    from hf_lora import with_lora

    return with_lora(build_llava(), "llava", "decoder")


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "frozen": build_frozen_tower,
    "lora": build_lora,
}


@dataclass
class Reference:
    losses: list[float]
    grads0: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def reference_run(
    build: str, *, images: str, steps: int = STEPS, schedule: str = "linear"
) -> Reference:
    """One process, the global batch of each step, Trainer's optimizer and schedule
    (``"linear"``; ``"constant"`` for a loop without a scheduler)."""
    model = BUILDERS[build]()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    linear = schedule == "linear"
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: max(0.0, (steps - k) / steps) if linear else 1.0
    )
    data = LlavaSamples(steps * STEP_SAMPLES, images=images)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step in range(steps):
        batch = collate([data[i] for i in range(step * STEP_SAMPLES, (step + 1) * STEP_SAMPLES)])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
        if step == 0:
            grads0 = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return Reference(losses, grads0, params)


def training_arguments(output_dir: str, **overrides: Any) -> Any:
    """TrainingArguments of the scenarios (Trainer's defaults otherwise)."""
    from transformers import TrainingArguments

    options: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": PER_DEVICE,
        "per_device_eval_batch_size": PER_DEVICE,
        "gradient_accumulation_steps": ACCUMULATION,
        "max_steps": STEPS,
        "learning_rate": LR,
        "weight_decay": 0.0,
        "max_grad_norm": MAX_GRAD_NORM,
        "optim": "adamw_torch",
        "lr_scheduler_type": "linear",
        "train_sampling_strategy": "sequential",
        "save_strategy": "no",
        "logging_steps": 1,
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
    }
    options.update(overrides)
    return TrainingArguments(**options)


def one_step_from(
    params: dict[str, torch.Tensor], *, images: str, step: int
) -> dict[str, torch.Tensor]:
    """The frozen-tower model holding ``params``, one step (number ``step``, counted from
    0) with a new AdamW and a new linear schedule (its first learning rate): a resume
    whose checkpoint kept only the weights."""
    model = build_frozen_tower()
    with torch.no_grad():
        named = dict(model.named_parameters())
        for name, value in params.items():
            named[name].copy_(value)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    data = LlavaSamples((step + 1) * STEP_SAMPLES, images=images)
    batch = collate([data[i] for i in range(step * STEP_SAMPLES, (step + 1) * STEP_SAMPLES)])
    model(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

"""torchrun job of ``exit_check.py``: a LoRA fine-tune of a tiny transformers LLaVA with
``balance_media=True`` that exports the adapter and the merged model, runs ``generate()``
and saves a DCP checkpoint, then ends the way ``--ending`` says.

Usage: torchrun --nproc-per-node 2 lora_balance_job.py OUT_DIR [--ending destroy|return|exit_rank]

Each step gives the ranks different numbers of images (one rank text-only in some), so
the tower's balanced exchange runs; rank 0 reloads both exports at the end, as the
documentation's examples do.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from fsdp_core import build_mesh, destroy_distributed, exit_rank, init_distributed, save_checkpoint
from fsdp_core.hf import save_pretrained
from multimodal_fsdp import MultimodalParallelizer

IMAGE_TOKEN = 255
PATCHES = 16  # (32 / 8) ** 2 tokens per image


def build() -> LlavaForConditionalGeneration:
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(
        LlavaConfig(
            vision_config=CLIPVisionConfig(**tiny, image_size=32, patch_size=8),
            text_config=LlamaConfig(**tiny, num_key_value_heads=2, vocab_size=256),
            image_token_index=IMAGE_TOKEN,
        )
    )


def batch(images: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (2, 48), generator=gen)
    ids.view(-1)[: PATCHES * images] = IMAGE_TOKEN
    out = {"input_ids": ids, "labels": ids}
    if images:
        out["pixel_values"] = torch.randn(images, 3, 32, 32, generator=gen)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--ending", choices=("destroy", "return", "exit_rank"), default="destroy")
    args = parser.parse_args()

    ctx = init_distributed()
    model = get_peft_model(
        build(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    MultimodalParallelizer(balance_media=True).parallelize(model, mesh=build_mesh())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        images = (step + 2 * ctx.rank) % 3  # uneven: 0/2, 1/0, 2/1 images
        model(**batch(images, seed=10 * step + ctx.rank)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    save_pretrained(model, args.out / "adapter")
    save_pretrained(model, args.out / "merged", merge_adapters=True)
    model.eval()
    prompt = batch(1, seed=100 + ctx.rank)
    with torch.no_grad():
        model.generate(
            input_ids=prompt["input_ids"][:1, :20],
            pixel_values=prompt["pixel_values"],
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
        )
    save_checkpoint(args.out / "checkpoint", model, optimizer, step=3)
    if ctx.is_main:
        merged = LlavaForConditionalGeneration.from_pretrained(args.out / "merged")
        PeftModel.from_pretrained(build(), args.out / "adapter")
        assert merged.config.image_token_index == IMAGE_TOKEN
    if args.ending == "destroy":
        destroy_distributed()
    elif args.ending == "exit_rank":
        exit_rank(0)


if __name__ == "__main__":
    main()

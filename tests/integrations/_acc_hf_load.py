"""Launched by tests/integrations/test_accelerate.py: a tiny Hugging Face Llama saved with
``save_pretrained`` and loaded with ``from_pretrained`` (nothing downloads), trained with blockshard's
``Accelerator``. Under ``accelerate launch`` of a config with ``fsdp_cpu_ram_efficient_loading: true`` rank 0 loads it with
``from_pretrained`` and every other rank builds it on the meta device (what transformers' loading
did under that setting before 5.x; 5.24 reads the weights on every rank and leaves only the keys the
checkpoint lacks on meta), so only rank 0 holds weights: blockshard fills the shards from rank 0 at
``prepare()``. ``clip_grad_norm_`` at 1e9 records the global norms without clipping (an active
clip factor differs by an ulp between one process's norm and the sum of pieces'). Run as ``python`` (no config) it
is the one-process reference (stock Accelerate). Every rank trains on the whole batch.

    accelerate launch --config_file CFG tests/integrations/_acc_hf_load.py --pretrained DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers

import blockshard
from blockshard.integrations.accelerate import Accelerator


def save_tiny_llama(path: str) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=67,
        hidden_size=32,
        intermediate_size=45,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True, help="written by the main process when missing")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int)
    p.add_argument("--resume-at", type=int)
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)

    accelerator = Accelerator()
    if accelerator.is_main_process and not os.path.isdir(args.pretrained):
        save_tiny_llama(args.pretrained)
    accelerator.wait_for_everyone()
    if accelerator.process_index == 0:
        model = transformers.LlamaForCausalLM.from_pretrained(args.pretrained)
    else:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(args.pretrained))
    on_meta = sum(t.device.type == "meta" for t in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    first = 0
    if args.resume_at is not None:
        accelerator.load_state(args.ckpt)
        first = args.resume_at
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 67, (4, 9), generator=g) for _ in range(args.steps)]
    norms = []
    for step, ids in enumerate(batches):
        if step < first:
            continue
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1e9)))
        optimizer.step()
        optimizer.zero_grad()
        if args.save_at is not None and step + 1 == args.save_at:
            accelerator.save_state(args.ckpt)
    state = accelerator.get_state_dict(model)
    info = dict(
        world_size=accelerator.num_processes,
        sharded=blockshard.is_sharded(model),
        params_on_meta_before_prepare=on_meta,
        params=sum(1 for _ in model.parameters()),
        norms=norms,
    )
    with open(f"{args.out}.rank{accelerator.process_index}.json", "w") as f:
        json.dump(info, f)
    if accelerator.is_main_process:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, f"{args.out}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()

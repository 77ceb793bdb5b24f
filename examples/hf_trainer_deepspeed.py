"""The Hugging Face Trainer on DeepSpeed ZeRO with bitsandbytes AdamW8bit and blockshard's hook.

Launch (CPU, 2 gloo ranks; ``--stage 1`` for ZeRO-1, ``--stage 3`` for ZeRO-3)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_trainer_deepspeed.py --stage 2 --out z2.json
    python examples/hf_trainer_deepspeed.py --stage 0 --out single.json   # one process, no DeepSpeed

The script is an ordinary Trainer script plus one line, ``bs_deepspeed.install()``, and a
``"blockshard"`` section in the DeepSpeed config: the Trainer calls ``deepspeed.initialize`` itself,
and the hook aligns ZeRO-1/2's partitions to bitsandbytes' 256-element blocks (under ZeRO-3 it
steps each whole parameter on one owner rank instead). The Trainer's
``optim="adamw_bnb_8bit"`` keeps 32-bit state for ``nn.Embedding`` weights through bitsandbytes'
``GlobalOptimManager``; the hook carries that override onto its per-parameter views. Every rank sees
the whole batch (each batch appears once per rank in a row of the dataset, sampled in order), so
the final parameters equal one process's bitwise.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from _common import write_result  # examples/_common.py: the --out files the tests compare

from blockshard._tiny import text_batches, tiny_llama

STEPS, BATCH, SEQ = 4, 4, 32


def dataset(world_size: int) -> list[dict[str, torch.Tensor]]:
    """Each batch's rows ``world_size`` times in a row: in order, rank r takes every W-th batch."""
    rows = []
    for input_ids, labels in text_batches(STEPS, batch_size=BATCH, seq_len=SEQ):
        for _ in range(world_size):
            rows += [{"input_ids": i, "labels": y} for i, y in zip(input_ids, labels, strict=True)]
    return rows


def deepspeed_config(stage: int, stock: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 0,  # DeepSpeed clips at 1.0 by default; the Trainer below does not clip
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "blockshard": {"semantics": {"*weight": "bnb8bit"}},
    }
    if stock:  # plain DeepSpeed, for a comparison
        del cfg["blockshard"]
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage; 0: no DeepSpeed")
    parser.add_argument("--stock", action="store_true", help="plain DeepSpeed: no blockshard section")
    parser.add_argument("--out", help="write losses and parameters (rank 0) for a comparison")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import Trainer, TrainingArguments

    from blockshard.integrations import deepspeed as bs_deepspeed

    bs_deepspeed.install()  # the one added line: engines whose config has a "blockshard" section get the hook
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    training_args = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "blockshard-hf-trainer"),  # nothing is saved
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-2,
        optim="adamw_bnb_8bit",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        deepspeed=deepspeed_config(args.stage, args.stock) if args.stage else None,
        ddp_backend="gloo" if world_size > 1 else None,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    model = tiny_llama()
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset(world_size))
    trainer.train()
    params = dict(model.named_parameters())
    if args.stage == 3:  # partitioned: gathered on every rank (a collective)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            params = {n: p.detach().clone() for n, p in params.items()}
    if trainer.is_world_process_zero():  # ZeRO-1/2 keep whole parameters on every rank
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        hooked = bs_deepspeed.is_hooked(trainer.model_wrapped)  # False without DeepSpeed (--stage 0)
        print(f"world_size={world_size} hooked={hooked} losses={losses}")
        write_result(args.out, world_size=world_size, losses=losses, params=params, hooked=hooked)
    if torch.distributed.is_initialized():  # gloo can abort a rank that exits with its group alive
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

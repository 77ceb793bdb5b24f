"""The Hugging Face Trainer on DeepSpeed ZeRO with bitsandbytes AdamW8bit and blockshard's hook.

Launch (CPU, 2 gloo ranks; ``--stage 1`` for ZeRO-1, ``--stage 3`` for ZeRO-3)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_trainer_deepspeed.py --stage 2 --out z2.json
    python examples/hf_trainer_deepspeed.py --stage 0 --out single.json   # one process, no DeepSpeed
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_trainer_deepspeed.py --stage 3 --optimizer muon

The script is an ordinary Trainer script plus one line, ``bs_deepspeed.install()``, and a
``"blockshard"`` section in the DeepSpeed config: the Trainer calls ``deepspeed.initialize`` itself,
and the hook aligns ZeRO-1/2's partitions to bitsandbytes' 256-element blocks (under ZeRO-3 it
steps each whole parameter on one owner rank instead). The Trainer's
``optim="adamw_bnb_8bit"`` keeps 32-bit state for ``nn.Embedding`` weights through bitsandbytes'
``GlobalOptimManager``; the hook carries that override onto its per-parameter views. Every rank sees
the whole batch (each batch appears once per rank in a row of the dataset, sampled in order), so
the final parameters equal one process's bitwise.

``--optimizer muon``: torch's ``Muon`` as a custom optimizer, passed the way the Trainer keeps it under
DeepSpeed: ``Trainer(optimizer_cls_and_kwargs=(torch.optim.Muon, {...}))``. (``optimizers=(opt, None)``
is dropped under DeepSpeed: transformers' ``deepspeed_init`` sets ``trainer.optimizer = None`` and calls
``create_optimizer()``, which builds ``args.optim``'s optimizer; overriding ``create_optimizer`` works
too.) The Trainer builds it from the trainable parameters before ``deepspeed.initialize`` (inside
``accelerator.prepare``). A DeepSpeed engine takes one optimizer and torch's ``Muon`` only 2-D
parameters, so Muon trains the decoder layers' projection matrices and the embedding, the norms and
the head stay frozen.

``--from-pretrained DIR``: the model through ``AutoModelForCausalLM.from_pretrained(DIR)`` after
``TrainingArguments(deepspeed=<ZeRO-3 config>)``, the Trainer's own ZeRO-3 flow: built inside
``deepspeed.zero.Init``, every parameter a 1-D placeholder (its shape kept as ``ds_shape``) before the
Trainer sees it. torch's ``Muon`` is then built by ``bs_deepspeed.zero3_optimizer`` (it checks shapes
when built); ``MuonWithAdamW.for_model`` and ``muon_param_groups`` go by ``ds_shape`` themselves.

``--optimizer muon_adamw``: Muon beside AdamW in the one optimizer the engine takes,
``blockshard.optim.MuonWithAdamW`` ([Note: Muon beside AdamW]): ``optimizer_cls_and_kwargs=
(MuonWithAdamW.for_model(model), {"muon": {...}, "adamw": {...}})`` splits the Trainer's param_groups
into Muon's hidden matrices and AdamW's rest (embedding, norms, head), nothing frozen; under ZeRO-3
the hook steps Muon's matrices whole at their owners and AdamW's parameters where they lie.
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


def deepspeed_config(stage: int, stock: bool = False, optimizer: str = "adamw_bnb_8bit") -> dict:
    semantics = "matrix" if optimizer.startswith("muon") else {"*weight": "bnb8bit"}  # ZeRO-1/2's layout
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 0,  # DeepSpeed clips at 1.0 by default; the Trainer below does not clip
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "blockshard": {"semantics": semantics},
    }
    if stock:  # plain DeepSpeed, for a comparison
        del cfg["blockshard"]
    return cfg


class PartitionedMuon(torch.optim.Muon):
    """torch's ``Muon`` built over ``deepspeed.zero.Init``'s 1-D placeholders by ``zero3_optimizer`` (the
    constructor sees each parameter's full shape), for ``optimizer_cls_and_kwargs``, which takes a class."""

    def __new__(cls, params, **kwargs):  # returns torch's Muon itself (so __init__ is not run again)
        from blockshard.integrations import deepspeed as bs_deepspeed

        return bs_deepspeed.zero3_optimizer(lambda ps: torch.optim.Muon(ps, **kwargs), params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage; 0: no DeepSpeed")
    parser.add_argument("--stock", action="store_true", help="plain DeepSpeed: no blockshard section")
    parser.add_argument(
        "--optimizer",
        choices=("adamw_bnb_8bit", "muon", "muon_adamw"),
        default="adamw_bnb_8bit",
        help="muon: torch's Muon on the decoder layers' matrices, the rest frozen; muon_adamw: "
        "blockshard.optim.MuonWithAdamW, Muon on the hidden matrices and AdamW on the rest, nothing frozen",
    )
    parser.add_argument(
        "--from-pretrained",
        metavar="DIR",
        help="load the model with AutoModelForCausalLM.from_pretrained(DIR) (under a ZeRO-3 config: built inside "
        "deepspeed.zero.Init, partitioned at construction) instead of building tiny_llama() directly",
    )
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
        optim="adamw_bnb_8bit",  # with --optimizer muon: replaced by optimizer_cls_and_kwargs below
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        deepspeed=deepspeed_config(args.stage, args.stock, args.optimizer) if args.stage else None,
        ddp_backend="gloo" if world_size > 1 else None,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    if args.from_pretrained:  # after TrainingArguments(deepspeed=<ZeRO-3>): inside zero.Init (1-D placeholders)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.from_pretrained, attn_implementation="eager")  # as tiny_llama
    else:
        model = tiny_llama()
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())  # by zero.Init, before the Trainer
    custom = None
    if args.optimizer == "muon":
        for name, p in model.named_parameters():  # Muon: 2-D matrices only; one optimizer per engine
            p.requires_grad_(name.startswith("model.layers.") and len(getattr(p, "ds_shape", p.shape)) == 2)
        custom = (torch.optim.Muon, {"lr": 0.02})
        if partitioned:  # zero.Init's 1-D placeholders: torch's Muon checks shapes when it is built
            custom = (PartitionedMuon, {"lr": 0.02})
    if args.optimizer == "muon_adamw":  # one optimizer per engine: Muon and AdamW in one, by param_group
        from blockshard.optim import MuonWithAdamW

        custom = (MuonWithAdamW.for_model(model), {"muon": {"lr": 0.02}, "adamw": {"lr": 1e-2}})
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset(world_size), optimizer_cls_and_kwargs=custom
    )
    trainer.train()
    params = dict(model.named_parameters())
    if args.stage == 3:  # partitioned: gathered on every rank (a collective)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            params = {n: p.detach().clone() for n, p in params.items()}
    if trainer.is_world_process_zero():  # ZeRO-1/2 keep whole parameters on every rank
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        hooked = bs_deepspeed.is_hooked(trainer.model_wrapped)  # False without DeepSpeed (--stage 0)
        inner = trainer.optimizer  # accelerate's wrapper around DeepSpeed's around the Trainer's optimizer
        while hasattr(inner, "optimizer"):
            inner = inner.optimizer
        inner = type(inner).__name__
        print(f"world_size={world_size} hooked={hooked} optimizer={inner} losses={losses}")
        write_result(
            args.out,
            world_size=world_size,
            losses=losses,
            params=params,
            hooked=hooked,
            optimizer=inner,
            partitioned_at_construction=partitioned,
        )
    if torch.distributed.is_initialized():  # gloo can abort a rank that exits with its group alive
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

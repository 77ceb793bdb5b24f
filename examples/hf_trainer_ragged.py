"""The Hugging Face ``Trainer`` with blockshard's ragged engine, through the Accelerate plugin.

    blockshard accelerate-config --cpu --semantics bnb8bit --out cfg     # LlamaDecoderLayer groups, 2 processes
    accelerate launch --config_file cfg/accelerate.yaml examples/hf_trainer_ragged.py --runs adamw,bnb
    blockshard accelerate-config --cpu --semantics muon --out muon-cfg
    accelerate launch --config_file muon-cfg/accelerate.yaml examples/hf_trainer_ragged.py --runs muon

The one changed line: ``from blockshard.integrations.accelerate import Trainer`` instead of
transformers' (a subclass that builds blockshard's ``Accelerator``; docs/accelerate.md, "The
Hugging Face Trainer"). Run without a launcher (``python examples/hf_trainer_ragged.py --stock``) it
is the stock Trainer in one process: the reference the tests compare with. Each run (``RUNS``)
trains 3 steps, writes a checkpoint after step 2 and then ``trainer.save_model``. The ``muon`` run
passes the Trainer an optimizer it built itself, ``optimizers=(torch.optim.Muon(...), None)``, over the
hidden matrices (the rest is not trained): the Trainer prepares it with the model, so its cut
matrices are computed at their owners (shard it with ``--semantics muon``; docs/accelerate.md, "Muon").

A tiny Llama built in code (no downloads), an in-memory dataset. Every rank trains on the whole
batch (``RankReplicated`` below), so W processes compute exactly what one process computes
(docs/design.md, "Sharding invariance"); in real training each rank reads its own data as usual.
``--out DIR`` writes what the tests check (DIR/<run>/rank<r>.json, DIR/<run>/final, DIR/<run>/checkpoint-2).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers
from torch.utils.data import Dataset

from blockshard.integrations.accelerate import Trainer  # the one changed line

STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 512


class Tokens(Dataset):
    """``BATCH * STEPS`` random token sequences (labels = inputs: causal LM)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RankReplicated(Dataset):
    """Every rank sees the whole batch: accelerate gives rank r batches r, r + W, ... of a sequential
    sampler, so batch k of the base dataset is repeated W times in a row."""

    def __init__(self, base: Dataset, world_size: int, batch: int) -> None:
        self.base, self.world_size, self.batch = base, world_size, batch

    def __len__(self) -> int:
        return len(self.base) * self.world_size  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        block = self.batch * self.world_size
        return self.base[(i // block) * self.batch + i % self.batch]


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,  # lm_head is the embedding: blockshard cuts it across the ranks
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def local_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def embedding_numel(model: torch.nn.Module) -> int:
    return model.get_input_embeddings().weight.numel()


# name: (optim, max_grad_norm, keep bitsandbytes' embedding override, gradient_accumulation_steps).
# The gradient norm is ~1.9 here: max_grad_norm=10 leaves clipping inactive (the factor clamps to
# 1.0, exact), 1.0 clips.
RUNS = {
    "adamw": ("adamw_torch", 10.0, True, 1),
    "bnb": ("adamw_bnb_8bit", 10.0, True, 1),
    "bnb_no_override": ("adamw_bnb_8bit", 10.0, False, 1),  # a control: the embedding loses its fp32 state
    "adamw_clip": ("adamw_torch", 1.0, True, 1),
    "adamw_accum": ("adamw_torch", 10.0, True, 2),  # the same batches as 2 micro-batches of 2
    "muon": ("adamw_torch", 10.0, True, 1),  # optim ignored: torch's Muon passed in (optimizers=...)
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="adamw,bnb", help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--stock", action="store_true", help="transformers.Trainer (the one-process reference)")
    p.add_argument(
        "--resume-from", help="resume each run from DIR/<run>/checkpoint-2 (written by an earlier --out DIR)"
    )
    p.add_argument(
        "--then-resume",
        default="",
        help="after the runs, train these again resumed from their own checkpoint-2 (into OUT/<run>_resumed)",
    )
    p.add_argument("--out", default="hf_trainer_ragged_out")
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in args.runs.split(","):
        resume = os.path.join(args.resume_from, name, "checkpoint-2") if args.resume_from else None
        train(name, *RUNS[name], stock=args.stock, out=os.path.join(args.out, name), resume=resume)
    for name in filter(None, args.then_resume.split(",")):  # a new Trainer, model and optimizer each
        resume = os.path.join(args.out, name, "checkpoint-2")
        train(name, *RUNS[name], stock=args.stock, out=os.path.join(args.out, f"{name}_resumed"), resume=resume)
    if torch.distributed.is_initialized():  # gloo can abort a rank that exits with its group alive
        torch.distributed.destroy_process_group()


def train(
    name: str,
    optim: str,
    max_grad_norm: float,
    keep_override: bool,
    accumulation: int,
    *,
    stock: bool,
    out: str,
    resume: str | None,
) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    batch = BATCH // accumulation
    training_args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        learning_rate=1e-3,
        weight_decay=0.01,
        max_grad_norm=max_grad_norm,
        optim=optim,
        train_sampling_strategy="sequential",
        save_strategy="steps",  # one checkpoint, after step 2: the full model + blockshard's DCP state
        save_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    if optim.startswith("adamw_bnb"):
        from bitsandbytes.optim import GlobalOptimManager

        GlobalOptimManager.get_instance().initialize()  # a fresh manager per run, as in a new process
    model = tiny_llama()
    total = local_numel(model)
    cls = transformers.Trainer if stock else Trainer
    optimizers: tuple = (None, None)
    if name == "muon":  # built over the unsharded model, as a user does; prepare() shards both
        from blockshard.optim import muon_param_groups

        optimizers = (torch.optim.Muon([muon_param_groups(model)[0]], lr=1e-3, weight_decay=0.01), None)
    trainer = cls(
        model=model,
        args=training_args,
        train_dataset=RankReplicated(Tokens(), world_size, batch),
        optimizers=optimizers,
    )
    if not keep_override:
        trainer.create_optimizer()  # registers the override; the control forgets it
        from bitsandbytes.optim import GlobalOptimManager

        GlobalOptimManager.get_instance().module_weight_config_triple.clear()
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))  # the full model (collective: every rank calls it)
    info = dict(
        run=name,
        rank=trainer.args.process_index,
        world_size=trainer.accelerator.num_processes,
        local_numel=local_numel(trainer.model),
        embedding_numel=embedding_numel(trainer.model),
        total_numel=total,
        losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
        grad_norms=[h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        embedding_state=_embedding_state(trainer),
    )
    with open(os.path.join(out, f"rank{trainer.args.process_index}.json"), "w") as f:
        json.dump(info, f)


def _embedding_state(trainer) -> str:
    """The dtype of the optimizer's first-moment state for the embedding (fp32 override or 8-bit)."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    weight = trainer.model.get_input_embeddings().weight
    state = optimizer.state.get(weight, {})
    moment = state.get("state1", state.get("exp_avg"))
    return "none" if moment is None else str(moment.dtype)


if __name__ == "__main__":
    main()

"""A Hugging Face model partitioned at construction: `accelerate launch` with DeepSpeed ZeRO-3 and `zero3_init_flag`.

    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml examples/accelerate/zero3_init.py --pretrained llama
    python examples/accelerate/zero3_init.py --pretrained llama   # one process (stock Accelerate): the reference

With `zero3_init_flag: true` in the accelerate config (and a ZeRO-3 DeepSpeed config), the
`Accelerator` registers its DeepSpeed config with transformers (`HfDeepSpeedConfig`), so
`from_pretrained` / `from_config` build the model inside `deepspeed.zero.Init`: every parameter is
partitioned as it is created (a 1-D placeholder of 0 elements per rank here, the full shape in
`ds_shape`) and the checkpoint's weights are loaded into the partitions; no rank holds the whole
model. So create the `Accelerator` before the model. blockshard's hook (the config's `"blockshard"`
section, installed by blockshard's `Accelerator`) steps the optimizer on whole units
([Note: ZeRO-3 owner-compute]):

* `--optimizer bnb8bit`: bitsandbytes' AdamW8bit over all parameters (its constructor takes the placeholders);
* `--optimizer muon`: torch's Muon on the decoder layers' matrices, the rest frozen (one optimizer per
  DeepSpeed engine; Muon takes 2-D parameters only). Muon's constructor refuses zero.Init's 1-D
  placeholders, so it is built through `bs_deepspeed.zero3_optimizer` (which passes plain parameters through).

The main process writes a tiny Llama to `--pretrained` with `save_pretrained` when the folder is missing.
Every rank trains on the whole batch, so W processes compute what one process computes.
`--out FILE` writes FILE.rank<r>.json and FILE.pt (the gathered weights), which the tests compare.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers
from accelerate import Accelerator

from blockshard._tiny import text_batches, tiny_llama
from blockshard.integrations import deepspeed as bs_deepspeed
from blockshard.integrations.accelerate import Accelerator  # noqa: F811  the one added line


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True, help="a model folder; written by the main process when missing")
    p.add_argument("--optimizer", choices=("bnb8bit", "muon"), default="bnb8bit")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="write the results here (FILE.rank<r>.json, FILE.pt)")
    args = p.parse_args()
    torch.set_num_threads(1)

    accelerator = Accelerator()  # first: with zero3_init_flag it makes from_pretrained partition at construction
    if accelerator.is_main_process and not os.path.isdir(args.pretrained):
        tiny_llama().save_pretrained(args.pretrained)
    accelerator.wait_for_everyone()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.pretrained)
    params = list(model.parameters())
    built = {  # what each rank holds right after construction
        "numel": sum(q.numel() for q in params),
        "ds_numel": sum(getattr(q, "ds_numel", 0) for q in params),
    }
    if args.optimizer == "muon":
        for name, q in model.named_parameters():  # ds_shape: the full shape of a zero.Init placeholder
            q.requires_grad_(name.startswith("model.layers.") and len(getattr(q, "ds_shape", q.shape)) == 2)
        trained = [q for q in params if q.requires_grad]
        optimizer = bs_deepspeed.zero3_optimizer(lambda ps: torch.optim.Muon(ps, lr=0.02), trained)
    else:
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(params, lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for input_ids, labels in text_batches(args.steps, batch_size=4, seq_len=32):
        loss = model(input_ids=input_ids, labels=labels).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.print(f"losses {losses}")
    state = accelerator.get_state_dict(model)  # ZeRO-3: gathered to the main process (None elsewhere)
    if args.out:
        chain = [optimizer]  # accelerate's wrapper, DeepSpeed's optimizer, the optimizer built above
        while hasattr(chain[-1], "optimizer"):
            chain.append(chain[-1].optimizer)
        info = dict(
            world_size=accelerator.num_processes,
            distributed_type=str(accelerator.distributed_type),
            built=built,
            total_numel=sum(q.numel() for q in tiny_llama().parameters()),
            optimizers=[type(o).__name__ for o in chain],
            hooked=bs_deepspeed.is_hooked(model),
            losses=losses,
        )
        with open(f"{args.out}.rank{accelerator.process_index}.json", "w") as f:
            json.dump(info, f)
        if accelerator.is_main_process:
            torch.save({k: v.detach().cpu() for k, v in state.items()}, f"{args.out}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()

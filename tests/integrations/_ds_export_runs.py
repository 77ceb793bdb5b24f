"""DeepSpeed ZeRO-1/2/3 checkpoints exported to DCP and resumed by ``blockshard.fully_shard``, and DCP
checkpoints of ``blockshard.fully_shard`` imported into DeepSpeed engines ([Note: DeepSpeed to
DCP], [Note: DCP into DeepSpeed] in integrations/deepspeed/_dcp.py), for test_deepspeed_export.py
(top-level functions for spawned ranks; every rank the whole batch)."""

from __future__ import annotations

import _ds_runs as R
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

import blockshard

BEFORE, STEPS = 2, 4


def _sharded() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = R.make_model("adamw")
    for m in (model.fc1, model.fc2, model.fc3):
        blockshard.fully_shard(m)
    blockshard.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=R.LR["adamw"])


def _resume(out: str, *, optimizer_state: bool = True) -> list[torch.Tensor]:
    """blockshard at this world size loads the DCP checkpoint and trains the remaining steps."""
    model, opt = _sharded()
    msd, osd = get_state_dict(model, opt)
    if optimizer_state:
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=out)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:  # the control: the parameters only, a fresh AdamW
        sd = {"model": msd}
        dcp.load(sd, checkpoint_id=out)
        set_model_state_dict(model, sd["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=R.LR["adamw"])
    for x, y in R.batches(STEPS)[BEFORE:]:
        R._loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    full = blockshard.full_state_dict(model)
    return [full[n].clone() for n, _ in model.named_parameters()]


def export_case(rank: int, world: int, stage: int, hooked: bool, ckpt: str, out: str) -> dict:
    """DeepSpeed (stock or with blockshard's hook) trains ``BEFORE`` steps and saves; rank 0 exports
    to DCP; blockshard at this world size resumes and trains the rest."""
    from blockshard.integrations.deepspeed import export_dcp

    _, engine = R._engine(stage, "adamw", hooked, extra={"gradient_clipping": 0})
    R._train(engine, R.batches(STEPS)[:BEFORE], rank, world, False)
    engine.save_checkpoint(ckpt, tag="t")
    dist.barrier()
    summary = export_dcp(ckpt, out, tag="t") if rank == 0 else None
    dist.barrier()
    return {"resumed": _resume(out), "model_only": _resume(out, optimizer_state=False), "summary": summary}


def refused_case(rank: int, world: int, ckpt: str, out: str) -> str:
    """bitsandbytes AdamW8bit under the hook: its 8-bit state is not element-wise: refused by name."""
    from blockshard.integrations.deepspeed import export_dcp
    from blockshard.runtime import CheckpointError

    _, engine = R._engine(2, "bnb", True)
    R._train(engine, R.batches(1), rank, world, False)
    engine.save_checkpoint(ckpt, tag="t")
    dist.barrier()
    message = ""
    if rank == 0:
        try:
            summary = export_dcp(ckpt, out, tag="t")
        except CheckpointError as e:
            message = str(e)
        else:
            message = f"exported {summary}"
    dist.barrier()
    return message


def import_case(rank: int, world: int, stage: int, hooked: bool, out: str) -> dict:
    """blockshard trains ``BEFORE`` steps and saves DCP (torch's ``get_state_dict`` layout); a DeepSpeed
    engine (stock or hooked) imports it and trains the rest; the control imports the model only."""
    from blockshard.integrations.deepspeed import import_dcp

    model, opt = _sharded()
    for x, y in R.batches(STEPS)[:BEFORE]:
        R._loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.barrier()
    result: dict = {}
    for optimizer_state in (True, False):
        ds_model, engine = R._engine(stage, "adamw", hooked, extra={"gradient_clipping": 0})
        import_dcp(engine, out, optimizer_state=optimizer_state)
        R._train(engine, R.batches(STEPS)[BEFORE:], rank, world, False)
        result["resumed" if optimizer_state else "model_only"] = _full(ds_model, stage)
        engine.destroy()
    return result


def _full(model, stage: int) -> list[torch.Tensor]:
    """The parameters whole (ZeRO-3: gathered from the partitions)."""
    if stage != 3:
        return R._params(model)
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


EXPORTS = [(2, False), (2, True), (1, True), (3, False)]  # (ZeRO stage, blockshard's hook)
IMPORTS = [(2, False), (1, False), (2, True), (3, False)]


def all_cases(rank: int, world: int, base: str) -> dict:
    """Every case in one spawn (starting ranks that import DeepSpeed dominates the time), one after
    the other in the same gloo group; rank 0 also returns one process's ``STEPS`` steps. The
    DeepSpeed checkpoints stay under ``base`` (``export-<stage>-<hooked>/ds``) for the test to inspect."""
    R.setup_env(rank, world)
    out: dict = {}
    for stage, hooked in EXPORTS:
        where = f"{base}/export-{stage}-{hooked}"
        out["export", stage, hooked] = export_case(rank, world, stage, hooked, f"{where}/ds", f"{where}/dcp")
    for stage, hooked in IMPORTS:
        out["import", stage, hooked] = import_case(rank, world, stage, hooked, f"{base}/import-{stage}-{hooked}")
    out["refused"] = refused_case(rank, world, f"{base}/refused/ds", f"{base}/refused/dcp")
    if rank == 0:
        out["reference"] = R.reference("adamw", steps=STEPS)
    return out

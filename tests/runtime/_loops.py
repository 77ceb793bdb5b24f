"""Real training-loop scenarios (issue 9): LoRA, freezing, changing requires_grad, frozen layers
under no_grad, bf16 micro-batch accumulation in fp32, structured activations.

Every function takes ``(rank, world, ...)``; ``world == 0`` means one process without sharding
(the reference), anything else the ragged engine on an initialized process group. Every rank
sees the whole batch unless ``split`` is set. Results are full parameters by name.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from blockshard._tiny import OddMLP, mlp_batches, text_batches, tiny_llama

LR = 1e-2
STEPS = 3
BATCH = 4


def _full(model: nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    if sharded:
        import blockshard

        return blockshard.full_state_dict(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _shard_llama(model: nn.Module, world: int, **kw) -> None:
    if world:
        import blockshard

        for layer in model.model.layers:
            blockshard.fully_shard(layer, **kw)
        blockshard.fully_shard(model, **kw)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # empty pieces included: every rank alike
    if name == "bnb8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR)


def _slice(batch: tuple, rank: int, world: int, split: bool) -> tuple:
    return tuple(t[rank::world] for t in batch) if split and world else batch


# -- LoRA (peft) on a tiny Llama, sharded layer by layer ----------------------------------------
def lora(rank: int, world: int, optimizer: str = "adamw", split: bool = False, batch: int = BATCH) -> dict:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # LoRA's A matrices are initialized from the global generator
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    inner = model.base_model.model
    semantics = {"*weight": "bnb8bit"} if optimizer == "bnb8bit" and world else None
    _shard_llama(inner, world, semantics=semantics)
    opt = _optimizer(optimizer, model)
    losses = []
    for ids, labels in text_batches(STEPS, batch, 16):
        ids, labels = _slice((ids, labels), rank, world, split)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"params": _full(model, bool(world)), "losses": losses}


# -- freezing with the ragged engine's OddMLP ----------------------------------------------------
def _mlp(world: int, **kw) -> nn.Module:
    model = OddMLP()
    if world:
        import blockshard

        for block in model.blocks:
            blockshard.fully_shard(block, **kw)
        blockshard.fully_shard(model, **kw)
    return model


def freeze_after_sharding(rank: int, world: int) -> dict:
    """Freeze block 1 and block 0's bias after ``fully_shard`` (on the sharded parameters)."""
    model = _mlp(world)
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    model.blocks[0][0].bias.requires_grad_(False)
    return _train_mlp(model, world)


def requires_grad_changes(rank: int, world: int) -> dict:
    """Step 1 trains everything, step 2 only block 2, step 3 all but block 0."""
    model = _mlp(world)
    plan = [set(), {0, 1}, {0}]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # every parameter, frozen or not
    for step, (x, y) in enumerate(mlp_batches(STEPS, BATCH)):
        for i, block in enumerate(model.blocks):
            for p in block.parameters():
                p.requires_grad_(i not in plan[step])
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"params": _full(model, bool(world))}


class _FrozenFirst(nn.Module):
    """Block 0 frozen and run under no_grad (a frozen feature extractor), blocks 1-2 train."""

    def __init__(self, inner: OddMLP) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.inner.blocks[0](x)
        for block in self.inner.blocks[1:]:
            x = block(x)
        return x


def frozen_under_no_grad(rank: int, world: int) -> dict:
    inner = OddMLP()
    for p in inner.blocks[0].parameters():
        p.requires_grad_(False)
    model = _FrozenFirst(inner)
    if world:
        import blockshard

        for block in inner.blocks:
            blockshard.fully_shard(block)
        blockshard.fully_shard(model)
    return _train_mlp(model, world)


def _train_mlp(model: nn.Module, world: int) -> dict:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for x, y in mlp_batches(STEPS, BATCH):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"params": _full(model, bool(world))}


# -- bf16 compute, fp32 master weights, micro-batches accumulated in fp32 -----------------------
def bf16_accumulation(rank: int, world: int, micro: int = 3) -> dict:
    """Sharded: ``param_dtype=bf16, reduce_dtype=fp32``, sync on the last micro-batch only.
    Reference: bf16 compute on a copy, each micro-batch gradient cast to fp32 and summed in fp32
    (what FSDP2 does)."""
    model = tiny_llama()
    batches = text_batches(STEPS * micro, BATCH, 16)
    if world:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        _shard_llama(model, world, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(STEPS):
            for m in range(micro):
                model.set_requires_gradient_sync(m == micro - 1)
                ids, labels = batches[step * micro + m]
                model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
        return {"params": _full(model, True)}
    low = copy.deepcopy(model)
    for p in low.parameters():
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        with torch.no_grad():
            for p16, p32 in zip(low.parameters(), model.parameters(), strict=True):
                p16.copy_(p32)
        acc: dict[int, torch.Tensor] = {}
        for m in range(micro):
            ids, labels = batches[step * micro + m]
            low(input_ids=ids, labels=labels).loss.backward()
            for i, p16 in enumerate(low.parameters()):
                if p16.grad is not None:
                    acc[i] = p16.grad.float() if i not in acc else acc[i].add_(p16.grad)
                    p16.grad = None
        for i, p32 in enumerate(model.parameters()):
            p32.grad = acc.get(i)
        opt.step()
        opt.zero_grad()
    return {"params": _full(model, False)}


# -- activations in a dataclass between sharded modules ------------------------------------------
@dataclass
class Hidden:
    states: torch.Tensor
    scale: float = 1.0


class _Encode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(13, 29)

    def forward(self, x: torch.Tensor) -> Hidden:
        return Hidden(torch.tanh(self.lin(x)), 0.5)


class _Decode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(29, 7)

    def forward(self, h: Hidden) -> torch.Tensor:
        return self.lin(h.states * h.scale)


class DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.enc, self.mid, self.dec = _Encode(), nn.Linear(29, 29), _Decode()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        return self.dec(Hidden(self.mid(h.states), h.scale))


def dataclass_activations(rank: int, world: int) -> dict:
    model = DataclassNet()
    if world:
        import blockshard

        for m in (model.enc, model.mid, model.dec):
            blockshard.fully_shard(m)
        blockshard.fully_shard(model)
    return _train_mlp(model, world)


def run(rank: int, world: int, name: str, kwargs: dict, sharded: bool) -> dict:
    """``name(rank, world, **kwargs)`` sharded on the process group, or as the reference."""
    fn = globals()[name]
    return fn(rank, world if sharded else 0, **kwargs)

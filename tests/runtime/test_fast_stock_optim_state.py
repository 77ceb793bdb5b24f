"""``blockshard.stock_adamw_state_dict`` on real optimizers' state dicts (one process; the spawned
stock FSDP2 loads are in test_checkpoints_across_engines.py): bitsandbytes' 8-bit and 32-bit state
becomes torch AdamW's exactly, state AdamW cannot hold raises naming the parameter and the key."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import blockshard
from blockshard.runtime import CheckpointError

FULL = StateDictOptions(full_state_dict=True)


def _stepped(make, options: StateDictOptions = FULL) -> tuple[nn.Module, dict]:
    """A 40 x 256 weight (8-bit state under bitsandbytes) and a 40-element bias, one step."""
    torch.manual_seed(0)
    m = nn.Linear(256, 40)
    o = make(m)
    (m(torch.randn(4, 256)) ** 2).mean().backward()
    o.step()
    return m, get_optimizer_state_dict(m, o, options=options)


def _refusal(osd: dict) -> str:
    with pytest.raises(CheckpointError) as info:
        blockshard.stock_adamw_state_dict(osd)
    assert isinstance(info.value, ValueError) and "Fix:" in str(info.value)
    return str(info.value)


def test_bnb_8bit_and_32bit_state_become_adamw_state_exactly():
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    _, osd = _stepped(lambda m: bnb.optim.AdamW8bit(m.parameters(), lr=1e-2))
    out = blockshard.stock_adamw_state_dict(osd)
    w, b = (
        osd["state"]["weight"]["__bnb_optimizer_quant_state__"],
        osd["state"]["bias"]["__bnb_optimizer_quant_state__"],
    )
    assert w["state1"].dtype == torch.uint8 and b["state1"].dtype == torch.float32  # 8-bit and 32-bit state
    for code, key in (("1", "exp_avg"), ("2", "exp_avg_sq")):
        want = F.dequantize_blockwise(
            w[f"state{code}"], absmax=w[f"absmax{code}"], code=w[f"qmap{code}"], blocksize=256
        )
        assert torch.equal(out["state"]["weight"][key], want)  # bitsandbytes' own dequantization, bitwise
        assert torch.equal(out["state"]["bias"][key], b[f"state{code}"])
    assert set(out["state"]["weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    assert torch.equal(out["state"]["weight"]["step"], torch.tensor(1.0))
    adamw = torch.optim.AdamW([torch.zeros(1)]).state_dict()["param_groups"][0]
    assert out["param_groups"][0].keys() == adamw.keys()  # what a stock AdamW loader asks dcp.load for
    assert out["param_groups"][0]["params"] == ["weight", "bias"]
    assert out["param_groups"][0]["lr"] == 1e-2


def test_adamw_state_passes_as_it_is():
    _, osd = _stepped(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    out = blockshard.stock_adamw_state_dict(osd)
    assert all(out["state"]["weight"][k] is osd["state"]["weight"][k] for k in ("exp_avg", "exp_avg_sq", "step"))


def test_muon_momentum_raises_naming_the_parameter_and_key():
    _, osd = _stepped(lambda m: torch.optim.Muon([m.weight], lr=1e-2))
    msg = _refusal(osd)
    assert "['momentum_buffer']" in msg and "'weight'" in msg and "blockshard.fully_shard" in msg


def test_shampoo_tiles_raise():
    from blockshard.optim import BlockedShampoo

    # (not full_state_dict: torch's gather refuses the torch.dtype BlockedShampoo's param_groups hold)
    _, osd = _stepped(lambda m: BlockedShampoo(m.parameters(), lr=1e-2, max_preconditioner_dim=32), StateDictOptions())
    msg = _refusal(osd)
    assert "'weight'" in msg and "BlockedShampoo" in msg


def test_a_one_state_bnb_optimizer_raises():
    import bitsandbytes as bnb

    _, osd = _stepped(lambda m: bnb.optim.Lion8bit(m.parameters(), lr=1e-3))
    msg = _refusal(osd)
    assert "no 'state2'" in msg and "Lion8bit" in msg


def test_torchao_quantized_state_raises():
    from torchao.optim.subclass_8bit import OptimState8bit

    state = {"step": torch.tensor(1.0), "exp_avg": OptimState8bit.zeros((40, 256), signed=True, block_size=256)}
    state["exp_avg_sq"] = OptimState8bit.zeros((40, 256), signed=False, block_size=256)
    msg = _refusal({"state": {"weight": state}, "param_groups": [{"lr": 1e-3, "params": ["weight"]}]})
    assert "OptimState8bit" in msg and "'exp_avg'" in msg


def test_bnb_hyperparameters_adamw_does_not_run_raise():
    import bitsandbytes as bnb

    _, osd = _stepped(lambda m: bnb.optim.AdamW8bit(m.parameters(), lr=1e-2))
    osd["param_groups"][0]["alpha"] = 5.0  # AdEMAMix's mixing weight, as its param_groups hold it
    assert "'alpha': 5.0" in _refusal(osd)


def test_a_flattened_state_dict_raises():
    _, osd = _stepped(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    msg = _refusal({"state.weight.exp_avg": osd["state"]["weight"]["exp_avg"]})
    assert "flatten_optimizer_state_dict" in msg

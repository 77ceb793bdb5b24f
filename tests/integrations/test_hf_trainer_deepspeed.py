"""The Hugging Face Trainer on DeepSpeed ZeRO-1/2/3 with blockshard's ``install()`` and ``optim="adamw_bnb_8bit"``.

Runs ``examples/hf_trainer_deepspeed.py`` through the real launchers (``torchrun`` for ZeRO-1 and ZeRO-3
(owner-compute on whole units), ``deepspeed`` for ZeRO-2) with 2 CPU ranks (gloo, ``DS_ACCELERATOR=cpu``), every rank the whole batch, and compares the
final parameters with the same Trainer script on one process without DeepSpeed (``--stage 0``: the same
tiny Llama, data order, learning-rate schedule, AdamW8bit with the Trainer's 32-bit override for
``nn.Embedding``, no clipping on either side). Expected: **bitwise** equal (gradient averaging of identical
gradients is exact at W = 2; docs/design.md, "Sharding invariance").

Control: the same ZeRO-2 run with the hook's ``GlobalOptimManager`` follow-up switched off
(``_hf_trainer_control.py``): the embedding's 32-bit override stays on the parameter, its views get 8-bit
state, and the parameters differ (measured 3.4e-3 on ``embed_tokens.weight`` after 4 steps at lr 1e-2).

ZeRO-3 (``--stage 3``, owner-compute) with ``optim="adamw_bnb_8bit"`` and with torch's ``Muon`` as a custom
optimizer (``--optimizer muon``: ``Trainer(optimizer_cls_and_kwargs=(torch.optim.Muon, ...))`` on the decoder
layers' matrices, the rest frozen) equal the same Trainer under ZeRO-3 on one rank **bitwise**. Controls: stock
ZeRO-3 + AdamW8bit at W = 2 differs; stock ZeRO-3 hands torch's Muon a flat 1-D partition, which it refuses
(fast test below; the launched stock Trainer raises the same ``ValueError``, as does the stock ZeRO-3 case of
test_deepspeed.py).

The fast tests check :mod:`blockshard.integrations.deepspeed._bnb_overrides` on bitsandbytes directly.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
import torch
from _background import Jobs, free_ports

from blockshard.tiny import tiny_llama

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer_deepspeed.py"
CONTROL = ROOT / "tests" / "integrations" / "_hf_trainer_control.py"
DS_ORDER = ROOT / "tests" / "integrations" / "_hf_trainer_ds_order.py"
CONTROL_MIN = 1e-4
ZERO3_VS_PLAIN_ATOL = 1e-3
ZERO3_CONTROL_MIN = 1e-3
BIN = pathlib.Path(sys.executable).parent


# -- the override follows the parameter (fast, bitsandbytes only) --------------------------------------
def test_overrides_follow_the_parameter_onto_views():
    bnb = pytest.importorskip("bitsandbytes")
    from blockshard.integrations.deepspeed._bnb_overrides import follow_overrides, resolve_module_overrides

    emb, lin = torch.nn.Embedding(70, 80), torch.nn.Linear(80, 90)
    params = [lin.weight, emb.weight]
    flat = torch.zeros(sum(p.numel() for p in params))
    views = [flat[: lin.weight.numel()].view(90, 80), flat[lin.weight.numel() :].view(70, 80)]
    mng = bnb.optim.GlobalOptimManager.get_instance()
    saved = (dict(mng.pid2config), dict(mng.index2config), list(mng.module_weight_config_triple))
    mng.register_module_override(emb, "weight", {"optim_bits": 32})
    stale = {"optim_bits": 32, "lr": 9.0}
    mng.index2config[(0, 0)] = stale  # another optimizer's position 0: must not reach view 0
    try:
        opt = bnb.optim.AdamW8bit(views, lr=1e-3)
        group = opt.param_groups[0]
        resolve_module_overrides(opt, params)
        assert mng.pid2config[id(emb.weight)] == {"optim_bits": 32}
        with follow_overrides(opt, params, [(views[0], 0), (views[1], 1)]):
            assert opt.get_config(0, 0, group)["optim_bits"] == 8
            assert opt.get_config(0, 1, group)["optim_bits"] == 32
        assert mng.index2config[(0, 0)] is stale and (0, 1) not in mng.index2config  # restored
        mng.override_config(emb.weight, "lr", 5e-4)  # a later override on the parameter reaches its view
        with follow_overrides(opt, params, [(views[0], 0), (views[1], 1)]):
            assert opt.get_config(0, 1, group)["lr"] == 5e-4
        assert opt.get_config(0, 0, group)["lr"] == 9.0  # outside: the table is as it was
    finally:  # the manager is process-wide
        mng.pid2config, mng.index2config, mng.module_weight_config_triple = saved


def test_other_optimizers_are_untouched():
    from blockshard.integrations.deepspeed._bnb_overrides import follow_overrides, resolve_module_overrides

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p])
    resolve_module_overrides(opt, [p])
    with follow_overrides(opt, [p], [(p, 0)]):
        pass


# -- real launchers (slow) ---------------------------------------------------------------------------
def _env() -> dict:
    return dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        BLOCKSHARD_LOG="info",  # the engage line ([Note: engage line])
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )


def _torchrun(port: int, nproc: int = 2) -> list[str]:
    return [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]


def _deepspeed(port: int) -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every run of this file (they are independent): the Trainer on one process
    without DeepSpeed (``--stage 0``), ZeRO-1 under ``torchrun``, ZeRO-2 under ``deepspeed``, ZeRO-3 (AdamW8bit
    and Muon, each at W = 2 and on one rank; stock AdamW8bit at W = 2) and the control, run 3 at a
    time in this order. ``launched[name]()`` waits for one and returns its (JSON, parameters)."""
    tmp = tmp_path_factory.mktemp("hf_ds")
    ports = free_ports(10)
    muon, both = ["--optimizer", "muon"], ["--optimizer", "muon_adamw"]
    tiny_llama().save_pretrained(tmp / "pretrained")  # the model the other runs build directly
    pretrained = ["--from-pretrained", str(tmp / "pretrained")]  # under ZeRO-3: built inside zero.Init
    jobs: dict[str, tuple[list[str], pathlib.Path, int, list[str]]] = {
        "single": ([sys.executable], EXAMPLE, 0, []),
        "zero1-torchrun": (_torchrun(ports[0]), EXAMPLE, 1, []),
        "zero2-deepspeed": (_deepspeed(ports[1]), EXAMPLE, 2, []),
        "zero3-torchrun": (_torchrun(ports[3]), EXAMPLE, 3, []),
        "zero3-one-rank": (_torchrun(ports[4], 1), EXAMPLE, 3, []),
        "zero3-stock": (_torchrun(ports[5]), EXAMPLE, 3, ["--stock"]),  # no blockshard section
        "zero3-muon": (_torchrun(ports[6]), EXAMPLE, 3, muon),
        "zero3-muon-one-rank": (_torchrun(ports[7], 1), EXAMPLE, 3, muon),
        "control": (_torchrun(ports[2]), CONTROL, 2, []),
        "single-ds-order": ([sys.executable], DS_ORDER, 0, []),  # one process, ZeRO-3's summation order
        "zero3-muon-adamw": (_torchrun(ports[8]), EXAMPLE, 3, both),
        "single-ds-order-muon-adamw": ([sys.executable], DS_ORDER, 0, both),
        "single-muon-adamw": ([sys.executable], EXAMPLE, 0, both),
        "zero3-muon-adamw-from-pretrained": (_torchrun(ports[9]), EXAMPLE, 3, [*both, *pretrained]),
    }
    started = Jobs(running=3)  # 3 launches at a time (of up to 2 ranks each) beside the other worker's tests
    for name, (launch, script, stage, extra) in jobs.items():
        cmd = [*launch, str(script), "--stage", str(stage), *extra, "--out", str(tmp / f"{name}.json")]
        started.add(name, cmd, tmp / f"{name}.log", env=_env(), cwd=ROOT)

    def result(name: str) -> tuple[dict, dict]:
        started.wait(name)
        out = tmp / f"{name}.json"
        return json.loads(out.read_text()), torch.load(f"{out}.pt")

    result.log = lambda name: (tmp / f"{name}.log").read_text()  # type: ignore[attr-defined]
    yield result
    started.kill()


def _max_diff(a: dict, b: dict) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero1-torchrun", "zero2-deepspeed"])
def test_trainer_zero_equals_one_process_bitwise(launched, run):
    info, params = launched(run)
    ref_info, ref = launched("single")
    assert info["world_size"] == 2 and info["hooked"] and not ref_info["hooked"]
    engaged = [x for x in launched.log(run).splitlines() if "blockshard engaged (the DeepSpeed hook)" in x]
    assert len(engaged) == 1 and f"engine DeepSpeed ZeRO-{run[4]}" in engaged[0], engaged
    assert "blockshard engaged" not in launched.log("single")  # stage 0 on one process: not hooked
    assert _max_diff(params, ref) == {}
    assert info["losses"] == ref_info["losses"]


@pytest.mark.slow
def test_control_without_following_overrides_differs(launched):
    info, params = launched("control")
    _, ref = launched("single")
    diff = _max_diff(params, ref)
    assert info["hooked"] and diff.get("model.embed_tokens.weight", 0.0) > CONTROL_MIN, diff


@pytest.mark.slow
def test_trainer_zero3_equals_zero3_on_one_rank_bitwise_and_one_process_within_tolerance(launched):
    """ZeRO-3 with the hook (owner-compute: bitsandbytes steps whole parameters, the embedding's 32-bit
    override followed) at W = 2 equals the same Trainer under ZeRO-3 on one rank bitwise. DeepSpeed
    ZeRO-3's own backward is not bitwise plain torch's: its identity autograd Function on every module's
    inputs (``PostBackwardFunctionModule``) changes the order autograd sums a residual stream's gradient
    in (at an RMSNorm's input ``(pow + product) + residual``, plain torch ``(residual + product) + pow``),
    so against the Trainer without DeepSpeed the parameters differ by ``ZERO3_VS_PLAIN_ATOL`` at most
    (measured 1.7e-4 after 4 steps; the Trainer with that identity Function equals ZeRO-3 bitwise)."""
    info, params = launched("zero3-torchrun")
    one_info, one = launched("zero3-one-rank")
    _, plain = launched("single")
    assert info["world_size"] == 2 and one_info["world_size"] == 1 and info["hooked"] and one_info["hooked"]
    engaged = [x for x in launched.log("zero3-torchrun").splitlines() if "blockshard engaged (the DeepSpeed hook)" in x]
    assert len(engaged) == 1 and "engine DeepSpeed ZeRO-3" in engaged[0] and "policy owner" in engaged[0], engaged
    assert _max_diff(params, one) == {}
    assert info["losses"] == one_info["losses"]
    assert max(_max_diff(params, plain).values(), default=0.0) < ZERO3_VS_PLAIN_ATOL


@pytest.mark.slow
def test_trainer_zero3_muon_beside_adamw_equals_one_process_bitwise(launched):
    """``blockshard.optim.MuonWithAdamW`` through ``optimizer_cls_and_kwargs`` (Muon on the hidden matrices,
    AdamW on the embedding, norms and head, nothing frozen; [Note: Muon beside AdamW]): the Trainer under
    ZeRO-3 with the hook at W = 2 equals the Trainer without DeepSpeed with ZeRO-3's summation order
    (``_hf_trainer_ds_order.py``) bitwise, losses included; every parameter trained. Against the plain
    Trainer it differs by that order alone (the control: measured 2.5e-3 after 4 steps, Muon's bfloat16
    Newton-Schulz amplifying the last-bit gradient differences)."""
    info, params = launched("zero3-muon-adamw")
    ordered_info, ordered = launched("single-ds-order-muon-adamw")
    _, plain = launched("single-muon-adamw")
    assert info["hooked"] and info["optimizer"] == "MuonWithAdamW" == ordered_info["optimizer"]
    engaged = [x for x in launched.log("zero3-muon-adamw").splitlines() if "blockshard engaged" in x]
    assert len(engaged) == 1 and "policy owner" in engaged[0], engaged
    assert _max_diff(params, ordered) == {}
    assert info["losses"] == ordered_info["losses"]
    initial = dict(tiny_llama().named_parameters())  # the example's model before training
    assert [n for n in params if torch.equal(params[n], initial[n])] == []  # every parameter trained
    assert max(_max_diff(params, plain).values(), default=0.0) > 0  # control (measured 2.5e-3: bf16 Newton-Schulz)


@pytest.mark.slow
def test_trainer_zero3_from_pretrained_under_zero_init_equals_the_model_built_directly_bitwise(launched):
    """The Trainer's own ZeRO-3 flow: ``from_pretrained`` after ``TrainingArguments(deepspeed=<ZeRO-3>)``
    builds the model inside ``deepspeed.zero.Init`` (every parameter a 1-D placeholder before the
    Trainer sees it). With ``MuonWithAdamW.for_model(model)`` (which chooses Muon's matrices by their
    ``ds_shape``; by the placeholders' 1-D shapes it would give them all to AdamW, silently), W = 2
    equals the same checkpoint's model built directly under ZeRO-3 **bitwise**, losses included, and
    so the one-process reference of the test above. (``optim="adamw_bnb_8bit"`` and torch's ``Muon``
    built by ``zero3_optimizer`` run this flow too, ``examples/hf_trainer_deepspeed.py
    --from-pretrained``; AdamW8bit under ``zero.Init`` is tested through Accelerate's ``zero3_init_flag``.)"""
    run, built, one = "zero3-muon-adamw-from-pretrained", "zero3-muon-adamw", "single-ds-order-muon-adamw"
    info, params = launched(run)
    built_info, direct = launched(built)
    _, ref = launched(one)
    assert info["partitioned_at_construction"] and not built_info["partitioned_at_construction"]
    assert info["hooked"] and info["optimizer"] == built_info["optimizer"]
    engaged = [x for x in launched.log(run).splitlines() if "blockshard engaged (the DeepSpeed hook)" in x]
    assert len(engaged) == 1 and "policy owner" in engaged[0], engaged
    assert _max_diff(params, direct) == {}
    assert info["losses"] == built_info["losses"]
    assert _max_diff(params, ref) == {}


@pytest.mark.slow
def test_trainer_zero3_equals_the_plain_trainer_with_zero3s_summation_order_bitwise(launched):
    """What ZeRO-3 changes is the order autograd sums gradients in, and nothing else: the Trainer without
    DeepSpeed, with an identity autograd Function on every module's inputs as ZeRO-3's module hooks apply
    (``_hf_trainer_ds_order.py``), equals ZeRO-3 with the hook at W = 2 bitwise, losses included. (The
    test above is the control: without that Function the plain Trainer differs.)"""
    info, params = launched("zero3-torchrun")
    ordered_info, ordered = launched("single-ds-order")
    _, plain = launched("single")
    assert not ordered_info["hooked"] and ordered_info["world_size"] == 1
    assert _max_diff(params, ordered) == {}
    assert info["losses"] == ordered_info["losses"]
    assert _max_diff(ordered, plain) != {}  # the summation order is what differs from the plain Trainer


@pytest.mark.slow
def test_control_stock_zero3_depends_on_the_world_size(launched):
    """Stock ZeRO-3 + AdamW8bit quantizes DeepSpeed's flat partitions: at W = 2 it differs from the
    hooked one-rank run (which steps whole parameters) by more than the hook's drift above (measured
    1.2e-2 after 4 steps)."""
    info, params = launched("zero3-stock")
    _, one = launched("zero3-one-rank")
    assert not info["hooked"]
    assert max(_max_diff(params, one).values(), default=0.0) > ZERO3_CONTROL_MIN


@pytest.mark.slow
def test_trainer_zero3_muon_custom_optimizer_equals_zero3_on_one_rank_bitwise(launched):
    """torch's ``Muon`` through ``Trainer(optimizer_cls_and_kwargs=...)`` under ZeRO-3 with ``install()``:
    owner-compute steps each whole matrix on one rank (``"matrix"`` semantics, read from the optimizer),
    so W = 2 equals one rank **bitwise**; the Muon matrices moved and the frozen parameters did not."""
    info, params = launched("zero3-muon")
    one_info, one = launched("zero3-muon-one-rank")
    assert info["world_size"] == 2 and one_info["world_size"] == 1 and info["hooked"] and one_info["hooked"]
    assert info["optimizer"] == one_info["optimizer"] == "Muon"
    engaged = [x for x in launched.log("zero3-muon").splitlines() if "blockshard engaged (the DeepSpeed hook)" in x]
    assert len(engaged) == 1 and "ZeRO-3, semantics matrix, policy owner" in engaged[0], engaged
    assert _max_diff(params, one) == {}
    assert info["losses"] == one_info["losses"]
    from blockshard._tiny import tiny_llama

    init = dict(tiny_llama().named_parameters())
    moved = {n for n in params if not torch.equal(params[n], init[n])}
    assert moved == {n for n, p in init.items() if n.startswith("model.layers.") and p.dim() == 2}, moved


def test_control_muon_refuses_stock_zero3s_flat_partition():
    """What stock ZeRO-3's optimizer step hands the inner optimizer: one flat 1-D fp32 partition per
    sub-group (``fp32_partitioned_groups_flat``). torch's Muon refuses it at its first step, the error the
    launched stock Trainer (``--stage 3 --optimizer muon --stock``) raises."""
    flat = torch.zeros(2 * 48 * 48, requires_grad=True)
    opt = torch.optim.Muon([torch.zeros(48, 48, requires_grad=True)], lr=0.02)
    opt.param_groups[0]["params"] = [flat]  # what DeepSpeed does to the param_groups
    flat.grad = torch.ones_like(flat)
    with pytest.raises(ValueError, match="Param gradient must be a 2D matrix"):
        opt.step()

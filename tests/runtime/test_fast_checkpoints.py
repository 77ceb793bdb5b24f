"""Checkpoints in-process (issue 11): the boxes of a flat run, PieceTensor, model.state_dict() /
load_state_dict(), DCP round trips at W = 1 and W = 2 (threads, see _inproc.py), tied names in
full_state_dict, Hugging Face save_pretrained, ``blockshard inspect CHECKPOINT``.
Tolerance: bitwise (every check here is a copy). Controls: fresh models differ from the saved
state; the dict without the tied name fails a strict load; save_pretrained without full tensors
writes no weights."""

from __future__ import annotations

import copy
import io
import itertools
import math
import os

import _inproc
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import blockshard
from blockshard._tiny import OddMLP, mlp_batches
from blockshard.cli import main
from blockshard.runtime import PieceTensor, PieceTensorError, ShardingError, describe_checkpoint
from blockshard.runtime.checkpoint._piece_tensor import flat_run_boxes

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


# -- boxes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 5), (2, 3, 2, 3), (9,), ()])
def test_every_flat_run_is_tiled_by_at_most_2ndim_minus_1_boxes_in_order(shape):
    n = math.prod(shape)
    t = torch.arange(n).view(shape)
    for lo, hi in itertools.combinations_with_replacement(range(n + 1), 2):
        boxes = flat_run_boxes(shape, lo, hi - lo)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        got = [t[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))].reshape(-1) for b in boxes]
        assert torch.equal(torch.cat(got) if got else torch.empty(0, dtype=t.dtype), torch.arange(lo, hi))
        starts = list(itertools.accumulate((b.numel for b in boxes[:-1]), initial=0)) if boxes else []
        assert [b.run_offset for b in boxes] == starts


def test_a_matrix_run_over_partial_rows_is_three_boxes():
    boxes = flat_run_boxes((4, 10), 7, 25)  # the end of row 0, rows 1-2, the start of row 3
    assert [(b.offsets, b.sizes) for b in boxes] == [((0, 7), (1, 3)), ((1, 0), (2, 10)), ((3, 0), (1, 2))]


# -- PieceTensor --------------------------------------------------------------------------------
def test_piece_tensor_keeps_its_piece_through_what_state_dict_tools_do():
    p = PieceTensor(torch.arange(5.0), 3, (4, 3), "w")
    assert p.shape == (4, 3) and p.dtype == torch.float32 and p.local_start == 3
    for q in (p.detach(), p.clone(), copy.deepcopy(p), p.to("cpu"), p.cpu()):
        assert isinstance(q, PieceTensor) and q.local_start == 3 and torch.equal(q.to_local(), p.to_local())
    assert p.to(torch.float64).to_local().dtype == torch.float64
    buf = io.BytesIO()
    torch.save({"w": p}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)["w"]
    assert isinstance(back, PieceTensor) and torch.equal(back.to_local(), p.to_local())
    assert "piece=[3, 8)" in repr(p)


def test_piece_tensor_takes_the_in_place_writes_fsdp2_code_does_to_dtensor_entries():
    # torch's _test_state_dict_save_load: sd[k].detach().clone().fill_(v), then load_state_dict
    buf = torch.arange(12.0)
    entry = PieceTensor(buf[3:8], 3, (4, 3), "w")  # as model.state_dict() gives it: a view of the buffer
    new = entry.detach().clone().fill_(42.0)
    assert torch.equal(new.to_local(), torch.full((5,), 42.0)) and torch.equal(buf[3:8], torch.arange(3.0, 8.0))
    entry.zero_()  # on the entry itself: writes the parameter's piece, as on FSDP2's entries
    assert torch.equal(buf, torch.cat([torch.arange(3.0), torch.zeros(5), torch.arange(8.0, 12.0)]))
    entry.copy_(new)  # the same piece of the same tensor
    assert torch.equal(buf[3:8], torch.full((5,), 42.0))
    entry.copy_(torch.arange(12.0).view(4, 3) * 10)  # a whole tensor: this piece's elements
    assert torch.equal(buf[3:8], torch.arange(3.0, 8.0) * 10)
    with pytest.raises(PieceTensorError, match=r"copy_ into the state-dict entry w .*piece \[3, 8\)\) from a tensor"):
        entry.copy_(torch.ones(5))  # the local piece alone (the control: a shape that is neither)
    with pytest.raises(PieceTensorError, match=r"the source must be the same piece"):
        entry.copy_(PieceTensor(torch.ones(4), 4, (4, 3)))


def test_a_piece_of_boxes_is_those_boxes_row_major_one_after_another(tmp_path):
    """``PieceTensor(..., boxes=...)`` (a tile-placed weight's whole tiles): DCP's chunks are the
    boxes, ``copy_`` of a whole tensor takes their elements box by box, ``torch.save`` keeps them,
    and ``full_tensor()`` of a piece holding every element puts each box at its place."""
    full = torch.arange(24.0).view(4, 6)
    boxes = [((0, 3), (2, 3)), ((0, 0), (2, 3)), ((2, 0), (2, 6))]  # two tiles of a tile row, then a row
    local = torch.cat([full[0:2, 3:6].reshape(-1), full[0:2, 0:3].reshape(-1), full[2:4].reshape(-1)])
    entry = PieceTensor(local.clone(), 0, (4, 6), "w", boxes=boxes)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in entry.__create_chunk_list__()] == boxes
    assert entry.local_start == -1 and not entry.is_run
    entry.zero_()
    entry.copy_(full)
    assert torch.equal(entry.to_local(), local)
    assert torch.equal(entry.full_tensor(), full)  # no process group: it holds every element
    torch.save({"w": entry}, tmp_path / "sd.pt")
    back = torch.load(tmp_path / "sd.pt", weights_only=False)["w"]
    assert [(b.offsets, b.sizes) for b in back.boxes] == boxes and torch.equal(back.to_local(), local)
    assert torch.equal(PieceTensor(torch.empty(0), 0, (4, 6), boxes=[]).copy_(full).to_local(), torch.empty(0))
    with pytest.raises(PieceTensorError, match=r"piece of 3 boxes \[\(\(0, 3\), \(2, 3\)\)"):
        entry + 1  # the control: whole-tensor work is refused, naming the boxes


def test_an_empty_tensor_is_one_empty_box_on_every_rank():
    # every rank writes the same empty box (DCP keeps one), so the name is in the checkpoint
    boxes = PieceTensor(torch.empty(0), 0, (0, 3)).__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in boxes] == [((0, 0), (0, 3))]


@pytest.mark.parametrize(
    "op", [lambda p: p + 1, lambda p: p.sum(), lambda p: p.untyped_storage(), lambda p: p.data_ptr()]
)
def test_piece_tensor_refuses_whole_tensor_work_naming_full_state_dict(op):
    with pytest.raises(PieceTensorError, match=r"only this rank's piece \[3, 8\).*blockshard.full_state_dict"):
        op(PieceTensor(torch.arange(5.0), 3, (4, 3), "w"))


# -- model.state_dict() at W = 1 and W = 2 -------------------------------------------------------
def _sharded(seed: int, semantics: object = None) -> nn.Module:
    with _inproc.serial():
        model = OddMLP(seed)
    for block in model.blocks:
        blockshard.fully_shard(block, semantics=semantics)
    return blockshard.fully_shard(model, semantics=semantics)


def _step(model: nn.Module) -> None:
    x, y = mlp_batches(1, 4)[0]
    nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.zero_grad()


def _dcp_round_trip(rank: int, world: int, path: str) -> dict:
    saved = _sharded(0)
    _step(saved)
    entries = saved.state_dict()
    full = blockshard.full_state_dict(saved)
    full_tensor_equal = all(torch.equal(v.full_tensor(), full[k]) for k, v in entries.items())  # collective
    dcp.save(entries, checkpoint_id=path)
    model = _sharded(1, semantics="muon")
    fresh_differs = not all(torch.equal(a, b) for a, b in zip(*map(_values, (saved, model)), strict=True))
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    _step(model)
    _step(saved)
    return {
        "kinds": {type(v).__name__ for v in entries.values()},
        "shapes": {k: tuple(v.shape) for k, v in entries.items()},
        "fresh_differs": fresh_differs,
        "equal_after_a_step": all(torch.equal(a, b) for a, b in zip(*map(_values, (saved, model)), strict=True)),
        "full_tensor_equal": full_tensor_equal,
    }


def _values(model: nn.Module) -> list[torch.Tensor]:
    return list(blockshard.full_state_dict(model).values())


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_round_trip_into_other_semantics_then_training_goes_on_alike(world, tmp_path):
    if world == 1:
        with _inproc.single_thread():
            outs = [_dcp_round_trip(0, 1, str(tmp_path / "ckpt"))]
    else:
        outs = _inproc.run_ranks(_dcp_round_trip, 2, args=(str(tmp_path / "ckpt"),))
    want = {k: tuple(v.shape) for k, v in OddMLP(0).state_dict().items()}
    for out in outs:
        assert out["kinds"] == {"PieceTensor"} and out["shapes"] == want
        assert out["fresh_differs"] and out["equal_after_a_step"]
        assert out["full_tensor_equal"]  # PieceTensor.full_tensor() gathers, as DTensor.full_tensor()


def test_full_tensor_of_pieces_that_do_not_cover_the_tensor_raises():
    with pytest.raises(PieceTensorError, match=r"the ranks' pieces hold 5 of its 12 elements"):
        PieceTensor(torch.arange(5.0), 3, (4, 3), "w").full_tensor()  # W = 1: one piece of 5


def test_load_state_dict_takes_full_tensors_and_refuses_wrong_ones():
    with _inproc.single_thread():
        model = _sharded(1)
        full = OddMLP(0).state_dict()
        model.load_state_dict(full)  # an unsharded model's state dict loads as it is
        assert all(torch.equal(blockshard.full_state_dict(model)[k], v) for k, v in full.items())
        bad = dict(full, **{"blocks.0.0.weight": torch.zeros(3, 13)})
        with pytest.raises(ShardingError, match=r"'blocks.0.0.weight': the state dict holds shape \(3, 13\)"):
            model.load_state_dict(bad)
        # assign=True (FSDP2 code loading a meta-device model) copies into the engine's own
        # parameters, which stay registered (tests/runtime/test_fsdp2_init_scenarios.py: on meta)
        before = list(model.parameters())
        model.load_state_dict({k: v + 1 for k, v in full.items()}, assign=True)
        assert all(p is q for p, q in zip(model.parameters(), before, strict=True))
        assert all(torch.equal(blockshard.full_state_dict(model)[k], v + 1) for k, v in full.items())
        other = PieceTensor(torch.zeros(5), 2, (37, 13))
        with pytest.raises(ShardingError, match=r"holds piece \[2, 7\) of it, this rank holds \[0, 481\)"):
            model.load_state_dict(dict(full, **{"blocks.0.0.weight": other}))


def test_set_model_state_dict_with_full_tensors_loads_and_get_model_state_dict_gathers_them():
    import torch.distributed.checkpoint.state_dict as dsd
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    with _inproc.single_thread():
        model = _sharded(1)
        full = OddMLP(0).state_dict()
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        assert all(torch.equal(blockshard.full_state_dict(model)[k], v) for k, v in full.items())
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        got = get_model_state_dict(model, options=options)
        assert got.keys() == full.keys() and all(type(got[k]) is torch.Tensor for k in full)
        assert all(torch.equal(got[k], v) for k, v in full.items())
        # the control: torch's own helper gathers DTensors only, the entries stayed pieces
        info = dsd._verify_options(model, (), optim_only=False, options=options)
        torch_own = dsd._get_model_state_dict.__wrapped__
        assert _blockshard_layers(torch_own) == 0  # blockshard wrapped it once (ranks on threads too)
        assert {type(v) for v in torch_own(model, info).values()} == {PieceTensor}


def _blockshard_layers(fn) -> int:
    """How many of blockshard's wrappers ``fn`` is, down its ``__wrapped__`` chain."""
    from blockshard.runtime.routes import _state_dict

    layers = 0
    while fn is not None:
        layers += fn.__code__.co_filename == _state_dict.__file__
        fn = getattr(fn, "__wrapped__", None)
    return layers


def test_torch_state_dict_helpers_are_wrapped_once_when_rank_threads_shard_at_once(monkeypatch):
    # Ranks on threads reach their first fully_shard together (_inproc.run_ranks); a second
    # wrapping nested ours around ours, so torch's own helper was no longer one __wrapped__ down.
    import builtins
    import threading
    import time

    import torch.distributed.checkpoint.state_dict as dsd

    names = ("_get_model_state_dict", "_get_optim_state_dict", "_load_optim_state_dict", "_get_fqns")
    blockshard.install_torch_routes()
    assert {name: _blockshard_layers(getattr(dsd, name)) for name in names} == dict.fromkeys(names, 1)
    blockshard.uninstall_torch_routes()  # back to torch's own functions, as before the process's first fully_shard
    assert {name: _blockshard_layers(getattr(dsd, name)) for name in names} == dict.fromkeys(names, 0)  # control
    start, real_import = threading.Barrier(8), builtins.__import__

    def slow_first_import(name, *args, **kwargs):  # as in a fresh process, where it takes a while
        if name == dsd.__name__:
            time.sleep(0.01)
        return real_import(name, *args, **kwargs)

    def install() -> None:
        start.wait()
        blockshard.install_torch_routes()

    monkeypatch.setattr(builtins, "__import__", slow_first_import)
    threads = [threading.Thread(target=install) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert {name: _blockshard_layers(getattr(dsd, name)) for name in names} == dict.fromkeys(names, 1)
    blockshard.install_torch_routes()  # and once more: still one layer
    assert {name: _blockshard_layers(getattr(dsd, name)) for name in names} == dict.fromkeys(names, 1)


class _PerBlockState(torch.optim.Optimizer):
    """Keeps a state tensor that is not piece-shaped (as bitsandbytes' absmax per 256-block)."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("absmax", torch.zeros(2))


def test_optimizer_state_that_is_not_piece_shaped_raises_naming_the_key():
    with _inproc.single_thread():
        model = _sharded(0)
        with pytest.raises(
            blockshard.runtime.CheckpointError, match=r"state 'absmax' of parameter 'blocks.0.0.weight'"
        ):
            blockshard.optimizer_state_dict(model, _PerBlockState(model.parameters()))
        state = blockshard.optimizer_state_dict(model, torch.optim.AdamW(model.parameters()))
        entry = state["state"]["blocks.0.0.weight"]
        assert isinstance(entry["exp_avg"], PieceTensor) and entry["exp_avg"].shape == (37, 13)
        assert type(entry["step"]) is torch.Tensor and state["param_groups"][0]["params"][0] == "blocks.0.0.weight"


def test_creating_missing_optimizer_state_leaves_existing_state_and_parameters_alone():
    with _inproc.single_thread():
        model = _sharded(0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x, _ = mlp_batches(1, 4)[0]
        model(x).sum().backward()
        for p in model.blocks[1:].parameters():
            p.grad = None  # these get no state in this step
        opt.step()
        first = model.blocks[0][0].weight
        before = {k: v.clone() for k, v in opt.state[first].items()}
        params = [p.detach().clone() for p in model.parameters()]
        state = blockshard.optimizer_state_dict(model, opt)
        assert set(state["state"]) == {n for n, _ in model.named_parameters()}  # created for every parameter
        assert all(torch.equal(opt.state[first][k], v) for k, v in before.items())  # step stays 1
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
        assert first.grad is not None and model.blocks[1][0].weight.grad is None  # gradients as they were


# -- tied names, save_pretrained -----------------------------------------------------------------
def _tiny_llama(tie: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=tie,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def _export(rank: int, world: int, path: str, tie: bool) -> dict:
    with _inproc.serial():  # lazy imports are not thread-safe
        from transformers import LlamaForCausalLM

        model = _tiny_llama(tie)
        unsharded = _tiny_llama(tie)
    for layer in model.model.layers:
        blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    out: dict = {}
    full = blockshard.full_state_dict(model)
    out["names_match"] = list(full) == list(unsharded.state_dict())
    unsharded.load_state_dict(full)  # strict
    try:
        model.save_pretrained(f"{path}/pieces", is_main_process=rank == 0)
        out["pieces"] = "no error"
    except PieceTensorError as e:
        out["pieces"] = str(e)
    out["pieces_files"] = sorted(os.listdir(f"{path}/pieces")) if os.path.isdir(f"{path}/pieces") else []
    model.save_pretrained(f"{path}/full", state_dict=dict(full), is_main_process=rank == 0)  # HF pops entries
    torch.distributed.barrier()
    with _inproc.serial():
        back = LlamaForCausalLM.from_pretrained(f"{path}/full")
    out["reloaded_equal"] = all(torch.equal(v, full[k]) for k, v in back.state_dict().items())
    _step_llama(model)  # the streamed export of a trained model (blockshard.save_pretrained)
    trained = blockshard.full_state_dict(model)
    blockshard.save_pretrained(model, f"{path}/streamed")
    torch.distributed.barrier()
    with _inproc.serial():
        back = LlamaForCausalLM.from_pretrained(f"{path}/streamed")
    out["streamed_equal"] = all(torch.equal(v, trained[k]) for k, v in back.state_dict().items())
    out["streamed_differs_from_first"] = not torch.equal(trained["model.norm.weight"], full["model.norm.weight"])
    out["streamed_files"] = sorted(os.listdir(f"{path}/streamed"))
    out["without_tied_name_fails"] = None
    if tie:
        try:
            unsharded.load_state_dict({k: v for k, v in full.items() if k != "lm_head.weight"})
        except RuntimeError:
            out["without_tied_name_fails"] = True
    return out


def _step_llama(model: nn.Module) -> None:
    ids = torch.arange(12).view(2, 6) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.zero_grad()


@pytest.mark.parametrize("tie", [True, False])
def test_full_state_dict_has_tied_names_and_save_pretrained_never_writes_pieces(tie, tmp_path):
    for out in _inproc.run_ranks(_export, 2, args=(str(tmp_path), tie)):
        assert out["names_match"] and out["reloaded_equal"]
        assert out["streamed_equal"] and out["streamed_differs_from_first"]  # control: training changed it
        shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # one per group: 2 layers, the root
        assert out["streamed_files"] == ["config.json", *shards, "model.safetensors.index.json"]
        assert "save_pretrained(path, state_dict=blockshard.full_state_dict(model)" in out["pieces"]
        assert not [f for f in out["pieces_files"] if f.endswith((".safetensors", ".bin"))]
        assert out["without_tied_name_fails"] is (True if tie else None)  # control


def _export_chunked(rank: int, world: int, path: str) -> bool:
    with _inproc.serial():
        from transformers import LlamaForCausalLM

        model = _tiny_llama(tie=True)
    for layer in model.model.layers:
        blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    _step_llama(model)
    trained = blockshard.full_state_dict(model)
    blockshard.save_pretrained(model, path)
    torch.distributed.barrier()
    with _inproc.serial():
        back = LlamaForCausalLM.from_pretrained(path)
    return back.state_dict().keys() == trained.keys() and all(
        torch.equal(v, trained[k]) for k, v in back.state_dict().items()
    )


def test_save_pretrained_streams_chunks_that_cut_tensors_and_segments(tmp_path, monkeypatch):
    from blockshard.runtime.checkpoint import _export

    monkeypatch.setattr(_export, "_CHUNK_BYTES", 44)  # 11 fp32 elements: chunks end inside tensors
    assert all(_inproc.run_ranks(_export_chunked, 3, args=(str(tmp_path / "w3"),)))


# -- blockshard inspect CHECKPOINT ---------------------------------------------------------------
def test_inspect_a_checkpoint(tmp_path, capsys):
    with _inproc.single_thread():
        model = _sharded(0)
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "ok"))
    info = describe_checkpoint(tmp_path / "ok")
    assert info["complete"] and info["ranks_that_wrote"] == 1
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name["blocks.0.0.weight"] == {"name": "blocks.0.0.weight", "shape": [37, 13], "dtype": "float32"} | {
        "bytes": 37 * 13 * 4,
        "chunks": 1,
    }
    assert main(["inspect", str(tmp_path / "ok")]) == 0
    assert "blocks.0.0.weight" in capsys.readouterr().out
    os.remove(tmp_path / "ok" / "__0_0.distcp")
    assert main(["inspect", str(tmp_path / "ok"), "--json"]) == 1  # readable, but incomplete
    assert "shard file '__0_0.distcp' is missing" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["nowhere"], "'nowhere' is not a directory"),
        (["."], "has no .metadata file"),
        ([], "either a checkpoint directory"),
        (["x", "--model", "llama3-8b"], "not both and not neither"),
    ],
)
def test_inspect_bad_checkpoint_arguments_are_one_error_line(args, fragment, capsys):
    assert main(["inspect", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("blockshard inspect: error:") and fragment in err

"""Tensor parallelism composed with blockshard ([Note: tensor-parallel parameters] in
blockshard/runtime/core/_tp.py): 4 spawned gloo ranks as a (dp=2, tp=2) mesh, torchtitan's recipe
(``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard`` over ``mesh["dp"]``) with only
``fully_shard`` swapped.

TP sums partial products across ranks, so the reference is stock FSDP2 with the same TP plan: with
torch's AdamW (element-wise) blockshard trains as it **bitwise**: plain, with gradient accumulation
2 (no sync on the first micro-batch), under ``MixedPrecisionPolicy(bf16, fp32)``, with
``CPUOffloadPolicy`` and with sequence parallelism (a ``SequenceParallel`` norm, whose gradient is ``Partial`` over tp). Against
one process, within ``ONE_PROCESS_ATOL`` (the TP products and the dp average are summed in
another order). Clipping: ``clip_grad_norm_`` gives the norm of the whole gradients (tp-sharded
pieces summed over tp and dp), within ``NORM_RTOL`` of stock's full-tensor norm; the control, the
pieces summed over dp alone, is off by far more.

Muon on TP-split matrices ([Note: Muon across tensor parallelism] in blockshard/optim/_muon.py):
``blockshard.optim.Muon`` with ``semantics="muon"`` (each TP-local matrix whole on a dp rank, or
cut over dp and owner-computed under ``policy="owner"``) equals **bitwise** the reference that runs
stock FSDP2 with the same TP plan and steps torch's Muon on each matrix gathered whole across dp
and tp, and one process within ``ONE_PROCESS_ATOL``; the control (torch's Muon on each TP-local
matrix, the optimizer checks off) is off by far more. Bad input: 8-bit semantics a tp cut splits,
torch's Muon over a TP-split piece, and ``save_checkpoint`` of a TP group raise naming the parameter.

Checkpoints: DCP entries of TP parameters are their global tensors (each rank's piece as boxes of
it), so a (dp 2, tp 2) save loads at (4, 1) and (1, 4) bitwise, and a stock FSDP2 + TP save loads
into blockshard + TP. 3-D: 8 ranks as (replicate 2, shard 2, tp 2), HSDP x TP bitwise as stock.
Expert parallelism: (dp 2, ep 2), stacked experts Shard(0) over ep, AdamW and per-expert Muon
bitwise against stock FSDP2 with the same placement."""

from __future__ import annotations

import functools
import tempfile

import _tp_runs
import pytest
import torch

from blockshard._launch import run_single, spawn_gloo

pytestmark = pytest.mark.slow
ONE_PROCESS_ATOL = 1e-6
NORM_RTOL = 1e-6
# an 8-bit code that TP's other summation order flips moves that step by lr x about 1/127 (1e-2 / 127:
# up to 8e-5; measured 8.4e-5 on an AMD EPYC, 0 on the CPU where the test was written)
BNB_ONE_PROCESS_ATOL = 1e-3
SHAMPOO_ACROSS_TP_ATOL = 1e-3  # Shampoo's inverse roots amplify another tp's summation order (measured 1.3e-4)


@functools.cache
def _runs() -> tuple[dict, list[dict]]:
    with tempfile.TemporaryDirectory() as d:
        return run_single(_tp_runs.references, timeout=180), spawn_gloo(_tp_runs.cases, 4, args=(d,), timeout=500)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("variant", ["", "_gas2", "_bf16", "_sp", "_offload"])
def test_element_wise_training_equals_stock_fsdp2_with_the_same_tp_plan_bitwise(variant):
    """``_offload``: ``CPUOffloadPolicy`` on both engines, with bf16 mixed precision and gradient
    accumulation 2 (every blockshard group keeps its pieces and gradients on the host)."""
    _, got = _runs()
    for rank, res in enumerate(got):
        assert _equal(res["stock" + variant]["params"], res["blockshard" + variant]["params"]) == [], rank
        offloaded = res["blockshard" + variant]["offloaded"]
        assert offloaded and all(offloaded) == (variant == "_offload"), (rank, offloaded)
    # the whole model trained: not the initial values
    init = dict(_tp_runs.make_model().named_parameters())
    assert all(not torch.equal(v, init[n].detach()) for n, v in got[0]["blockshard" + variant]["params"].items())


@pytest.mark.parametrize("variant", ["", "_gas2", "_sp"])
def test_tp_training_matches_one_process(variant):
    want, got = _runs()
    for res in got:
        for n, v in want["plain"].items():
            torch.testing.assert_close(res["blockshard" + variant]["params"][n], v, rtol=0, atol=ONE_PROCESS_ATOL)


def test_the_unsharded_tp_parameters_are_dtensors_on_the_tp_mesh_and_the_pieces_plain():
    """Unsharded (as in forward and backward), block 0's TP parameters are DTensors with their TP
    placements and global shapes; between steps every parameter is a plain piece, and the two dp
    ranks' pieces of up.weight make up its (16, 16) TP-local tensor."""
    _, got = _runs()
    unsharded = got[0]["blockshard"]["unsharded"]
    assert unsharded["up.weight"] == ("DTensor", "(Shard(dim=0),)", (32, 16))
    assert unsharded["down.weight"] == ("DTensor", "(Shard(dim=1),)", (16, 32))
    assert unsharded["down.bias"] == ("DTensor", "(Replicate(),)", (16,))
    assert unsharded["norm.weight"] == ("Parameter", "", (16,))  # not in the TP plan: a plain tensor
    assert {kind for kind, _, _ in got[0]["blockshard"]["pieces"].values()} == {"Parameter"}
    numel = [int(torch.tensor(r["blockshard"]["pieces"]["up.weight"][2]).prod()) for r in (got[0], got[2])]
    assert sum(numel) == 16 * 16


def test_clip_grad_norm_sums_tp_sharded_pieces_over_tp_and_matches_one_process():
    want, got = _runs()
    for res in got:
        stock, ours = res["stock_clip"]["norms"], res["blockshard_clip"]["norms"]
        assert all(n > _tp_runs.MAX_NORM for n in stock)  # every step clips
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(stock), rtol=NORM_RTOL, atol=0)
        for n, v in res["stock_clip"]["params"].items():
            torch.testing.assert_close(res["blockshard_clip"]["params"][n], v, rtol=0, atol=ONE_PROCESS_ATOL)
        for n, v in want["clip"].items():
            torch.testing.assert_close(res["blockshard_clip"]["params"][n], v, rtol=0, atol=ONE_PROCESS_ATOL)


def test_control_a_norm_summed_over_dp_alone_is_wrong():
    _, got = _runs()
    for res in got:
        stock, dp_only = res["stock_clip"]["norms"], res["blockshard_clip"]["dp_only_norms"]
        assert all(abs(a - b) > 1e3 * NORM_RTOL * b for a, b in zip(dp_only, stock, strict=True)), (dp_only, stock)


@pytest.mark.parametrize("engine", ["blockshard", "owner"])
def test_muon_on_tp_split_matrices_equals_whole_matrix_muon_bitwise(engine):
    _, got = _runs()
    for rank, res in enumerate(got):
        assert _equal(res["muon_stock"]["params"], res[f"muon_{engine}"]["params"]) == [], rank
    # Newton-Schulz of every TP-split matrix (4 of 32 x 16 fp32, 16 x 16 per tp rank) at one tp owner,
    # 2 per tp rank: each step one all_to_all over tp sends the other tp rank its 2 matrices' directions
    # (2 x 16 x 16 fp32) and one sends back its 2 results; counted per rank, summed over a dp rank's
    # two tp ranks, as many matrices' worth on the dp rank whose pieces hold them ((dp, tp) = (0, 0), (0, 1))
    calls = nbytes = 0
    for rank in range(4):
        rows = [(c, b) for kind, c, b, ranks in got[rank][f"muon_{engine}"]["counts"] if ranks == 2]
        calls, nbytes = calls + sum(c for c, _ in rows), nbytes + sum(b for _, b in rows)
        assert not any(
            kind == "all-gather" and ranks == 2 for kind, _, _, ranks in got[rank][f"muon_{engine}"]["counts"]
        )
    assert nbytes == 2 * 4 * _tp_runs.STEPS * 16 * 16 * 4, nbytes  # each matrix: half to its owner, half back
    # the owner policy cuts the TP-local matrices over dp: the dp owners' all_to_alls ran too
    assert any(kind == "all-to-all" and ranks is None for kind, _, _, ranks in got[0]["muon_owner"]["counts"])
    assert not any(kind == "all-to-all" and ranks is None for kind, _, _, ranks in got[0]["muon_blockshard"]["counts"])


def test_muon_on_tp_split_matrices_matches_one_process():
    want, got = _runs()
    for res in got:
        for n, v in want["muon"].items():
            torch.testing.assert_close(res["muon_blockshard"]["params"][n], v, rtol=0, atol=ONE_PROCESS_ATOL)


def test_control_muon_on_each_tp_shard_differs():
    _, got = _runs()
    want, ctrl = got[0]["muon_stock"]["params"], got[0]["muon_per_shard"]["params"]
    diff = max((ctrl[n] - want[n]).abs().max().item() for n in want)
    assert diff > 1e3 * ONE_PROCESS_ATOL, diff


def test_fused_parts_across_tp_equal_torch_muon_on_each_global_part_bitwise():
    """The blocks' ``up`` (``Shard(0)``) and ``down`` (``Shard(1)``) declared fused weights of two parts on
    their TP-local matrices ([Note: fused parts]): blockshard.optim.Muon runs Newton-Schulz on each part
    of the global matrix (part i of every tp rank's, joined), bitwise torch's Muon on those parts
    gathered from stock FSDP2 + TP. Control: Muon on the whole matrices is another update."""
    _, got = _runs()
    for rank, res in enumerate(got):
        assert _equal(res["muon_parts_stock"]["params"], res["muon_parts"]["params"]) == [], rank
        whole, parts = res["muon_stock"]["params"], res["muon_parts"]["params"]
        assert max((whole[n] - parts[n]).abs().max().item() for n in whole) > 1e3 * ONE_PROCESS_ATOL


def test_what_tp_groups_cannot_do_is_refused_by_name():
    _, got = _runs()
    for res in got:
        bnb = res["refusals"]["bnb8bit"]
        assert "'up.weight'" in bnb and "bnb8bit" in bnb and "Shard(dim=0)" in bnb and "Fix:" in bnb
        muon = res["refusals"]["torch_muon"]
        assert ("up.weight" in muon or "down.weight" in muon) and "tensor-parallel" in muon
        assert "blockshard.optim.Muon" in muon
        sd = res["refusals"]["sharded_state_dict"]
        assert "up.weight" in sd and "tensor-parallel" in sd and "Fix:" in sd
        shampoo = res["refusals"]["shampoo_32"]  # BlockedShampoo's 32 x 32 tiles across a cut at 16 rows
        assert "BlockedShampoo" in shampoo and "up.weight" in shampoo and "tensor-parallel" in shampoo
        assert "32 x 32 preconditioner tiles" in shampoo and "max_preconditioner_dim that divides" in shampoo
        world = res["refusals"]["world_mesh"]  # fully_shard without mesh= would mix the tp ranks' parts
        assert "up.weight" in world and "tp ranks" in world and "mesh['dp']" in world, world
        tiles = res["refusals"]["shampoo_32_semantics"]
        assert "'up.weight'" in tiles and "32 x 32 tiles" in tiles and "Fix:" in tiles
        qgather = res["refusals"]["quantized_gather"]
        assert "quantized_gather=True" in qgather and "tensor-parallel" in qgather and "Fix:" in qgather
        # bitsandbytes' blocks and Shampoo's tiles of TP-split pieces: placed in the global tensors (tests below)
        assert res["bnb_blockshard"]["state_dict"] == res["shampoo_blockshard_8"]["state_dict"] == "no error"


def test_bnb_8bit_state_of_tp_split_weights_checkpoints_and_reshards_bitwise():
    """bitsandbytes AdamW8bit under (dp 2, tp 2), its blocks whole in every TP shard: ``save_checkpoint``
    places each piece's 8-bit codes and per-block absmax in the global tensors (``Shard(0)`` pieces
    as one run of blocks, ``Shard(1)`` pieces as one run per row; [Note: optimizer state codecs]), so a
    load at (2, 2) takes the third step bitwise as the run that went on, and the state loaded at
    (4, 1), saved again and loaded at (2, 2) does too (the state crossed the layouts exactly). At
    (4, 1) itself the step differs by TP's summation order alone, within ``ONE_PROCESS_ATOL``
    (measured 3e-8 on an AMD EPYC; 0 on the machine where this test was written: whether the row-wise
    products summed over tp round as the whole product does depends on the CPU's matmul kernels).
    Control: the same load without the optimizer state is off by more than 1e-3."""
    for rank, res in enumerate(_runs()[1]):
        got = res["bnb_checkpoints"]
        want, ctrl = got["uninterrupted"], got["dp2_tp2_model_only"]
        for layout in ("dp2_tp2", "via_dp4_tp1"):
            assert _equal(want, got[layout]) == [], (rank, layout)
        assert max((got["dp4_tp1"][n] - want[n]).abs().max().item() for n in want) < ONE_PROCESS_ATOL
        assert max((ctrl[n] - want[n]).abs().max().item() for n in want) > 1e-3, rank


def test_save_pretrained_of_tp_groups_writes_the_full_weights_and_load_safetensors_reads_them_back():
    """``blockshard.save_pretrained`` of a (dp 2, tp 2) model ([Note: tensor-parallel export]): rank 0
    writes one safetensors file and its index; every tensor read back equals ``full_state_dict``'s
    bitwise (the TP-split weights whole, of their global shapes). ``blockshard.load_safetensors`` of
    that export into fresh models at (2, 2), (4, 1) and (1, 4) gives the same full state bitwise."""
    exported = _runs()[1][0]["export"]
    assert exported["files"] == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    full, read = exported["full"], exported["read"]
    assert sorted(read) == sorted(full) and _equal(full, read) == []
    assert tuple(read["blocks.0.up.weight"].shape) == (32, 16)  # global: ColwiseParallel's two halves joined
    for rank, res in enumerate(_runs()[1]):  # load_safetensors reads each rank's TP and dp piece, any layout
        for layout, got in res["export"]["loaded"].items():
            assert _equal(full, got) == [], (rank, layout)


def test_torchao_8bit_state_of_tp_split_weights_checkpoints_and_reshards_bitwise():
    """torchao's AdamW8bit under (dp 2, tp 2), ``semantics="ao8bit"``: its ``OptimState8bit`` codes
    placed as the TP piece's elements of the global tensor, its per-block scales as the global
    tensor's blocks ([Note: optimizer state codecs]); the round trips of the bitsandbytes test, with
    the same expectations. Before, ``save_checkpoint`` refused this state."""
    for rank, res in enumerate(_runs()[1]):
        got = res["ao_checkpoints"]
        assert got["up_state"] in ("OptimState8bit", "no piece"), got["up_state"]
        want, ctrl = got["uninterrupted"], got["dp2_tp2_model_only"]
        for layout in ("dp2_tp2", "via_dp4_tp1"):
            assert _equal(want, got[layout]) == [], (rank, layout)
        assert max((got["dp4_tp1"][n] - want[n]).abs().max().item() for n in want) < ONE_PROCESS_ATOL
        assert max((ctrl[n] - want[n]).abs().max().item() for n in want) > 1e-3, rank
    assert "OptimState8bit" in {res["ao_checkpoints"]["up_state"] for res in _runs()[1]}


def test_shampoo_tiles_of_tp_split_weights_checkpoint_and_reshard():
    """BlockedShampoo (8 x 8 tiles) under (dp 2, tp 2): ``save_checkpoint`` places each piece's per-tile
    state among the global tensor's tiles (``Shard(0)`` pieces as one run of tiles, ``Shard(1)`` pieces
    as a run per tile row), so a load at (2, 2) takes the third step bitwise as the run that went on,
    and the state loaded at (4, 1), saved again and loaded at (2, 2) does too (the state crossed the
    layouts exactly). At (4, 1) itself the step differs by TP's summation order alone, which Shampoo's
    inverse roots amplify (measured 1.3e-4; ``SHAMPOO_ACROSS_TP_ATOL``). Control: the load without the
    optimizer state is off by more than 1e-2."""
    for rank, res in enumerate(_runs()[1]):
        got = res["shampoo_checkpoints"]
        want = got["uninterrupted"]
        for layout in ("dp2_tp2", "via_dp4_tp1"):
            assert _equal(want, got[layout]) == [], (rank, layout)
        assert max((got["dp4_tp1"][n] - want[n]).abs().max().item() for n in want) < SHAMPOO_ACROSS_TP_ATOL
        assert max((got["dp2_tp2_model_only"][n] - want[n]).abs().max().item() for n in want) > 1e-2, rank


def _checkpoints() -> list[dict]:
    return [res["checkpoints"] for res in _runs()[1]]


@pytest.mark.parametrize("layout", ["dp2_tp2", "dp4_tp1", "dp1_tp4"])
def test_a_dp2_tp2_checkpoint_loads_at_another_dp_tp_layout_bitwise_and_resumes(layout):
    """Model and AdamW saved by dcp.save at (dp 2, tp 2) load at (2, 2), (4, 1) and (1, 4) (the last
    through blockshard.load_checkpoint): every parameter bitwise the saved one; the next step bitwise
    the uninterrupted run at the same layout, within ONE_PROCESS_ATOL at another tp (the TP products
    are summed in another order)."""
    for rank, res in enumerate(_checkpoints()):
        assert _equal(res["saved"], res[layout]["loaded"]) == [], rank
        if layout == "dp2_tp2":
            assert _equal(res["uninterrupted"], res[layout]["resumed"]) == [], rank
        for n, v in res["uninterrupted"].items():
            torch.testing.assert_close(res[layout]["resumed"][n], v, rtol=0, atol=ONE_PROCESS_ATOL)


def test_save_checkpoint_records_the_tp_placements_and_inspect_shows_them():
    """blockshard.json of a (dp 2, tp 2) save_checkpoint: each TP tensor's placement, degree and global
    shape beside its TP-local shape and pieces over dp; blockshard inspect's table says so."""
    from rich.console import Console

    from blockshard._render import checkpoint_table

    info = _checkpoints()[0]["described"]
    assert info["complete"], info["problems"]
    tensors = {t["name"]: t for g in info["groups"] for t in g["tensors"]}
    up = tensors["blocks.0.up.weight"]
    assert up["tp"] == {"placement": "Shard(dim=0)", "degree": 2, "global_shape": [32, 16]} and up["shape"] == [16, 16]
    assert tensors["blocks.0.down.weight"]["tp"]["placement"] == "Shard(dim=1)" and "tp" not in tensors["head.weight"]
    console = Console(width=300, record=True)
    console.print(checkpoint_table(info))
    assert "Shard(dim=0) over tp 2, each (16, 16) over dp" in console.export_text()


def test_control_a_tp_load_without_the_optimizer_state_differs():
    res = _checkpoints()[0]
    diff = max(
        (res["dp1_tp4_model_only"]["resumed"][n] - v).abs().max().item() for n, v in res["uninterrupted"].items()
    )
    assert diff > 1e3 * ONE_PROCESS_ATOL, diff


def test_a_stock_fsdp2_tp_checkpoint_loads_into_blockshard_tp_bitwise():
    """torch's get_state_dict / dcp.save by stock FSDP2 + TP, dcp.load / set_state_dict into blockshard
    with the same (dp 2, tp 2) layout: the values bitwise, and the next step bitwise stock's."""
    for rank, res in enumerate(_checkpoints()):
        got = res["from_stock"]
        assert _equal(got["saved"], got["loaded"]) == [], rank
        assert _equal(got["uninterrupted"], got["resumed"]) == [], rank


@functools.cache
def _hsdp_tp() -> list[dict]:
    return spawn_gloo(_tp_runs.hsdp_tp, 8, timeout=400)


def test_3d_hsdp_x_tp_equals_stock_fsdp2_bitwise_and_one_process():
    """8 ranks as (replicate 2, shard 2, tp 2): blockshard's HSDP over the first two axes of a TP model
    trains as stock FSDP2's HSDP with the same TP plan, bitwise (AdamW, a quarter of each batch per dp
    rank); its global gradient norm matches stock's full-tensor norm; one process within tolerance."""
    want = _runs()[0]["plain"]
    for rank, res in enumerate(_hsdp_tp()):
        assert _equal(res["stock"]["params"], res["blockshard"]["params"]) == [], rank
        torch.testing.assert_close(
            torch.tensor(res["blockshard"]["norms"]), torch.tensor(res["stock"]["norms"]), rtol=NORM_RTOL, atol=0
        )
        for n, v in want.items():
            torch.testing.assert_close(res["blockshard"]["params"][n], v, rtol=0, atol=ONE_PROCESS_ATOL)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_expert_parallel_experts_train_as_stock_fsdp2_with_ep_bitwise_and_as_one_process(optimizer):
    """(dp 2, ep 2): stacked (E, m, n) experts Shard(0) over ep, blockshard over dp within. AdamW:
    bitwise stock FSDP2 with the same EP placement; Muon (per expert, blockshard.optim.Muon from
    muon_param_groups, which gives the stacked experts to Muon): bitwise torch's Muon on each
    expert's whole matrix; both within ONE_PROCESS_ATOL of one process."""
    single = _runs()[0][f"ep_{optimizer}"]
    for rank, res in enumerate(_runs()[1]):
        stock, ours = res[f"ep_stock_{optimizer}"]["params"], res[f"ep_blockshard_{optimizer}"]["params"]
        assert _equal(stock, ours) == [], rank
        for n, v in single.items():
            torch.testing.assert_close(ours[n], v, rtol=0, atol=ONE_PROCESS_ATOL)
    if optimizer == "muon":  # the experts went to Muon, on the dp rank that holds them
        held = {n for res in _runs()[1] for n in res["ep_blockshard_muon"]["muon_names"]}
        assert {"moe.experts.w_in", "moe.experts.w_out"} <= held


def test_bnb_8bit_blocks_the_tp_cut_keeps_whole_train_as_whole_tensor_adamw8bit_bitwise():
    """bitsandbytes AdamW8bit where the TP cuts fall between its 256-element blocks and every shard
    stays 8-bit (semantics="bnb8bit"; the optimizer guard lets it through): bitwise AdamW8bit stepping
    each whole tensor gathered from stock FSDP2 + TP, within BNB_ONE_PROCESS_ATOL of one process. (A
    cut through a block is refused: test_what_tp_groups_cannot_do_is_refused_by_name.)"""
    want, got = _runs()
    for rank, res in enumerate(got):
        assert _equal(res["bnb_stock"]["params"], res["bnb_blockshard"]["params"]) == [], rank
        for n, v in want["bnb"].items():
            torch.testing.assert_close(res["bnb_blockshard"]["params"][n], v, rtol=0, atol=BNB_ONE_PROCESS_ATOL)


def test_shampoo_tiles_the_tp_cut_keeps_whole_train_as_whole_tensor_shampoo_bitwise():
    """BlockedShampoo (8 x 8 tiles, preconditioning from step 1) where the TP cuts fall between tiles
    ([Note: tiles across tp]): bitwise BlockedShampoo stepping each whole tensor gathered from stock
    FSDP2 + TP. Control: with 32 x 32 tiles, which the cut at 16 splits, Shampoo on each TP-local matrix
    (the optimizer checks off; on, it is refused: test_what_tp_groups_cannot_do_is_refused_by_name)
    differs from the whole-tensor reference."""
    _, got = _runs()
    for rank, res in enumerate(got):
        assert _equal(res["shampoo_stock_8"]["params"], res["shampoo_blockshard_8"]["params"]) == [], rank
        want, ctrl = res["shampoo_stock_32"]["params"], res["shampoo_per_shard_32"]["params"]
        assert max((ctrl[n] - want[n]).abs().max().item() for n in want) > 1e3 * ONE_PROCESS_ATOL


def test_meta_device_tp_model_initializes_as_without_dp_sharding_bitwise():
    """torchtitan's flow (meta device, TP, fully_shard over dp, to_empty, init): blockshard's
    init_parameters gives every parameter bitwise the value the TP model gets without dp sharding.
    Control: stock FSDP2's reset_parameters on its (dp, tp) DTensor shards draws other values (its
    init depends on the dp sharding)."""
    for rank, res in enumerate(_runs()[1]):
        init = res["meta_init"]
        assert _equal(init["tp_only"], init["blockshard"]) == [], rank
        assert len(_equal(init["tp_only"], init["stock"])) > 0, rank

"""A DeepSpeed ZeRO-1/2 checkpoint moves to DCP (``blockshard.integrations.deepspeed.export_dcp``,
[Note: DeepSpeed to DCP]) and ``blockshard.fully_shard`` resumes it, and a DCP checkpoint of
``blockshard.fully_shard`` moves into a DeepSpeed engine (``import_dcp``, [Note: DCP into
DeepSpeed]): real DeepSpeed engines on 2 spawned gloo ranks (``DS_ACCELERATOR=cpu``,
``"gradient_clipping": 0``), stock and with blockshard's hook, AdamW. Two steps in one engine, the
move, two steps in the other equal four steps of one process bitwise. Control: resuming the
parameters without the optimizer state differs."""

from __future__ import annotations

import _ds_export_runs
import pytest
import torch

from blockshard import cli
from blockshard._launch import spawn_gloo
from blockshard.runtime import describe_checkpoint

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("stage", "hooked"), [(2, False), (2, True), (1, True)])
def test_a_zero_checkpoint_exported_to_dcp_resumes_in_blockshard_bitwise(tmp_path, capsys, stage, hooked):
    ckpt, out = str(tmp_path / "ds"), str(tmp_path / "dcp")
    results = spawn_gloo(_ds_export_runs.export_case, 2, args=(stage, hooked, ckpt, out), timeout=300)
    summary, reference = results[0]["summary"], results[0]["reference"]
    assert cli.main(["inspect", ckpt]) == 0  # the DeepSpeed checkpoint itself
    shown = capsys.readouterr().out
    assert f"DeepSpeed ZeRO-{stage}" in shown and "model.fc1.weight" in shown and "rank1.fp32_partition.0" in shown
    info = describe_checkpoint(out)  # what `blockshard inspect` shows
    assert info["complete"] and {t["name"] for t in info["tensors"]} >= {
        "model.fc1.weight",
        "optim.state.fc1.weight.exp_avg",
    }
    assert (summary.world_size, summary.zero_stage, summary.hooked) == (2, stage, hooked)
    assert summary.state_keys == ("exp_avg", "exp_avg_sq", "step") and summary.parameters == 8
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], reference, strict=True))
        # control: the moments are what makes the resume exact
        assert not all(torch.equal(a, b) for a, b in zip(r["model_only"], reference, strict=True))


@pytest.mark.parametrize(("stage", "hooked"), [(2, False), (1, False), (2, True)])
def test_a_blockshard_dcp_checkpoint_imported_into_deepspeed_resumes_bitwise(tmp_path, stage, hooked):
    results = spawn_gloo(_ds_export_runs.import_case, 2, args=(stage, hooked, str(tmp_path / "dcp")), timeout=300)
    reference = results[0]["reference"]
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], reference, strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(r["model_only"], reference, strict=True))


def test_8bit_state_is_refused_naming_the_parameter_and_key(tmp_path):
    messages = spawn_gloo(
        _ds_export_runs.refused_case, 2, args=(str(tmp_path / "ds"), str(tmp_path / "dcp")), timeout=300
    )
    # bitsandbytes' state_dict packs its 8-bit state into one entry per parameter
    assert "optimizer state '__bnb_optimizer_quant_state__' of parameter 'fc1.weight' is a dict" in messages[0], (
        messages[0]
    )
    assert "Fix: export only element-wise optimizer state" in messages[0]


def test_the_cli_exports_and_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    """``blockshard deepspeed-to-dcp``: a directory that is no DeepSpeed checkpoint."""
    assert cli.main(["deepspeed-to-dcp", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tag given and no 'latest' file" in err[0] and "Fix: pass tag=" in err[0]
    assert cli.main(["deepspeed-to-dcp", str(tmp_path), str(tmp_path / "out"), "--tag", "t"]) == 2
    assert "mp_rank_00_model_states.pt is missing" in capsys.readouterr().err

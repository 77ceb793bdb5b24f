"""A DeepSpeed ZeRO-1/2/3 checkpoint moves to DCP (``blockshard.integrations.deepspeed.export_dcp``,
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


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[str, list[dict]]:
    base = str(tmp_path_factory.mktemp("ds-dcp"))
    return base, spawn_gloo(_ds_export_runs.all_cases, 2, args=(base,), timeout=600)


@pytest.mark.parametrize(("stage", "hooked"), _ds_export_runs.EXPORTS)
def test_a_zero_checkpoint_exported_to_dcp_resumes_in_blockshard_bitwise(cases, capsys, stage, hooked):
    base, results = cases
    where = f"{base}/export-{stage}-{hooked}"
    summary, reference = results[0]["export", stage, hooked]["summary"], results[0]["reference"]
    assert (summary.world_size, summary.zero_stage, summary.hooked) == (2, stage, hooked)
    assert summary.state_keys == ("exp_avg", "exp_avg_sq", "step") and summary.parameters == 8
    assert cli.main(["inspect", f"{where}/ds"]) == 0  # the DeepSpeed checkpoint itself
    shown = capsys.readouterr().out
    assert f"DeepSpeed ZeRO-{stage}" in shown and "model.fc1.weight" in shown and "rank1.fp32_partition.0" in shown
    info = describe_checkpoint(f"{where}/dcp")  # what `blockshard inspect` shows of the export
    assert info["complete"] and {t["name"] for t in info["tensors"]} >= {
        "model.fc1.weight",
        "optim.state.fc1.weight.exp_avg",
    }
    for r in results:
        got = r["export", stage, hooked]
        assert all(torch.equal(a, b) for a, b in zip(got["resumed"], reference, strict=True))
        # control: the moments are what makes the resume exact
        assert not all(torch.equal(a, b) for a, b in zip(got["model_only"], reference, strict=True))


@pytest.mark.parametrize(("stage", "hooked"), _ds_export_runs.IMPORTS)
def test_a_blockshard_dcp_checkpoint_imported_into_deepspeed_resumes_bitwise(cases, stage, hooked):
    _, results = cases
    reference = results[0]["reference"]
    for r in results:
        got = r["import", stage, hooked]
        assert all(torch.equal(a, b) for a, b in zip(got["resumed"], reference, strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(got["model_only"], reference, strict=True))


def test_8bit_state_is_refused_naming_the_parameter_and_key(cases):
    message = cases[1][0]["refused"]
    # bitsandbytes' state_dict packs its 8-bit state into one entry per parameter
    assert "optimizer state '__bnb_optimizer_quant_state__' of parameter 'fc1.weight' is a dict" in message, message
    assert "Fix: export only element-wise optimizer state" in message


def test_the_cli_exports_and_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    """``blockshard deepspeed-to-dcp``: a directory that is no DeepSpeed checkpoint."""
    assert cli.main(["deepspeed-to-dcp", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tag given and no 'latest' file" in err[0] and "Fix: pass tag=" in err[0]
    assert cli.main(["deepspeed-to-dcp", str(tmp_path), str(tmp_path / "out"), "--tag", "t"]) == 2
    assert "mp_rank_00_model_states.pt is missing" in capsys.readouterr().err

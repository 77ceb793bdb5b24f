"""peft adapters of a sharded QLoRA model ([Note: peft adapters] in checkpoint/_peft.py; issue 22, item 4).

The tiny Llama with bitsandbytes nf4 linears and peft LoRA (tests/quantized/_qlora.py), its LoRA
weights set to seeded values, sharded layer by layer at W = 2 on threads:

* ``model.save_pretrained(dir)``, called unchanged on every rank, writes what peft writes for the
  unsharded model: the same files, the same tensor names, dtypes and bits (the safetensors files
  are equal byte for byte), an equal ``adapter_config.json``; only rank 0 writes; the all-gathers
  carry the adapter's values and nothing of the base model.
* ``set_peft_model_state_dict`` and ``load_adapter`` into the sharded PeftModel give the pieces
  that loading the unsharded model and then sharding gives; ``PeftModel.from_pretrained`` onto a
  sharded base keeps the adapter whole on every rank (inference equals one process).
* a rank that does something else instead of saving fails every rank (no hang); bad input and the
  PiSSA / OLoRA conversion raise naming the fix; the route is checked against peft and undone.

Controls: the sharded model's ``state_dict()`` holds PieceTensors for the LoRA weights, and with
the route off ``save_pretrained`` raises ``PieceTensorError`` naming the explicit call, which works.
"""

from __future__ import annotations

import json
import math
import os

import _inproc
import _qlora
import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

import blockshard
from blockshard import TorchRouteError
from blockshard._tiny import text_batches
from blockshard.runtime import PieceTensorError, ShardingError
from blockshard.runtime.routes import ROUTES_ENV, installed_torch_routes

pytestmark = pytest.mark.timeout(120)

ADAPTER = "adapter_model.safetensors"


def _model(seed: int | None = 5, *, second: bool = False):
    """The QLoRA model, its LoRA weights drawn from ``seed`` (``None``: peft's init, lora_B zero)."""
    from peft import LoraConfig

    with _inproc.serial():
        model = _qlora.qlora_llama()
        if second:
            model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj"]))
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.copy_(torch.randn(p.shape, generator=g))
    return model


class _Gathered(TorchDispatchMode):
    """Elements of floating dtype that this thread's all-gathers produce (the values; the pieces'
    places are int64 and ``all_gather_object``'s bytes uint8)."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "allgather" in func._opname:
            out = args[0]
            for t in out if isinstance(out, list | tuple) else [out]:
                for x in t if isinstance(t, list | tuple) else [t]:
                    if x.is_floating_point():
                        self.numel += x.numel()
        return func(*args, **(kwargs or {}))


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = f.read()
    return out


def _save_sharded(rank: int, world: int, root: str, second: bool, kwargs: dict) -> dict:
    model = _model(second=second)
    _qlora._shard(model, world)
    state = model.state_dict()
    pieces = {k: type(v).__name__ for k, v in state.items() if "lora_" in k}
    adapter = sum(math.prod(v.shape) for k, v in state.items() if "lora_" in k)
    base = sum(math.prod(v.shape) for k, v in state.items() if "lora_" not in k and v.is_floating_point())
    with _Gathered() as gathered:
        model.save_pretrained(os.path.join(root, f"rank{rank}"), **kwargs)
    model.save_pretrained(os.path.join(root, "shared"), **kwargs)  # one path on every rank, as users call it
    return {"pieces": pieces, "gathered": gathered.numel, "adapter_numel": adapter, "base_numel": base}


def _reference(root: str, second: bool, kwargs: dict) -> dict[str, bytes]:
    with _inproc.single_thread():
        _model(second=second).save_pretrained(os.path.join(root, "one"), **kwargs)
    return _files(os.path.join(root, "one"))


@pytest.mark.parametrize(
    ("second", "kwargs"),
    [(False, {}), (True, {}), (False, {"safe_serialization": False})],
    ids=["default", "two-adapters", "torch-save"],
)
def test_save_pretrained_at_w2_writes_what_peft_writes_unsharded(tmp_path, second, kwargs):
    want = _reference(str(tmp_path), second, kwargs)
    got = _inproc.run_ranks(_save_sharded, 2, args=(str(tmp_path), second, kwargs))
    assert set(got[0]["pieces"].values()) == {"PieceTensor"}  # control: the state dict holds pieces
    mine = _files(str(tmp_path / "rank0"))
    assert set(mine) == set(want)
    assert _files(str(tmp_path / "rank1")) == {}  # rank 0 writes
    assert _files(str(tmp_path / "shared")) == mine
    for name in want:
        if name.endswith(".safetensors"):
            a, b = load_file(str(tmp_path / "rank0" / name)), load_file(str(tmp_path / "one" / name))
            assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)
            assert mine[name] == want[name]  # byte for byte
        elif name.endswith(".json"):
            assert json.loads(mine[name]) == json.loads(want[name])
        elif name.endswith(".bin"):
            a = torch.load(tmp_path / "rank0" / name, weights_only=True)
            b = torch.load(tmp_path / "one" / name, weights_only=True)
            assert a.keys() == b.keys() and all(type(a[k]) is torch.Tensor and torch.equal(a[k], b[k]) for k in b)
        else:  # the model card
            assert mine[name] == want[name], name
    for r in got:  # the adapter's values (W times each entry's largest piece), nothing of the base
        assert 0 < r["gathered"] <= 2 * r["adapter_numel"] < r["base_numel"], r


def _off_route(rank: int, world: int, root: str) -> dict:
    model = _model()
    _qlora._shard(model, world)
    out: dict = {"installed": installed_torch_routes()}
    try:
        model.save_pretrained(os.path.join(root, "plain"))
    except PieceTensorError as e:
        out["error"] = str(e)
    explicit = blockshard.peft_state_dict(model)
    out["explicit_types"] = {type(v) for v in explicit.values()}
    model.save_pretrained(os.path.join(root, "explicit"), state_dict=explicit, is_main_process=rank == 0)
    return out


def test_with_the_route_off_save_pretrained_raises_and_the_explicit_call_works(tmp_path, monkeypatch):
    want = _reference(str(tmp_path), False, {})
    monkeypatch.setenv(ROUTES_ENV, "clip_grad_norm_,register_fsdp_forward_method,state_dict")
    blockshard.uninstall_torch_routes()
    try:
        got = _inproc.run_ranks(_off_route, 2, args=(str(tmp_path),))
    finally:
        monkeypatch.undo()
        blockshard.uninstall_torch_routes()
        blockshard.install_torch_routes()
    assert "peft_save_pretrained" not in got[0]["installed"]
    assert "blockshard.peft_state_dict(model)" in got[0]["error"]  # the control: peft's own path
    assert got[0]["explicit_types"] == {torch.Tensor}
    files = _files(str(tmp_path / "explicit"))
    assert files.keys() == want.keys() and files[ADAPTER] == want[ADAPTER]
    # without the route, peft names the class fully_shard swapped in (a config without task_type)
    config, wanted = json.loads(files["adapter_config.json"]), json.loads(want["adapter_config.json"])
    assert config.pop("auto_mapping")["base_model_class"] == "BlockShardLlamaForCausalLM"
    assert wanted.pop("auto_mapping")["base_model_class"] == "LlamaForCausalLM"
    assert config == wanted


# -- loading --------------------------------------------------------------------------------
def _lora_pieces(model) -> dict[str, torch.Tensor]:
    return {k: v.tensor.clone() for k, v in blockshard.sharded_state_dict(model).items() if "lora_" in k}


def _load_sharded(rank: int, world: int, path: str, how: str) -> dict:
    from peft import set_peft_model_state_dict

    expected = _model(None)  # loaded unsharded, then sharded
    set_peft_model_state_dict(expected, load_file(os.path.join(path, ADAPTER)))
    _qlora._shard(expected, world)
    model = _model(None)
    _qlora._shard(model, world)
    before = _lora_pieces(model)
    if how == "set":
        set_peft_model_state_dict(model, load_file(os.path.join(path, ADAPTER)))
    else:
        model.load_adapter(path, adapter_name="default")
    return {"want": _lora_pieces(expected), "got": _lora_pieces(model), "before": before}


@pytest.mark.parametrize("how", ["set", "load_adapter"])
def test_loading_an_adapter_into_the_sharded_model_gives_the_pieces_of_loading_then_sharding(tmp_path, how):
    with _inproc.single_thread():
        _model(7).save_pretrained(str(tmp_path))
    for r in _inproc.run_ranks(_load_sharded, 2, args=(str(tmp_path), how)):
        assert r["got"].keys() == r["want"].keys() and r["got"]
        assert all(torch.equal(r["got"][k], r["want"][k]) for k in r["want"])
        assert not all(torch.equal(r["before"][k], r["want"][k]) for k in r["want"])  # control


# -- refusals -------------------------------------------------------------------------------
def _refusals(rank: int, world: int, root: str) -> dict:
    model = _model()
    _qlora._shard(model, world)
    out = {}
    for key, call in {
        "base": lambda: blockshard.peft_state_dict(model.get_base_model()),
        "unknown": lambda: blockshard.peft_state_dict(model, ["nope"]),
        "conversion": lambda: model.save_pretrained(root, path_initial_model_for_weight_conversion=root),
    }.items():
        with pytest.raises(ShardingError) as e:
            call()
        out[key] = str(e.value)
    return out


def test_refusals_name_the_value_and_the_fix(tmp_path):
    got = _inproc.run_ranks(_refusals, 2, args=(str(tmp_path),))[0]
    assert "the model is a BlockShardLlamaForCausalLM, not a peft PeftModel. Fix: pass the PeftModel" in got["base"]
    assert "adapters ['nope'] are not adapters of this model; its adapters are ['default']" in got["unknown"]
    assert "path_initial_model_for_weight_conversion=" in got["conversion"]
    assert "Fix: save the adapter with model.save_pretrained(path), then convert it on one process" in got["conversion"]
    assert not os.listdir(tmp_path)  # nothing written


def test_the_route_checks_peft_and_is_undone(gloo_w1, monkeypatch):
    from peft import PeftModel

    blockshard.uninstall_torch_routes()
    original, base_class = PeftModel.__dict__["save_pretrained"], PeftModel.__dict__["_get_base_model_class"]
    try:
        blockshard.fully_shard(torch.nn.Linear(3, 2))
        assert "peft_save_pretrained" in installed_torch_routes()
        assert PeftModel.__dict__["save_pretrained"] is not original
        blockshard.uninstall_torch_routes()
        assert PeftModel.__dict__["save_pretrained"] is original  # undone: peft's own objects again
        assert PeftModel.__dict__["_get_base_model_class"] is base_class

        def changed(self, save_directory, adapters=None, **kwargs):  # another signature
            raise AssertionError("not called")

        monkeypatch.setattr(PeftModel, "save_pretrained", changed)
        with pytest.raises(TorchRouteError) as e:
            blockshard.install_torch_routes()
        assert (
            "route 'peft_save_pretrained' (peft.PeftModel.save_pretrained and ._get_base_model_class) does not fit peft 0.21"
            in str(e.value)
        )
        assert "blockshard is tested on peft 0.21" in str(e.value)
        assert "state_dict=blockshard.peft_state_dict(model), is_main_process=rank == 0" in str(e.value)
        assert installed_torch_routes() == ()  # nothing changed
    finally:
        monkeypatch.undo()
        blockshard.uninstall_torch_routes()
        blockshard.install_torch_routes()
    assert PeftModel.__dict__["save_pretrained"] is not original


def _mismatched(rank: int, world: int, root: str) -> str:
    model = _model()
    _qlora._shard(model, world)
    try:
        if rank == 0:
            model.save_pretrained(root)
        else:
            blockshard.full_state_dict(model)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def test_a_rank_that_does_not_save_fails_every_rank_instead_of_a_hang(tmp_path):
    got = _inproc.run_ranks(_mismatched, 2, args=(str(tmp_path),))
    for text in got:
        assert text.startswith("CollectiveIntegrityError"), got
        assert "blockshard.peft_state_dict" in text and "blockshard.full_state_dict" in text, text
    assert not (tmp_path / ADAPTER).exists()


def _from_pretrained(rank: int, world: int, path: str, root: str) -> dict:
    from peft import PeftModel

    with _inproc.serial():
        base = _qlora.qlora_llama(lora=False)
    _qlora._shard(base, world)
    with _inproc.serial():  # builds the LoRA layers (torch's process-wide generator; no collective)
        model = PeftModel.from_pretrained(base, path)
    ids, _ = next(iter(text_batches(1, 4, 16)))
    logits = model(input_ids=ids).logits.detach().clone()
    model.save_pretrained(os.path.join(root, f"rank{rank}"))
    lora = {n: tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n}
    return {"logits": logits, "lora": lora}


def test_from_pretrained_onto_a_sharded_base_keeps_the_adapter_whole_on_every_rank(tmp_path):
    """peft injects the LoRA layers after fully_shard: their weights are outside every group (each
    rank holds them whole, frozen: is_trainable=False), so inference equals one process and the
    adapter saves as it was loaded. Training them needs them in a group: build the PeftModel first,
    then shard, and load into it (the test above)."""
    from peft import PeftModel

    with _inproc.single_thread():
        _model(7).save_pretrained(str(tmp_path / "saved"))
        base = _qlora.canonical_kernel(_qlora.qlora_llama(lora=False))  # the kernel the engine runs
        one = PeftModel.from_pretrained(base, str(tmp_path / "saved"))
        ids, _ = next(iter(text_batches(1, 4, 16)))
        want = one(input_ids=ids).logits
        shapes = {n: tuple(p.shape) for n, p in one.named_parameters() if "lora_" in n}
    got = _inproc.run_ranks(_from_pretrained, 2, args=(str(tmp_path / "saved"), str(tmp_path)))
    for r in got:
        assert torch.equal(r["logits"], want)
        assert r["lora"] == shapes  # whole tensors on every rank, no pieces
    saved, again = _files(str(tmp_path / "saved")), _files(str(tmp_path / "rank0"))
    assert again[ADAPTER] == saved[ADAPTER]
    # peft writes target_modules from a set: its order follows the process's string hashes
    assert _config(again["adapter_config.json"]) == _config(saved["adapter_config.json"]) | {"inference_mode": True}


def _config(text: str) -> dict:
    config = json.loads(text)
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return config


def _trainable_from_pretrained(rank: int, world: int, path: str) -> str:
    from peft import PeftModel

    with _inproc.serial():
        base = _qlora.qlora_llama(lora=False)
    _qlora._shard(base, world)
    with _inproc.serial():
        model = PeftModel.from_pretrained(base, path, is_trainable=True)
    ids, _ = next(iter(text_batches(1, 4, 16)))
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except blockshard.runtime.ShardingError as e:
        return str(e)
    return "trained"


def test_a_trainable_adapter_injected_after_fully_shard_raises_on_every_rank(tmp_path):
    """[Note: parameters added after fully_shard]: is_trainable=True would train each rank's LoRA
    copy on its own batch, unaveraged (measured: the ranks' weights differ after one step); every
    rank raises at the forward, naming a LoRA weight and the fix (build the PeftModel first)."""
    with _inproc.single_thread():
        _model(7).save_pretrained(str(tmp_path / "saved"))
    for msg in _inproc.run_ranks(_trainable_from_pretrained, 2, args=(str(tmp_path / "saved"),)):
        assert "added under a sharded module after fully_shard" in msg and "lora_A" in msg, msg
        assert "build the PeftModel first" in msg

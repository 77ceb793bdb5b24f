"""Spawned-rank runs for test_safetensors_loading.py: a tiny HF Llama saved with
``save_pretrained`` (several safetensors files and their index), built on the meta device,
sharded per layer, materialized and filled by ``blockshard.load_safetensors``."""

from __future__ import annotations

import torch

import blockshard


def config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96, hidden_size=24, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie, attn_implementation="eager",
    )  # fmt: skip


def _logits(model) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % 96
    return model(input_ids=ids).logits.detach()


def save(_rank: int, _world: int, path: str, tie: bool) -> dict:
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = LlamaForCausalLM(config(tie))
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")  # several files + index
    back = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return {"state": {k: v.clone() for k, v in back.state_dict().items()}, "logits": _logits(back)}


def load(rank: int, world: int, path: str, tie: bool) -> dict:
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("meta"):
        model = LlamaForCausalLM(config(tie))
    for layer in model.model.layers:
        blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    model.to_empty(device="cpu")
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)  # its buffer is not saved: recomputed
    report = blockshard.load_safetensors(model, path)
    groups = [m._blockshard_state.buffers for m in model.modules() if blockshard.is_sharded(m)]
    return {
        "state": blockshard.full_state_dict(model),
        "read_bytes": report.read_bytes,
        "held_bytes": sum(sp.local_numel * 4 for g in groups for sp in g.params),
        "model_bytes": sum(p.numel() * 4 for p in LlamaForCausalLM(config(tie)).parameters()),
        "logits": _logits(model.eval()),
    }

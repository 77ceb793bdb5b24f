"""Spawned-rank runs for test_hf_models.py: Hugging Face architectures built from tiny configs in
code (nothing downloaded), sharded as an FSDP2 user shards them (``fully_shard`` on every block
class of ``model._no_split_modules`` except the ``*Embeddings`` ones, then the root), trained
``STEPS`` AdamW steps with the whole batch on every rank. One spawn of W = 2 runs every case; each
rank also runs the one-process references of half of the architectures (no collectives, one thread:
the same arithmetic as a separate process), so the test needs a single launch.
"""

from __future__ import annotations

import os
import time

import torch

import blockshard

STEPS = 2
V, H, L, NH, FF, SEQ, B = 128, 32, 2, 4, 64, 8, 2
COMMON = {"vocab_size": V, "hidden_size": H, "num_hidden_layers": L, "num_attention_heads": NH, "intermediate_size": FF}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def build(arch: str) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    if arch == "gpt2":  # tied wte / lm_head, Conv1D weights stored (in, out)
        config = T.GPT2Config(n_embd=H, n_layer=L, n_head=NH, vocab_size=V, n_positions=32, bos_token_id=0,
                              eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return T.GPT2LMHeadModel(config)
    if arch == "bert":  # token-type and position embeddings, MLM head tied to the word embeddings
        return T.BertForMaskedLM(T.BertConfig(**COMMON, max_position_embeddings=32, **NO_DROPOUT))
    if arch == "t5":  # encoder-decoder, one shared embedding, relative position bias
        config = T.T5Config(vocab_size=V, d_model=H, d_ff=FF, num_layers=L, num_heads=NH, d_kv=8, dropout_rate=0.0,
                            decoder_start_token_id=0)  # fmt: skip
        return T.T5ForConditionalGeneration(config)
    if arch == "gemma2":  # soft-capping, tied, sliding window
        config = T.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4)  # fmt: skip
        return T.Gemma2ForCausalLM(config)
    if arch == "mixtral":  # stacked experts (E, 2I, H) and (E, H, I)
        config = T.MixtralConfig(**COMMON, num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4,
                                 num_experts_per_tok=2)  # fmt: skip
        return T.MixtralForCausalLM(config)
    if arch == "lora_llama":  # peft LoRA: a frozen base, trainable adapters in every layer's group
        import peft

        base = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, num_key_value_heads=2, max_position_embeddings=32))
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    raise ValueError(f"arch={arch!r} is not one of these runs'")


def batch(arch: str, step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(4, V, (B, SEQ), generator=g)
    if arch == "bert":
        labels = ids.clone()
        labels[:, ::2] = -100
        return {
            "input_ids": ids,
            "labels": labels,
            "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(B, SEQ),
        }
    if arch == "t5":
        return {"input_ids": ids, "labels": torch.randint(4, V, (B, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules an FSDP2 user shards first: ``_no_split_modules`` classes but the embeddings (tied
    to the head, they stay with the root)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(inner._no_split_modules or ())
    return [m for m in model.modules() if type(m).__name__ in names and not type(m).__name__.endswith("Embeddings")]


def _optimizers(model: torch.nn.Module, muon: bool, sharded: bool) -> list[torch.optim.Optimizer]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not muon:
        return [torch.optim.AdamW(params, lr=1e-2)]
    from blockshard.optim import OwnerComputeOptimizer, muon_param_groups

    muon_group, rest = muon_param_groups(model, experts=False)  # the case: a rank holds no 2-D matrix
    if sharded:
        opt = OwnerComputeOptimizer(lambda groups: torch.optim.Muon(groups, lr=0.02), [muon_group])
    else:
        opt = torch.optim.Muon([muon_group], lr=0.02)
    return [opt, torch.optim.AdamW([rest], lr=1e-2)]


def train(arch: str, engine: str, *, semantics: object = None, mp: bool = False, muon: bool = False,
          checkpointing: bool = False, export: bool = False) -> dict:  # fmt: skip
    """``engine``: "single" (one process, no sharding), "blockshard" or "fsdp2" (stock); ``export``:
    also save (:func:`_export`)."""
    model = build(arch)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kw: dict = {}
    if mp:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if semantics == "muon_groups":
        from blockshard.optim import muon_param_groups, optimizer_semantics

        semantics = optimizer_semantics(muon_param_groups(model, experts=False))  # as before issue 22
    if semantics is not None:
        kw["semantics"] = semantics
    if engine != "single":
        if engine == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            fully_shard = blockshard.fully_shard
        for block in blocks(model):
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    opts = _optimizers(model, muon, engine != "single")
    held = [len(g["params"]) for g in opts[0].param_groups] if muon else []
    losses = []
    for step in range(STEPS):
        loss = model(**batch(arch, step)).loss
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "state": _full(model, engine), "muon_held": held}
    if export and engine == "blockshard":
        out |= _export(model)
    if engine == "blockshard":
        out["generated"] = _generate(model, arch)
    return out


def _full(model: torch.nn.Module, engine: str) -> dict:
    if engine == "blockshard":
        state = blockshard.full_state_dict(model)
    elif engine == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        state = model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def _export(model: torch.nn.Module) -> dict:
    """``blockshard.save_pretrained``, loaded back by the test with ``from_pretrained``."""
    blockshard.save_pretrained(model, os.environ["BLOCKSHARD_HF_EXPORT"])
    return {}


def _generate(model: torch.nn.Module, arch: str) -> torch.Tensor | None:
    """Greedy ``generate`` with the KV cache on the sharded model (forward only). T5's calls its
    encoder directly and peft's the base model's ``generate``, both outside the root's forward:
    ``register_forward_method`` gathers the root's parameters (the embedding) for the whole call
    (as FSDP2's ``register_fsdp_forward_method``)."""
    if arch not in GENERATE:
        return None
    if arch != "gpt2":
        blockshard.register_forward_method(model, "generate")
    model.eval()
    with torch.no_grad():
        prompt = batch(arch, 9)["input_ids"][:, :4]
        tokens = model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True)
    model.train()
    return tokens


# (name, arch, engine, options): the W = 2 cases; "ref" names the one-process reference to compare with
CASES = [
    ("gpt2", "gpt2", {"export": True}),
    ("gpt2_mp", "gpt2", {"mp": True}),
    ("bert", "bert", {}),
    ("t5", "t5", {}),
    ("gemma2", "gemma2", {}),
    ("mixtral", "mixtral", {}),
    ("mixtral_muon", "mixtral", {"semantics": "muon_groups", "muon": True}),
    ("mixtral_expert_grids", "mixtral", {"semantics": "muon"}),
    ("mixtral_checkpointing", "mixtral", {"checkpointing": True}),
    ("lora_llama", "lora_llama", {}),
]
GENERATE = ["gpt2", "t5", "lora_llama"]
FSDP2_CASES = ["gpt2_mp", "t5"]  # also run on stock FSDP2 (the reference under mp; T5: see the test)


def run(rank: int, world: int, export_dir: str) -> dict:
    os.environ["BLOCKSHARD_HF_EXPORT"] = export_dir
    out: dict = {"seconds": {}}
    for name, arch, options in CASES:
        t = time.perf_counter()
        out[name] = train(arch, "blockshard", **options)
        if name in FSDP2_CASES:
            out[name + "/fsdp2"] = train(arch, "fsdp2", **options)
        out["seconds"][name] = time.perf_counter() - t
    singles = [(name, arch, o) for name, arch, o in CASES if not o.get("mp")]
    for name, arch, options in singles[rank::world]:  # this rank's share of the references
        t = time.perf_counter()
        out[name + "/single"] = train(arch, "single", **{k: v for k, v in options.items() if k != "semantics"})
        out["seconds"][name + "/single"] = time.perf_counter() - t
    return out

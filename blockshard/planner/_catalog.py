"""Shapes of real models: a catalog of published configs and an HF ``config.json`` reader.

The planner never builds a model: it needs the parameter list (name, shape, dtype, group) and
nothing else. This module turns a Hugging Face–style config dict into that list, with the
names, shapes, order and owning-module class names that ``transformers`` 5.x gives the same model
(``model.layers.0.self_attn.q_proj.weight``, Linear weights as ``(out_features, in_features)``).
Only parameters are listed (no buffers such as ``rotary_emb.inv_freq`` or DeepSeek's
``e_score_correction_bias``); with ``tie_word_embeddings`` the ``lm_head.weight`` is omitted, as
``named_parameters()`` omits it.

MoE experts follow transformers 5.x: one module per layer holding the experts stacked as 3-D
parameters, not one ``nn.Linear`` per expert:

- Mixtral / DeepSeek-V3: ``mlp.experts.gate_up_proj`` ``(E, 2*I, H)`` and ``mlp.experts.down_proj``
  ``(E, H, I)`` (each expert's slice is ``(out, in)`` like a Linear weight).
- GPT-OSS: transposed, ``gate_up_proj`` ``(E, H, 2*I)`` and ``down_proj`` ``(E, I, H)`` (``(in, out)``),
  plus ``gate_up_proj_bias`` ``(E, 2*I)`` and ``down_proj_bias`` ``(E, H)``.

Every tensor gets ``dtype="bfloat16"`` (the training dtype the planner lays out), although
transformers keeps DeepSeek-V3's router ``mlp.gate.weight`` in float32 when loading in bf16
(``_keep_in_fp32_modules_strict``). ``group`` is :func:`default_group`: one group per transformer
block plus the root group ``""``, as FSDP2 is applied per block and then to the root.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, overload

from blockshard._errors import ShapesError
from blockshard._limits import MAX_MODEL_TENSORS, MAX_TENSOR_NUMEL, big_number
from blockshard.planner._json_file import read_json_file
from blockshard.planner._units import check_model_tensors
from blockshard.semantics._spec import TensorSpec

__all__ = [
    "catalog_config",
    "catalog_models",
    "default_group",
    "model_tensors",
    "supported_model_types",
    "tensors_from_hf_config",
]

_NUMERIC = re.compile(r"[0-9]+")


def default_group(param_name: str) -> str:
    """The FSDP group of ``param_name``: the prefix up to its first purely numeric component.

    ``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``; a name without a numeric
    component (embeddings, final norm, ``lm_head``) belongs to the root group ``""``.
    """
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if _NUMERIC.fullmatch(part):
            return ".".join(parts[: i + 1])
    return ""


# --------------------------------------------------------------------------------------------
# The catalog: published hyperparameters (the shape-relevant keys of each model's config.json).
# --------------------------------------------------------------------------------------------

_CATALOG: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    # meta-llama/Llama-3.1-405B
    "llama3-405b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen2.5-7B (q/k/v projections carry biases)
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-8B (per-head q_norm / k_norm)
    "qwen3-8b": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V3 (the MTP layer, num_nextn_predict_layers=1, is not part of the HF model)
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "num_nextn_predict_layers": 1,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    # openai/gpt-oss-120b
    "gpt-oss-120b": {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "attention_bias": True,
        "tie_word_embeddings": False,
    },
}


def catalog_models() -> list[str]:
    """Names of the models in the catalog (``"llama3-8b"``, ``"deepseek-v3"``, ...)."""
    return list(_CATALOG)


def catalog_config(name: str) -> dict[str, Any]:
    """A copy of the HF-style config dict of catalog model ``name``."""
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in _CATALOG:
        raise ShapesError(
            f"catalog model {name!r} is unknown; known models: {', '.join(_CATALOG)}. "
            "Use one of these names, or pass a config.json path or a shapes file instead"
        )
    return copy.deepcopy(_CATALOG[key])


def model_tensors(name: str) -> list[TensorSpec]:
    """The parameter list of catalog model ``name``."""
    return tensors_from_hf_config(catalog_config(name), _source=f"catalog model {name!r}")


# --------------------------------------------------------------------------------------------
# Config access with errors that name the source, the key, the value and the fix.
# --------------------------------------------------------------------------------------------


class _Cfg:
    def __init__(self, data: Mapping[str, Any], source: str, model_type: str) -> None:
        self.data, self.source, self.model_type = data, source, model_type

    def _where(self) -> str:
        return f"{self.source} (model_type={self.model_type!r})"

    def _check_int(self, key: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ShapesError(
                f"{self._where()}: {key}={value!r} must be an integer >= {minimum}; "
                f"fix the value of {key!r} in the config"
            )
        if value > MAX_TENSOR_NUMEL:
            raise ShapesError(
                f"{self._where()}: {key}={big_number(value)} is more than {MAX_TENSOR_NUMEL:,} (2**48), the most "
                f"elements one tensor may have; fix the value of {key!r} in the config"
            )
        return value

    def req(self, key: str, *aliases: str, minimum: int = 1) -> int:
        """A required integer (``aliases`` are the other spellings transformers accepts)."""
        for k in (key, *aliases):
            if self.data.get(k) is not None:
                return self._check_int(k, self.data[k], minimum)
        also = f" (or {', '.join(repr(a) for a in aliases)})" if aliases else ""
        raise ShapesError(
            f"{self._where()}: required key {key!r}{also} is missing; "
            f"add it to the config (see the model's published config.json)"
        )

    @overload
    def opt(self, key: str, default: int, *, minimum: int = 1) -> int: ...
    @overload
    def opt(self, key: str, default: None, *, minimum: int = 1) -> int | None: ...
    def opt(self, key: str, default: int | None, *, minimum: int = 1) -> int | None:
        """An optional integer; a missing or ``null`` value gives ``default`` (so an int default gives an int)."""
        value = self.data.get(key)
        return default if value is None else self._check_int(key, value, minimum)

    def layers(self, per_layer: int) -> int:
        """``num_hidden_layers``, refused up front if its layers (``per_layer`` tensors or more each) would
        pass ``MAX_MODEL_TENSORS`` (a config with 10**6 layers would otherwise build them all first)."""
        layers = self.req("num_hidden_layers")
        if layers * per_layer > MAX_MODEL_TENSORS:
            raise ShapesError(
                f"{self._where()}: num_hidden_layers={big_number(layers)} gives {per_layer} tensors or more per "
                f"layer, more than the {MAX_MODEL_TENSORS:,} tensors blockshard plans at once; fix the value of "
                "'num_hidden_layers' in the config (or plan fewer layers)"
            )
        return layers

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ShapesError(f"{self._where()}: {key}={value!r} must be true or false; fix it in the config")
        return value

    def head_dim(self, hidden: int, heads: int) -> int:
        """``head_dim`` if given, else ``hidden_size // num_attention_heads`` (as transformers)."""
        return self.opt("head_dim", None) or hidden // heads


class _Builder:
    """Collects TensorSpecs in ``named_parameters()`` order."""

    def __init__(self, source: str) -> None:
        self.out: list[TensorSpec] = []
        self.source = source

    def param(self, name: str, shape: tuple[int, ...], module_type: str) -> None:
        if len(self.out) >= MAX_MODEL_TENSORS:  # e.g. num_hidden_layers=1000000: stop before building them all
            check_model_tensors(len(self.out) + 1, f"the model of {self.source} (stopped at {name!r})")
        try:
            spec = TensorSpec(
                name=name, shape=shape, dtype="bfloat16", group=default_group(name), module_type=module_type
            )
        except ShapesError as e:  # e.g. dims whose product passes the limit: say which config
            raise ShapesError(f"{self.source}: {e}; fix the config's sizes") from None
        self.out.append(spec)

    def linear(self, prefix: str, in_f: int, out_f: int, bias: bool = False) -> None:
        self.param(f"{prefix}.weight", (out_f, in_f), "Linear")
        if bias:
            self.param(f"{prefix}.bias", (out_f,), "Linear")

    def norm(self, prefix: str, dim: int, cls: str) -> None:
        self.param(f"{prefix}.weight", (dim,), cls)

    def swiglu(self, prefix: str, hidden: int, inter: int, bias: bool = False) -> None:
        self.linear(f"{prefix}.gate_proj", hidden, inter, bias)
        self.linear(f"{prefix}.up_proj", hidden, inter, bias)
        self.linear(f"{prefix}.down_proj", inter, hidden, bias)


# --------------------------------------------------------------------------------------------
# Generators, one per model_type. They mirror the modules' __init__ in modeling_<type>.py.
# --------------------------------------------------------------------------------------------

_NORM_CLASS = {
    "llama": "LlamaRMSNorm",
    "qwen2": "Qwen2RMSNorm",
    "qwen3": "Qwen3RMSNorm",
    "mixtral": "MixtralRMSNorm",
    "deepseek_v3": "DeepseekV3RMSNorm",
    "gpt_oss": "GptOssRMSNorm",
}


def _gqa_decoder(c: _Cfg) -> list[TensorSpec]:
    """llama, qwen2, qwen3, mixtral and gpt_oss: GQA attention + dense or MoE feed-forward."""
    mt = c.model_type
    norm_cls = _NORM_CLASS[mt]
    vocab, hidden = c.req("vocab_size"), c.req("hidden_size")
    inter, layers = c.req("intermediate_size"), c.layers(per_layer=9)  # 4 attention, >= 3 mlp, 2 norms
    heads = c.req("num_attention_heads")
    kv_heads = c.opt("num_key_value_heads", heads)
    head_dim = c.head_dim(hidden, heads)
    if mt == "qwen2":  # q/k/v always carry a bias, o_proj never
        qkv_bias, o_bias = True, False
    elif mt == "mixtral":
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = c.flag("attention_bias", mt == "gpt_oss")
    mlp_bias = c.flag("mlp_bias", False) if mt == "llama" else False
    experts = c.req("num_local_experts", "num_experts") if mt in ("mixtral", "gpt_oss") else 0

    b = _Builder(c.source)
    b.param("model.embed_tokens.weight", (vocab, hidden), "Embedding")
    for i in range(layers):
        p = f"model.layers.{i}"
        if mt == "gpt_oss":  # the attention module's own parameter comes before its children
            b.param(f"{p}.self_attn.sinks", (heads,), "GptOssAttention")
        b.linear(f"{p}.self_attn.q_proj", hidden, heads * head_dim, qkv_bias)
        b.linear(f"{p}.self_attn.k_proj", hidden, kv_heads * head_dim, qkv_bias)
        b.linear(f"{p}.self_attn.v_proj", hidden, kv_heads * head_dim, qkv_bias)
        b.linear(f"{p}.self_attn.o_proj", heads * head_dim, hidden, o_bias)
        if mt == "qwen3":
            b.norm(f"{p}.self_attn.q_norm", head_dim, norm_cls)
            b.norm(f"{p}.self_attn.k_norm", head_dim, norm_cls)
        if mt == "mixtral":
            b.param(f"{p}.mlp.gate.weight", (experts, hidden), "MixtralTopKRouter")
            b.param(f"{p}.mlp.experts.gate_up_proj", (experts, 2 * inter, hidden), "MixtralExperts")
            b.param(f"{p}.mlp.experts.down_proj", (experts, hidden, inter), "MixtralExperts")
        elif mt == "gpt_oss":
            b.param(f"{p}.mlp.router.weight", (experts, hidden), "GptOssTopKRouter")
            b.param(f"{p}.mlp.router.bias", (experts,), "GptOssTopKRouter")
            b.param(f"{p}.mlp.experts.gate_up_proj", (experts, hidden, 2 * inter), "GptOssExperts")
            b.param(f"{p}.mlp.experts.gate_up_proj_bias", (experts, 2 * inter), "GptOssExperts")
            b.param(f"{p}.mlp.experts.down_proj", (experts, inter, hidden), "GptOssExperts")
            b.param(f"{p}.mlp.experts.down_proj_bias", (experts, hidden), "GptOssExperts")
        else:
            b.swiglu(f"{p}.mlp", hidden, inter, mlp_bias)
        b.norm(f"{p}.input_layernorm", hidden, norm_cls)
        b.norm(f"{p}.post_attention_layernorm", hidden, norm_cls)
    b.norm("model.norm", hidden, norm_cls)
    if not c.flag("tie_word_embeddings", False):
        b.linear("lm_head", hidden, vocab)
    return b.out


def _deepseek_v3(c: _Cfg) -> list[TensorSpec]:
    """DeepSeek-V3: MLA attention, ``first_k_dense_replace`` dense layers, then routed + shared experts."""
    norm_cls = _NORM_CLASS["deepseek_v3"]
    vocab, hidden = c.req("vocab_size"), c.req("hidden_size")
    inter, moe_inter = c.req("intermediate_size"), c.req("moe_intermediate_size")
    layers, heads = c.layers(per_layer=8), c.req("num_attention_heads")  # >= 4 attention, 2 mlp, 2 norms
    q_lora = c.opt("q_lora_rank", None)  # None: a plain q_proj instead of q_a/q_b
    kv_lora = c.req("kv_lora_rank")
    nope, rope = c.req("qk_nope_head_dim"), c.req("qk_rope_head_dim")
    v_dim = c.req("v_head_dim")
    experts = c.req("n_routed_experts", "num_local_experts")
    shared = c.opt("n_shared_experts", 0, minimum=0) or 0
    first_dense = c.opt("first_k_dense_replace", 0, minimum=0) or 0
    bias = c.flag("attention_bias", False)
    qk = nope + rope

    b = _Builder(c.source)
    b.param("model.embed_tokens.weight", (vocab, hidden), "Embedding")
    for i in range(layers):
        a = f"model.layers.{i}.self_attn"
        if q_lora is None:
            b.linear(f"{a}.q_proj", hidden, heads * qk)
        else:
            b.linear(f"{a}.q_a_proj", hidden, q_lora, bias)
            b.norm(f"{a}.q_a_layernorm", q_lora, norm_cls)
            b.linear(f"{a}.q_b_proj", q_lora, heads * qk)
        b.linear(f"{a}.kv_a_proj_with_mqa", hidden, kv_lora + rope, bias)
        b.norm(f"{a}.kv_a_layernorm", kv_lora, norm_cls)
        b.linear(f"{a}.kv_b_proj", kv_lora, heads * (nope + v_dim))
        b.linear(f"{a}.o_proj", heads * v_dim, hidden, bias)
        m = f"model.layers.{i}.mlp"
        if i < first_dense:
            b.swiglu(m, hidden, inter)
        else:
            b.param(f"{m}.experts.gate_up_proj", (experts, 2 * moe_inter, hidden), "DeepseekV3Experts")
            b.param(f"{m}.experts.down_proj", (experts, hidden, moe_inter), "DeepseekV3Experts")
            b.param(f"{m}.gate.weight", (experts, hidden), "DeepseekV3TopkRouter")
            b.swiglu(f"{m}.shared_experts", hidden, moe_inter * shared)
        b.norm(f"model.layers.{i}.input_layernorm", hidden, norm_cls)
        b.norm(f"model.layers.{i}.post_attention_layernorm", hidden, norm_cls)
    b.norm("model.norm", hidden, norm_cls)
    if not c.flag("tie_word_embeddings", False):
        b.linear("lm_head", hidden, vocab)
    return b.out


_GENERATORS: dict[str, Callable[[_Cfg], list[TensorSpec]]] = {
    "llama": _gqa_decoder,
    "qwen2": _gqa_decoder,
    "qwen3": _gqa_decoder,
    "mixtral": _gqa_decoder,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gqa_decoder,
}
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
}


def supported_model_types() -> list[str]:
    """The ``model_type`` values :func:`tensors_from_hf_config` understands."""
    return list(_GENERATORS)


def _read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    data = read_json_file(
        p,
        "config file",
        missing_fix="pass the path of a model's config.json",
        format_fix="fix the file or pass a model's config.json",
    )
    if not isinstance(data, dict):
        raise ShapesError(
            f"config file {p!r} holds a JSON {type(data).__name__}, not an object; "
            "a config.json is a JSON object with keys such as 'model_type' and 'hidden_size'"
        )
    return data


def _json_kind(value: object) -> str:
    kinds = {dict: "object", list: "array", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), type(value).__name__)


def _model_type_of(data: Mapping[str, Any], source: str) -> str:
    supported = ", ".join(_GENERATORS)
    mt = data.get("model_type")
    if mt is None:
        archs = data.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        if not isinstance(archs, list):
            raise ShapesError(
                f"{source}: architectures={archs!r} must be a list of class names such as "
                f'["LlamaForCausalLM"]; fix it or add "model_type" (one of: {supported})'
            )
        known = [_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in _ARCHITECTURES]
        if known:
            return known[0]
        raise ShapesError(
            f"{source}: no 'model_type' and architectures={data.get('architectures')!r} names none "
            f'of {", ".join(_ARCHITECTURES)}; add "model_type" (one of: {supported})'
        )
    if not isinstance(mt, str):
        raise ShapesError(
            f"{source}: model_type={mt!r} is a JSON {_json_kind(mt)}, not a string; write it as one string, "
            f'e.g. "model_type": "llama" (supported: {supported})'
        )
    if mt not in _GENERATORS:
        raise ShapesError(
            f"{source}: model_type={mt!r} is not supported; supported model types: {supported}. "
            'For other models, write a shapes file ({"tensors": [{"name", "shape"}]})'
        )
    return mt


def tensors_from_hf_config(
    config: Mapping[str, Any] | str | os.PathLike[str], *, _source: str | None = None
) -> list[TensorSpec]:
    """The parameter list of the model a Hugging Face config describes.

    Args:
        config: a config dict, or the path of a ``config.json`` (or of the folder holding it).
            Dispatches on ``model_type``; a config with only ``architectures`` (e.g.
            ``["LlamaForCausalLM"]``) works too. Optional keys take transformers' defaults.
    """
    if isinstance(config, (str, os.PathLike)):
        source = f"config file {os.fspath(config)!r}"
        data: Mapping[str, Any] = _read_config_file(config)
    elif isinstance(config, Mapping):
        source, data = _source or "config dict", config
    else:
        raise ShapesError(
            f"config={config!r} is a {type(config).__name__}; pass a config dict or the path of a config.json"
        )
    model_type = _model_type_of(data, source)
    tensors = _GENERATORS[model_type](_Cfg(data, source, model_type))
    assert tensors, "a generator always emits the embedding"
    return tensors

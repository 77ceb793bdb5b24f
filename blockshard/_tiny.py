"""Tiny models and data built in code (no downloads), deterministic across processes.

For the ragged engine's tests, the demo and benchmarks. Shapes are deliberately awkward: row counts
such as 257 (vocabulary: 256 bytes + 1 spare id), 89 (MLP width), 37, 29, 13 and 7 are not multiples of
2, 3 or 4, so sharding at W in {2, 3, 4} is ragged, and matrices such as 89 x 48 = 4272 elements are
not multiples of 256-element quantization blocks.

Every constructor seeds its own RNG stream (``torch.manual_seed(seed)`` inside ``torch.random.fork_rng``)
so the same seed gives identical weights in every process and the caller's global RNG is untouched.
``import blockshard._tiny`` is cheap: transformers is imported only inside :func:`tiny_llama` and
:func:`tiny_mixtral`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, MixtralForCausalLM

__all__ = [
    "TEXT",
    "FP8BlockWeight",
    "OddMLP",
    "dequantize_fp8_block",
    "mlp_batches",
    "quantize_fp8_block",
    "text_batches",
    "tiny_llama",
    "tiny_mixtral",
]

E4M3_MAX = 448.0

# Self-written English text (ASCII), tokenized byte-level: list(TEXT.encode()).
TEXT = """\
The lighthouse keeper kept a ledger of every ship that passed the point. Most nights the entries were
short: a trawler heading home, a ferry running late, a yacht whose crew waved at the lamp as if it could
wave back. On stormy nights the entries grew longer, and the handwriting grew worse, because the keeper
wrote them standing up, one hand on the rail and one eye on the sea.

In the spring a young engineer arrived with a crate of instruments and a plan to replace the old lamp
with one that would run by itself. She measured the tower, counted the steps, and timed the rotation of
the lens with a stopwatch. The keeper watched her work and said nothing for three days. On the fourth day
he asked her what the new lamp would do when the power failed. She said it would switch to a battery.
He asked what it would do when the battery failed. She said it would send a message to the harbour.
He asked who would read the message at three in the morning, and she did not have an answer.

They agreed to keep both lamps for one winter. The new one turned smoothly and never needed oil; the old
one needed oil every evening and a clean glass every morning. In December a storm took out the cable
from the mainland for two nights. The battery held for the first night. On the second night the keeper
lit the old lamp, wound the clockwork, and sat beside it until dawn, writing down the ships by hand.

When the engineer came back in March she read the ledger from the first page to the last. She did not
remove the old lamp. Instead she built a small bracket beside it for a second battery and a switch that
anyone could understand, and she wrote the instructions on a card in large letters: turn this, then wait
ten seconds, then look up. The keeper pinned the card to the wall next to the tide tables.

Years later, when the station was automated and the keeper had retired to a cottage in the village, a
visitor asked him whether he missed the work. He said he missed the ledger. There is a kind of attention,
he said, that only comes from writing things down one at a time, in order, with nothing skipped. A
machine can count ships. It takes a person to notice that the same small boat goes out every Tuesday
and comes back a little later each week, and to wonder, and then one Tuesday to walk down to the harbour
and ask.
"""

_TOKENS = list(TEXT.encode())


def tiny_llama(
    seed: int = 0,
    *,
    vocab_size: int = 257,
    hidden_size: int = 48,
    intermediate_size: int = 89,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
) -> LlamaForCausalLM:
    """A tiny ``transformers.LlamaForCausalLM`` (float32, eager attention, no dropout, untied head).

    The config is built in code; ``vocab_size=257`` covers the byte tokens of :func:`text_batches`.
    The same ``seed`` gives identical weights in every process. Returns the model in train mode.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        # PreTrainedConfig pops attn_implementation from **kwargs; LlamaConfig's typed __init__ omits it
        attn_implementation="eager",  # type: ignore[call-arg]
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    trained: LlamaForCausalLM = model.float().train()  # transformers' float() is unannotated
    return trained


def tiny_mixtral(seed: int = 0) -> MixtralForCausalLM:
    """A tiny ``transformers.MixtralForCausalLM`` (float32, eager attention): one decoder layer, vocabulary
    64, 3 experts stacked as ``mlp.experts.gate_up_proj`` ``(3, 48, 16)`` and ``down_proj`` ``(3, 16, 24)``
    (module class ``MixtralExperts``). The config is built in code; the same ``seed`` gives identical
    weights in every process. Returns the model in train mode."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        num_local_experts=3,
        num_experts_per_tok=2,
        attn_implementation="eager",  # type: ignore[call-arg]  # popped from **kwargs, as in tiny_llama
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MixtralForCausalLM(config)
    trained: MixtralForCausalLM = model.float().train()  # transformers' float() is unannotated
    return trained


class OddMLP(nn.Module):
    """13 -> 37 (LayerNorm, GELU) -> 29 (GELU) -> 7, biases on; ``.blocks`` holds the three blocks
    (an ``nn.ModuleList``) so each can be sharded separately. Same ``seed``, same weights."""

    in_features = 13
    out_features = 7

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            ln = nn.LayerNorm(37)  # draws no random numbers: the Linear layers get the same weights
            self.blocks = nn.ModuleList(
                [
                    nn.Sequential(nn.Linear(13, 37), ln, nn.GELU()),
                    nn.Sequential(nn.Linear(37, 29), nn.GELU()),
                    nn.Sequential(nn.Linear(29, 7)),
                ]
            )
            # Non-trivial LayerNorm affine parameters (defaults are all ones / zeros).
            nn.init.normal_(ln.weight, mean=1.0, std=0.1)
            nn.init.normal_(ln.bias, mean=0.0, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def text_batches(
    num_steps: int, batch_size: int, seq_len: int, *, seed: int = 0, vocab_size: int = 256
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_steps`` batches of (input_ids, labels), int64 ``[batch_size, seq_len]``, windows of the
    bundled :data:`TEXT` (byte tokens) at start offsets drawn from ``seed``. ``labels`` equals
    ``input_ids`` (HF causal LMs shift internally). Token ids are taken modulo ``vocab_size`` (a no-op
    for ``vocab_size >= 128``: the text is ASCII)."""
    _check_int("num_steps", num_steps, 0)
    _check_int("batch_size", batch_size, 1)
    _check_int("vocab_size", vocab_size, 1)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= len(_TOKENS):
        raise ValueError(f"seq_len={seq_len!r} must be an int in [1, {len(_TOKENS)}] (the bundled text's length)")
    tokens = torch.tensor(_TOKENS, dtype=torch.int64) % vocab_size
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_steps):
        starts = torch.randint(0, len(_TOKENS) - seq_len + 1, (batch_size,), generator=gen)
        ids = torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])
        batches.append((ids, ids.clone()))
    return batches


def mlp_batches(num_steps: int, batch_size: int, *, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_steps`` regression batches (x float32 ``[batch_size, 13]``, y float32 ``[batch_size, 7]``)
    for :class:`OddMLP`: y is a fixed random teacher ``tanh(x @ A)`` plus a little noise, all from ``seed``."""
    _check_int("num_steps", num_steps, 0)
    _check_int("batch_size", batch_size, 1)
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(13, 7, generator=gen) / 13**0.5
    batches = []
    for _ in range(num_steps):
        x = torch.randn(batch_size, 13, generator=gen)
        y = torch.tanh(x @ teacher) + 0.05 * torch.randn(batch_size, 7, generator=gen)
        batches.append((x, y))
    return batches


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """A pure-torch blockwise FP8 quantizer (DeepSeek-V3's layout): one fp32 scale per
    ``block`` tile (``amax / 448``), the payload ``float8_e4m3fn``; returns ``(weight, weight_scale_inv)``.
    A 3-D ``w`` is stacked experts, quantized expert by expert."""
    if w.dim() == 3:
        pairs = [quantize_fp8_block(e, block) for e in w]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    (N, K), (br, bc) = w.shape, block
    nb, kb = -(-N // br), -(-K // bc)
    padded = torch.zeros(nb * br, kb * bc, dtype=torch.float32)
    padded[:N, :K] = w.float()
    tiles = padded.view(nb, br, kb, bc)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).view(nb * br, kb * bc)[:N, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def dequantize_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The weight :func:`quantize_fp8_block` quantized, in ``dtype`` (3-D: stacked experts)."""
    if q.dim() == 3:
        return torch.stack([dequantize_fp8_block(e, s, block, dtype) for e, s in zip(q, scale, strict=True)])
    (N, K), (br, bc) = q.shape, block
    s = scale.repeat_interleave(br, dim=0)[:N].repeat_interleave(bc, dim=1)[:, :K]
    return (q.float() * s).to(dtype)


class FP8BlockWeight(nn.Module):
    """A frozen linear shaped like transformers' ``FP8Linear`` (float8 ``weight``, fp32
    ``weight_scale_inv``, ``block_size``) whose forward dequantizes in pure torch (``FP8Linear``'s
    needs Triton or DeepGEMM): what blockshard shards as a blockwise FP8 weight on the CPU."""

    def __init__(self, weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> None:
        super().__init__()
        self.block_size = block
        q, scale = quantize_fp8_block(weight.detach(), block)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block_size, x.dtype)
        return torch.nn.functional.linear(x, w)

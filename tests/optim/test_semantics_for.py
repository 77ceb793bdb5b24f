"""Semantics from the optimizer: which unit each parameter's optimizer needs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blockshard import SemanticsError
from blockshard._tiny import OddMLP
from blockshard.optim import BlockedShampoo, muon_param_groups, optimizer_semantics, semantics_for_optimizer


@pytest.mark.parametrize(
    ("optimizer", "spec"),
    [
        ("muon", "matrix"),
        ("AdamW", "elementwise"),
        ("shampoo:512", "shampoo:512"),
        (torch.optim.Muon, "matrix"),
        (torch.optim.AdamW, "elementwise"),
        (BlockedShampoo, "shampoo:1024"),
    ],
)
def test_known_optimizers(optimizer, spec):
    assert semantics_for_optimizer(optimizer) == spec


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_third_party_optimizers_by_class():
    import bitsandbytes as bnb
    from torchao.optim import AdamW4bit, AdamW8bit

    assert semantics_for_optimizer(bnb.optim.AdamW8bit) == "bnb8bit"
    assert semantics_for_optimizer(AdamW8bit) == "ao8bit"
    assert semantics_for_optimizer(AdamW4bit) == "ao4bit"
    p = nn.Parameter(torch.zeros(4, 4))
    assert semantics_for_optimizer(BlockedShampoo([p], lr=0.1, max_preconditioner_dim=8)) == "shampoo:8"


def test_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(SemanticsError, match=r"optimizer='lamb' is not one blockshard knows; known: .*'muon'"):
        semantics_for_optimizer("lamb")


def test_muon_groups_and_identity_rule():
    emb = nn.Embedding(11, 13)
    model = nn.ModuleDict({"embed_tokens": emb, "mlp": OddMLP()})
    groups = muon_param_groups(model)
    muon = {id(p) for p in groups[0]["params"]}
    assert id(emb.weight) not in muon  # embeddings stay with AdamW
    assert id(model["mlp"].blocks[0][0].weight) in muon  # 2-D hidden weight: Muon
    assert id(model["mlp"].blocks[0][0].bias) not in muon  # biases: AdamW
    rule = optimizer_semantics(groups)
    assert rule("anything", model["mlp"].blocks[1][0].weight) == "matrix"
    assert rule("anything", emb.weight) == "elementwise"
    assert rule("anything", nn.Parameter(torch.zeros(2))) is None  # in no group


def test_conflicting_groups_and_malformed_groups_raise():
    p = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(SemanticsError, match=r"is in two param_groups \('matrix' and 'bnb8bit'\)"):
        optimizer_semantics([{"params": [p], "optimizer": "muon"}, {"params": [p], "optimizer": "bnb8bit"}])
    with pytest.raises(SemanticsError, match=r"param_groups\[0\] has keys \['params'\]"):
        optimizer_semantics([{"params": [p]}])

"""The tie's cross term (runtime/tie.py) against a direct computation: for an embedding tied to the head, each
sample's squared gradient norm is ||g_emb||^2 + ||g_head||^2 + 2 <g_emb, g_head>; the partner's message relayed
through a middle stage and the owner's cross term must give <g_emb, g_head> exactly, from the per-sample
gradients built here by hand (one-hot rows for the embedding, the outer products for the head)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from pipedp.errors import UnsupportedModelError
from pipedp.runtime.tie import StageTie, TieRole

N, T, V, D = 3, 5, 11, 4


def stage_state(layer, inputs, backprop):
    return SimpleNamespace(calls={layer: [SimpleNamespace(inputs=(inputs,))]}, backprops={layer: [backprop]}, units=N)


def test_the_relayed_message_gives_each_samples_cross_term_exactly():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (N, T), generator=g)
    emb_grads = torch.randn(N, T, D, generator=g, dtype=torch.float64)  # the embedding's output-grads G
    head_in = torch.randn(N, T, D, generator=g, dtype=torch.float64)  # the head's inputs H
    head_grads = torch.randn(N, T, V, generator=g, dtype=torch.float64)  # the head's output-grads B
    embedding, head = nn.Embedding(V, D).double(), nn.Linear(D, V, bias=False).double()
    head.weight = embedding.weight
    owner = StageTie(TieRole("owner", "emb.weight", False), 0, {"emb": embedding})
    relay = StageTie(TieRole("relay", "", False), 1, {})
    partner = StageTie(TieRole("partner", "head.weight", False), 2, {"head": head})

    zero = torch.zeros(N, dtype=torch.float64)
    _, message = partner.after_backward(stage_state("head", head_in, head_grads), ids, zero, None)
    _, relayed = relay.after_backward(None, ids, zero, message)
    norms, nothing = owner.after_backward(stage_state("emb", ids, emb_grads), ids, zero, relayed)
    assert nothing is None and relayed is message

    for i in range(N):  # the oracle: both per-sample gradients of the shared [V, D] weight, by hand
        g_emb = torch.zeros(V, D, dtype=torch.float64).index_add_(0, ids[i], emb_grads[i])
        g_head = head_grads[i].T @ head_in[i]
        assert float(norms[i]) == pytest.approx(2 * float((g_emb * g_head).sum()), rel=1e-12, abs=1e-12)


def test_the_owner_refuses_a_message_built_from_other_ids():
    ids = torch.randint(0, V, (N, T))
    embedding = nn.Embedding(V, D).double()
    owner = StageTie(TieRole("owner", "emb.weight", False), 0, {"emb": embedding})
    state = stage_state("emb", ids, torch.zeros(N, T, D, dtype=torch.float64))
    with pytest.raises(UnsupportedModelError, match="must read the micro-batch's token ids"):
        owner.after_backward(state, (ids + 1) % V, torch.zeros(N), torch.zeros(N, T, D))

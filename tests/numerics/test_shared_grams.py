"""Gram matrices shared between layers in a real model (privacy/rules/grams.py), and the step still exact:
- Llama: gate and up read one hidden state: each layer computes its Gram once for the two (q/k/v share theirs
  too, where they take ghost norms: in these tiny configs they keep their per-sample gradients instead);
- GPT-NeoX's parallel residual: the attention's and the MLP's output projections add into one tensor, so autograd
  hands both one output-gradient: each layer computes its Gram once for the two.
"""

import copy

import pytest
import torch

pytest.importorskip("transformers")
from hf_families import CLIP, FAMILIES, build, dp_update, hf_loss, padded_batch  # noqa: E402
from oracles import loop_clipped_sum, max_relative_error  # noqa: E402

from pipedp.models import token_loss  # noqa: E402
from pipedp.privacy.rules import grams  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:step\\(\\) got a batch whose sampling is not declared")


def _step_counting_reuse(model_type, monkeypatch, **options):
    """(the DP update, the oracle's, how many Gram matrices the step read from the cache instead of computing)."""
    family = next(f for f in FAMILIES if f.model_type == model_type and not f.variant)
    model = build(family)
    inputs, labels = padded_batch("right")
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    if options.get("precision") == "bf16-true":
        model = model.to(torch.bfloat16)
    counts = {"read": 0, "computed": 0}
    read, compute = grams.GramCache.gram, grams.gram

    def reading(cache, captured, a3):
        counts["read"] += 1
        return read(cache, captured, a3)

    def computing(x):
        counts["computed"] += 1
        return compute(x)

    monkeypatch.setattr(grams, "gram", computing)
    monkeypatch.setattr(grams.GramCache, "gram", reading)
    # no self-check: its own backward passes would add reads of their own
    got = dp_update(model, token_loss, inputs, labels, grad_mode="ghost", self_check=False, **options)
    return got, want, counts["read"] - counts["computed"], model.config.num_hidden_layers


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox"])
def test_layers_reading_one_tensor_share_its_gram_and_the_step_stays_exact(model_type, monkeypatch):
    # one Gram read from the cache per layer and micro-batch (2 micro-batches): Llama's up projection reads the
    # gate's input Gram, GPT-NeoX's MLP output projection the attention output projection's output-gradient Gram
    got, want, reused, layers = _step_counting_reuse(model_type, monkeypatch)
    assert reused == layers * 2
    assert max_relative_error(got, want) < 1e-12


def test_a_bf16_parallel_residual_shares_its_output_gradient_widened_once(monkeypatch):
    # bf16 output-gradients are widened to float32 for the norms: once per gradient tensor, not per layer, or
    # the two projections would hold two copies and share nothing
    got, want, reused, layers = _step_counting_reuse("gpt_neox", monkeypatch, precision="bf16-true")
    assert reused == layers * 2
    assert max_relative_error(got, want) < 5e-2  # bf16's rounding

"""Every Hugging Face family of tests/hf_families.py, built from a tiny config with random weights:
- the pipelined forward equals the model's own forward on the whole batch (each attention
  implementation the family has, left and right padding, 2 and 3 stages);
- one DP-SGD step (float64, noise 0) equals the loop oracle, batch-size-1 passes through the model
  itself: causal LMs with tied and untied heads, 2 and 3 stages, both grad modes, left and right
  padding with shifted labels (the last padding position, which predicts the first token, scored
  too); sequence classifiers (the score read at the last token that is not padding);
- the refused families are refused at construction, naming why;
- docs/models.md holds the table rendered from the same matrix.
"""

import copy
import itertools
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_families import (  # noqa: E402
    CLIP,
    FAMILIES,
    TABLE_END,
    TABLE_START,
    build,
    dp_update,
    hf_loss,
    padded_batch,
    render_table,
    sequence_loss,
    tiny_config,
)
from oracles import loop_clipped_sum, max_relative_error  # noqa: E402

from pipedp import PipelineDPTrainer, UnsupportedModelError  # noqa: E402
from pipedp.models import token_loss  # noqa: E402
from pipedp.split.adapters import model_blocks  # noqa: E402
from pipedp.split.partition import partition  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:step\\(\\) got a batch whose sampling is not declared")

EXACT = [f for f in FAMILIES if f.exact]
REFUSED = [f for f in FAMILIES if not f.exact]
CLASSIFIERS = [f for f in EXACT if f.classification]
# pairwise: every value of each setting meets every value of each other one (stages, grad mode, tied head,
# padding side: a covering array of 5 runs); test_causal_lm_other_combinations runs the rest of the product
RUNS = [
    (2, "ghost", False, "left"),
    (2, "materialize", True, "right"),
    (3, "ghost", True, "right"),
    (3, "materialize", False, "right"),
    (3, "materialize", True, "left"),
]
OTHER_RUNS = [
    (s, m, t, p)
    for s in (2, 3)
    for m in ("ghost", "materialize")
    for t in (False, True)
    for p in ("left", "right")
    if (s, m, t, p) not in RUNS
]


def test_the_fast_runs_meet_every_pair_of_settings():
    levels = [(2, 3), ("ghost", "materialize"), (False, True), ("left", "right")]
    for i, j in itertools.combinations(range(len(levels)), 2):
        assert {(r[i], r[j]) for r in RUNS} == set(itertools.product(levels[i], levels[j]))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is faster, and spares the cores other tests share."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pipelined(model, inputs, stages):
    """The blocks run one after the other, each given the batch's inputs as the stages give them."""
    out = inputs
    for stage in partition(model_blocks(model), stages, "params"):
        for block in stage:
            out = block.module(*(out if isinstance(out, tuple) else (out,)), side_inputs=inputs)  # (as a stage spreads)
    return out


@pytest.mark.parametrize("family", EXACT, ids=lambda f: f.name)
def test_pipelined_forward_equals_the_models_own_forward(family):
    for attention in family.attention:
        for kind in ("causal", "classification") if family.classification else ("causal",):
            model = build(family, kind, attention=attention).eval()
            for side, stages, grad in (("left", 2, True), ("right", 3, False)):
                inputs, _ = padded_batch(side)
                want = model(**inputs).logits
                with torch.set_grad_enabled(grad):  # as in a step, and as in an evaluation
                    got = pipelined(model, inputs, stages)
                # eager attention's own output is NaN at a left-padded query that sees no key: the same NaN
                assert torch.equal(got.isnan(), want.isnan()), (attention, kind, side)
                # equal to float64 rounding (the stages' calls round differently, 2e-16 on GPT-2), or to float32's
                # where the family computes in float32 inside: its norms, or GPT-J's and CodeGen's eager attention
                # (query and key cast to float32, which turns a 1e-17 difference into a 1e-10 one)
                bound = 1e-7 if attention == "eager" and family.model_type in ("gptj", "codegen") else family.tolerance
                error = (got.nan_to_num() - want.nan_to_num()).abs().max() / want.nan_to_num().abs().max()
                assert error < bound, (attention, kind, side, float(error))


def check_causal_step(family, stages, mode, tied, side):
    tied = tied and family.ties  # (a family that cannot tie runs untied)
    model = build(family, tie=tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    inputs, labels = padded_batch("right" if family.eager_only else side)
    want = loop_clipped_sum(copy.deepcopy(model), hf_loss, inputs, labels, CLIP)
    got = dp_update(model, token_loss, inputs, labels, stages=stages, grad_mode=mode)
    assert max_relative_error(got, want) < family.tolerance
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still one tensor


def tiered(families, runs, default: int):
    """(family, *run) for each family and run; a slow family's runs after the first ``default`` in the exhaustive
    tier only."""
    return [
        pytest.param(
            f,
            *run,
            id=f"{f.name}-{'-'.join(map(str, run))}",
            marks=[pytest.mark.exhaustive] * (f.slow and k >= default),
        )
        for f in families
        for k, run in enumerate(runs)
    ]


@pytest.mark.parametrize("family, stages, mode, tied, side", tiered(EXACT, RUNS, 2))
def test_causal_lm_step_matches_the_loop_oracle(family, stages, mode, tied, side):
    check_causal_step(family, stages, mode, tied, side)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("stages, mode, tied, side", OTHER_RUNS)
@pytest.mark.parametrize("family", EXACT, ids=lambda f: f.name)
def test_causal_lm_other_combinations(family, stages, mode, tied, side):
    check_causal_step(family, stages, mode, tied, side)


@pytest.mark.parametrize(
    "family, stages, mode, side", tiered(CLASSIFIERS, [(2, "ghost", "right"), (3, "materialize", "left")], 0)
)
def test_sequence_classifier_step_matches_the_loop_oracle(family, stages, mode, side):
    model = build(family, "classification")
    inputs, _ = padded_batch("right" if family.eager_only else side)
    labels = torch.arange(len(inputs["input_ids"])) % 3
    want = loop_clipped_sum(copy.deepcopy(model), lambda out, y: sequence_loss(out.logits, y), inputs, labels, CLIP)
    got = dp_update(model, sequence_loss, inputs, labels, stages=stages, grad_mode=mode)
    assert max_relative_error(got, want) < family.tolerance


@pytest.mark.parametrize("family", REFUSED, ids=lambda f: f.name)
def test_refused_families_are_refused_at_construction_naming_why(family):
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation=family.attention[0])
    with pytest.raises(UnsupportedModelError, match=family.refusal) as refusal:
        PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)
    assert type(model).__name__ in str(refusal.value)  # names the model


def test_docs_models_md_holds_exactly_the_rendered_table():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "models.md")) as f:
        text = f.read()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    assert text[start:end] == render_table(), (
        "run `python tests/hf_families.py` and paste its output into docs/models.md"
    )
    assert text.count(TABLE_START) == 1

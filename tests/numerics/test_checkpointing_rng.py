"""Activation checkpointing with dropout (issue #35): the backward's recomputation of a block must draw
the masks its forward drew, or the gradients mix two sets of masks (silently: 0.4 off the oracle).

Two checks, on an nn.Sequential whose blocks hold dropout between layers and on a Hugging Face GPT-2
with its default dropout, in float64, 1 and 2 stages, the self-check on:
- the independent oracle: a loop of batch-size-1 passes through the user's own model whose every
  nn.Dropout replays, for sample i, the mask that module drew for row i in pipedp's training forward
  (observed on the module's output). Equal, it proves the update is the exact clipped sum of each
  sample's gradient under the masks the forward used, so the recomputation replayed them;
- checkpointing on and off from one torch RNG state give the same update (and another state another
  one): this covers the dropout no module hook sees (GPT-2's attention dropout, inside SDPA).
The planted cases show both checks fail where the recomputation draws other masks.
"""

import contextlib
import copy
import functools

import pytest
import torch
import torch.nn as nn
from hf_families import hf_loss
from oracles import loop_clipped_sum, max_relative_error
from steps import class_loss

from pipedp import PipelineDPTrainer, UnsupportedModelError
from pipedp.models import token_loss
from pipedp.split import hf_drive

CLIP = 0.3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mlp():
    """Three blocks, a dropout inside each: the recomputed mask feeds a layer of the same block."""
    torch.manual_seed(0)

    def block(width_in, width_out, *head):
        return nn.Sequential(*head, nn.Linear(width_in, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, width_out))

    return nn.Sequential(block(6, 16), block(16, 16, nn.Tanh()), block(16, 4, nn.Dropout(0.2))).double()


def gpt2(attention_dropout=0.1, attention="sdpa"):
    """A tiny GPT-2 with its default dropout (0.1 on the embeddings, the residuals and the attention)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=40, n_embd=16, n_layer=3, n_head=2, n_positions=32, n_inner=32, bos_token_id=0, eos_token_id=0
    )
    config.attn_pdrop = attention_dropout
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).double()


def mlp_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (6,), generator=g)


def token_batch():
    """6 sequences of 8 tokens, some right-padded (the attention mask reaches every stage as a side input)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (6, 8), generator=g)
    mask = (torch.arange(8) < torch.tensor([8, 3, 5, 8, 6, 7])[:, None]).long()
    labels = torch.where(mask.bool(), torch.randint(0, 40, (6, 8), generator=g), -100)
    return {"input_ids": ids * mask, "attention_mask": mask}, labels


CASES = {  # model, pipedp's loss, the oracle's loss (the user's model's output), batch
    "sequential": (mlp, class_loss, class_loss, mlp_batch),
    "gpt2": (functools.partial(gpt2, 0.0, "eager"), token_loss, hf_loss, token_batch),
}


def update(model, loss_fn, x, y, seed=0, masks=None, **options):
    """What one noiseless step (SGD lr 1, expected batch 1) subtracts: the clipped sum, from torch's RNG
    seeded just before the step. ``masks``: filled with the step's dropout masks (recorded_masks)."""
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    options = dict(microbatches=2, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=1, **options)
    trainer = PipelineDPTrainer(model, loss_fn, lambda p: torch.optim.SGD(p, lr=1.0), **options)
    torch.manual_seed(seed)
    with recorded_masks(model, masks) if masks is not None else contextlib.nullcontext():
        trainer.step(x, y)
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


@contextlib.contextmanager
def recorded_masks(model, masks):
    """{name: [calls]}: every nn.Dropout's mask in the training forward; recomputations (which run in the
    backward) and runs without gradients (thrown away) are not recorded."""

    def record(name):
        def hook(module, args, output):
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # -1: outside a backward
                masks.setdefault(name, []).append(output != 0)

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, nn.Dropout)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def replaying(model, masks, n):
    """A copy of the model whose nn.Dropout modules give sample i the mask row i had in the batch forward
    (the loop oracle calls each once per sample, in order); the others must not drop anything."""
    model = copy.deepcopy(model)
    for name, module in model.named_modules():
        if name in masks:
            rows = torch.cat(masks[name])  # the micro-batches' calls, in order
            assert len(masks[name]) == 2 and len(rows) == n, name
            rows_of = iter(rows)
            module.register_forward_hook(lambda m, args, out, it=rows_of: args[0] * next(it) / (1 - m.p))
        elif isinstance(module, nn.Dropout):
            assert module.p == 0, name
    return model


def oracle_error(case, stages, **options):
    build, loss_fn, oracle_loss, make_batch = CASES[case]
    model, (x, y) = build(), make_batch()
    oracle_model, masks = copy.deepcopy(model), {}
    got = update(model, loss_fn, x, y, masks=masks, stages=stages, activation_checkpointing=True, **options)
    assert any(not m.all() for calls in masks.values() for m in calls)  # dropout dropped something
    want = loop_clipped_sum(replaying(oracle_model, masks, len(y)), oracle_loss, x, y, CLIP)
    return max_relative_error(got, want)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("case", ["sequential", "gpt2"])
def test_checkpointed_dropout_matches_the_mask_replaying_loop_oracle(case, stages):
    assert oracle_error(case, stages) < 1e-12


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("build, loss_fn, make_batch", [(mlp, class_loss, mlp_batch), (gpt2, token_loss, token_batch)])
def test_checkpointing_on_and_off_give_the_same_update(build, loss_fn, make_batch, stages):
    x, y = make_batch()
    off = update(build(), loss_fn, x, y, stages=stages)
    on = update(build(), loss_fn, x, y, stages=stages, activation_checkpointing=True)
    assert max_relative_error(on, off) < 1e-15
    other_masks = update(build(), loss_fn, x, y, seed=1, stages=stages, activation_checkpointing=True)
    assert max_relative_error(other_masks, off) > 1e-3  # the masks matter: equal updates are not by chance


def test_planted_probe_drawing_random_numbers_is_caught(monkeypatch):
    """The old behaviour: the Hugging Face adapter's probe of a layer's arguments (run inside the first
    layer block of a stage, only when its record misses) draws the embedding dropout's numbers from the
    global RNG, so the recomputation, which finds the record, draws other masks for the layer."""
    monkeypatch.setattr(hf_drive, "rng_kept", lambda device: contextlib.nullcontext())
    assert oracle_error("gpt2", 2, self_check=False) > 1e-3
    x, y = token_batch()
    on, off = (
        update(gpt2(), token_loss, x, y, stages=2, activation_checkpointing=c, self_check=False) for c in (True, False)
    )
    assert max_relative_error(on, off) > 1e-3
    with pytest.raises(UnsupportedModelError, match="not all seen by per-sample clipping"):
        update(gpt2(), token_loss, x, y, stages=2, activation_checkpointing=True)


def test_planted_recomputation_without_the_rng_state_is_caught(monkeypatch):
    """A recomputation that does not restore the forward's RNG state (preserve_rng_state=False)."""
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", functools.partial(checkpoint, preserve_rng_state=False))
    assert oracle_error("sequential", 2, self_check=False) > 1e-3

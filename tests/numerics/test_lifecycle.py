"""The trainer leaves the user's module as it found it: its hooks come off on close(), on
leaving a with-block, and when the trainer is garbage-collected."""

import copy
import gc

import torch

from pipedp import PipelineDPTrainer
from pipedp.models import mlp


def hook_count(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def make(model):
    return PipelineDPTrainer(
        model,
        lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"),
        stages=2,
        microbatches=2,
        expected_batch_size=4,
        noise_multiplier=0.0,
    )


def test_hooks_come_off_on_close_with_and_collection():
    torch.manual_seed(0)
    model = mlp((8, 16, 4))
    before = copy.deepcopy(model)
    trainer = make(model)
    assert hook_count(model) > 0
    trainer.close()
    assert hook_count(model) == 0
    x = torch.randn(3, 8)
    assert torch.equal(model(x), before(x))  # untouched apart from training, which never ran

    with make(model) as trainer:
        trainer.step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        assert hook_count(model) > 0
    assert hook_count(model) == 0

    make(model)  # not kept
    gc.collect()
    assert hook_count(model) == 0

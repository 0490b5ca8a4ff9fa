"""Helpers the numerics tests share: per-sample losses, and pipedp's clipped sum observed through the
parameters (SGD with lr 1 and expected_batch_size 1: the parameter change is minus the clipped sum)."""

import torch
import torch.nn.functional as F

from pipedp import PipelineDPTrainer
from pipedp.models import mlp


def class_data(n: int, features: int, classes: int, seed: int = 0):
    """n float64 rows of ``features`` standard normals and their labels in [0, classes), from one seeded
    generator (the rows first, then the labels)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g)


def classifier(seed: int = 3):
    """The small float64 classifier several tests train: 8 features, two hidden layers of 16, 4 classes."""
    torch.manual_seed(seed)
    return mlp((8, 16, 16, 4)).double()


CLASS_TRAINER = dict(  # the settings those tests share: a test passes what it changes
    stages=2,
    microbatches=2,
    noise_multiplier=0.8,
    max_grad_norm=0.5,
    expected_batch_size=10,
    sample_rate=0.1,
    seed=11,
)


def class_trainer(model, optimizer, **overrides):
    """A DP trainer of a classifier (class_loss) with the CLASS_TRAINER settings, ``overrides`` replacing them."""
    return PipelineDPTrainer(model, class_loss, optimizer, **dict(CLASS_TRAINER, **overrides))


def class_loss(out, y):
    """Per-sample cross-entropy of [n, classes] logits."""
    return F.cross_entropy(out, y, reduction="none")


def seq_loss(out, y):
    """Per-sample mean cross-entropy of [n, T, classes] logits over the sample's positions."""
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


def pipedp_clipped_sum(model, loss_fn, x, y, clip, **options):
    """sum_i clip(g_i) as pipedp computes it: one noiseless step, read off the parameters."""
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    settings = dict(noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=1)
    settings.update(options)
    PipelineDPTrainer(model, loss_fn, lambda p: torch.optim.SGD(p, lr=1.0), **settings).step(x, y)
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


def tiny_llama_config(**overrides):
    """The tests' tiny Llama: vocabulary 40, width 16, 2 layers, 2 heads sharing 1 key-value head
    (grouped-query attention); ``overrides`` replace or add config fields."""
    import transformers  # here: most tests that import this module need no transformers

    fields = dict(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)

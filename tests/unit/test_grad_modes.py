"""grad_mode="auto": each layer's way (keep / ghost / materialize) from a deterministic cost model."""

import pytest
import torch
import torch.nn as nn

from pipedp import PipelineDPTrainer
from pipedp.models import GPTConfig, tiny_gpt, token_loss
from pipedp.runtime.grad_modes import allowed, cheapest
from pipedp.runtime.stage import KEEP_MEMORY_RATIO


def ways_for(layer, n, t):
    a, g = torch.randn(n, t, layer.in_features), torch.randn(n, t, layer.out_features)
    return cheapest(layer, [a], g, allowed("auto", layer, [a], g, float("inf")))


def test_keep_over_short_sequences_of_small_layers_ghost_over_long_sequences_of_wide_ones():
    assert ways_for(nn.Linear(128, 384), 4, 64) == "keep"  # the small GPT preset's attention input
    assert ways_for(nn.Linear(1024, 3072), 4, 128) == "ghost"  # a realistic width: the per-sample tensors weigh
    assert ways_for(nn.Linear(8, 8), 4, 16) == "keep"  # Gram matrices larger than the gradients: no ghost


def test_the_memory_rule_bounds_what_auto_may_keep():
    layer = nn.Linear(128, 384)
    a, g = torch.randn(4, 64, 128), torch.randn(4, 64, 384)
    assert "keep" not in allowed("auto", layer, [a], g, 0.0)


def test_auto_is_the_default_and_the_report_shows_its_choice():
    torch.manual_seed(0)
    model = tiny_gpt(GPTConfig(vocab_size=20, seq_len=8, d_model=16, n_heads=2, n_layers=2))
    trainer = PipelineDPTrainer(model, token_loss, stages=2, expected_batch_size=4)
    assert trainer.pipeline.grad_mode == "auto"
    trainer.step(torch.randint(0, 20, (4, 8)), torch.randint(0, 20, (4, 8)))
    ways = trainer.partition_report.ways
    assert set(ways) == {n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    assert ways["0.tok"] == "ghost" and ways["1.ln1"] == "keep"
    assert "per-sample ways" in str(trainer.partition_report)


@pytest.mark.parametrize("d, tokens, rows", [(256, 64, 8), (1024, 128, 4)], ids=["small", "realistic"])
def test_auto_takes_ghosts_ways_at_the_benchmark_presets(d, tokens, rows):
    # bench's small and realistic presets (bench/presets.py: GPT, d, T, rows per micro-batch): there ghost was the
    # fastest way measured (bench/RESULTS.md 2026-12-07 07:23), so the default computes exactly what the ghost
    # variant does. Both modes allow the same ways: auto's cheapest must be the one ghost prefers
    model = tiny_gpt(GPTConfig(vocab_size=256, seq_len=tokens, d_model=d, n_heads=4, n_layers=1))
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear):
            a, g = torch.randn(rows, tokens, layer.in_features), torch.randn(rows, tokens, layer.out_features)
        elif isinstance(layer, nn.LayerNorm):
            a, g = torch.randn(rows, tokens, d), torch.randn(rows, tokens, d)
        else:
            continue
        auto = cheapest(layer, [a], g, allowed("auto", layer, [a], g, KEEP_MEMORY_RATIO))
        assert auto == allowed("ghost", layer, [a], g, KEEP_MEMORY_RATIO)[0], name

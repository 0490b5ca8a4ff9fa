"""The per-layer choice between ghost norms and materialised per-sample gradients (moved from
bench/, where CI never ran it). That both give the same norms is the parity tests' job."""
import torch
import torch.nn as nn

from pipedp.privacy.per_sample import ghost_squared_norms


def test_pipedp_picks_the_cheaper_mode():
    layer = nn.Linear(32, 32)
    short, long = torch.randn(2, 8, 32), torch.randn(2, 256, 32)
    assert ghost_squared_norms(layer, [short], torch.randn(2, 8, 32)) is not None  # 64 <= 1024: ghost
    assert ghost_squared_norms(layer, [long], torch.randn(2, 256, 32)) is None  # 65536 > 1024: materialise

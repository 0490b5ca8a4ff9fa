"""The per-layer choice between ghost norms and materialized per-sample gradients (moved from
bench/, where CI never ran it). That both give the same norms is the parity tests' job."""

import torch
import torch.nn as nn

from pipedp.privacy.per_sample import ghost_squared_norms


def test_pipedp_picks_the_cheaper_mode():
    layer = nn.Linear(32, 32)
    short, long = torch.randn(2, 8, 32), torch.randn(2, 256, 32)
    assert ghost_squared_norms(layer, [short], torch.randn(2, 8, 32)) is not None  # 64 <= 1024: ghost
    assert ghost_squared_norms(layer, [long], torch.randn(2, 256, 32)) is None  # 65536 > 1024: materialize


def test_per_sample_gradients_are_kept_from_i_to_w_where_they_are_small():
    from pipedp.privacy.per_sample import keeps_per_sample_grads

    def keeps(d_in, d_out, tokens, n=4):
        return keeps_per_sample_grads(
            nn.Linear(d_in, d_out), [torch.randn(n, tokens, d_in)], torch.randn(n, tokens, d_out)
        )

    assert keeps(32, 96, 256)  # 3k per sample <= 256 x 128 held: kept (W a weighted sum, no Gram matrices)
    assert not keeps(128, 384, 64)  # 49k > 64 x 512 held: ghost norms in I, the clipped product in W
    assert not keeps(512, 1536, 128)
    assert not keeps(4, 4, 1)  # one position: ghost needs no Gram matrix
    assert keeps_per_sample_grads(nn.LayerNorm(8), [torch.randn(4, 6, 8)], torch.randn(4, 6, 8))
    assert not keeps_per_sample_grads(nn.Embedding(10, 8), [torch.randint(0, 10, (4, 6))], torch.randn(4, 6, 8))

"""Pure DP math, no processes: per-sample norms and clipped sums of one layer, clip factors,
noise, independent random streams, accounting, Poisson sampling, secure randomness, and
the model validator.

Layer 1: may import ``pipedp.errors``, ``pipedp.config`` and ``schedules``; never
``split``, ``runtime``, ``train`` or ``cli``.
"""

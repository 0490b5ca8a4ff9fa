"""Training: the trainer (public API), its training state, the Poisson fit loop, and
atomic, verifiable checkpoints.

Layer 4: may import every layer below (``errors``, ``config``, ``schedules``, ``privacy``,
``split``, ``runtime``); never ``cli``.
"""

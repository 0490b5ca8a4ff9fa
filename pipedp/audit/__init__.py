"""A one-run privacy audit (Steinke, Nasr and Jagielski, NeurIPS 2023) through the real pipeline:
canaries included by coin flip, one training run, a score per canary, an empirical epsilon
lower bound at a stated confidence, compared with the accountant's epsilon; plus white-box
checks of the noise itself (its size and its independence across steps).

Layer 5: may import every layer below it (it runs the trainer); never ``cli``.
"""

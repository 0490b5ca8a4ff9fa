"""Running the pipeline: per-micro-batch capture, one stage's F / I / W passes, the
executor that follows a schedule, micro-batching, transports (in-process and
torch.distributed), the two runtimes behind one interface (protocols.py), measured
block costs, and the process launcher.

Layer 3: may import ``pipedp.errors``, ``pipedp.config``, ``schedules``,
``pipedp.privacy`` and ``pipedp.split``; never ``train`` or ``cli``.
"""

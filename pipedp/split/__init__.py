"""Splitting a model: blocks, the adapter registry (Sequential, ``pipeline_blocks()``,
Hugging Face, graph capture), contiguous partitioning and its report, and stage-by-stage
loading of Hugging Face checkpoints.

Layer 2: may import ``pipedp.errors``, ``pipedp.config``, ``schedules`` and
``pipedp.privacy``; never ``runtime``, ``train`` or ``cli``.
"""

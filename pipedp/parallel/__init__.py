"""Tensor parallelism inside a stage: layers split across the T ranks of a stage, under exact DP-SGD.

- layers.py: the parallel layers pipedp owns (column- and row-parallel Linear, a vocabulary-parallel Embedding,
  a head whose vocabulary-split logits are gathered) and the collectives they run inside autograd;
- loss.py:   pipedp's token loss on vocabulary-split logits (the head's then stay split);
- rules.py:  their per-sample rules, which see only the rank's own slice (Linear's and Embedding's math);
- plan.py:   which layer of a model becomes which (transformers' own tensor-parallel plan for a decoder), the
  refusals at construction, and the split of one stage's layers for one rank.

Each rank adds its slices' partial squared norms and the norms of the tensors every rank holds whole on rank 0
only; the per-sample all-reduce over the replica's stages and tensor-parallel ranks then gives every rank the
same norms and clip factors (the Frobenius norm splits over any partition of the coordinates).
"""

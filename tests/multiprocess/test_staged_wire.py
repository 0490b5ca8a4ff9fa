"""Several ranks on one GPU run over gloo, every tensor crossing through host memory (pipedp/wire.py). Without a GPU
the same path runs here with the stage on the CPU: each rank's wire forced to stage its tensors, and every tensor
pipedp hands torch.distributed checked to be one the wire made (workers.host_staged). The results must equal the
direct run's bit for bit (a copy back forgotten after an in-place collective would change them) and the loop
oracle's."""

import pytest
import torch

from pipedp.runtime.launch import launch

pytestmark = pytest.mark.dist


def test_a_staged_2x2_mesh_with_a_sharded_optimizer_and_a_checkpoint_equals_the_direct_run(tmp_path):
    from oracles import max_relative_error
    from workers import host_staged, sharded_fit

    options = {"stages": 2, "replicas": 2, "shard_optimizer": True}
    direct = launch(sharded_fit, 4, (options, 2, str(tmp_path / "direct")), timeout_s=300)
    staged = launch(host_staged, 4, (sharded_fit, options, 2, str(tmp_path / "staged")), timeout_s=300)
    (state, eps, _, _), calls = staged[0]
    assert all(torch.equal(state[k], direct[0][0][k]) for k in direct[0][0]) and eps == direct[0][1]
    assert all(n > 20 for _, n in staged)  # every rank's P2P, sums, broadcasts, checks and gathers went through it
    # unsharded: the sums over replicas are all-reduces (the sharded run's are reduces to owners and broadcasts)
    plain = launch(host_staged, 4, (sharded_fit, dict(options, shard_optimizer=False), 2), timeout_s=300)
    assert max_relative_error(plain[0][0][0], state) < 1e-12 and plain[0][0][1] == eps
    assert sorted(p.name for p in (tmp_path / "staged").iterdir()) == sorted(
        p.name for p in (tmp_path / "direct").iterdir()
    )


def test_staged_tensor_parallel_stages_with_a_tied_head_equal_the_loop_oracle():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from oracles import max_relative_error
    from test_tensor_parallel import oracle
    from workers import host_staged, tensor_parallel_steps

    options = {"stages": 2, "tensor_parallel": 2, "model": {"tie_word_embeddings": True}}
    results = launch(host_staged, 4, (tensor_parallel_steps, 2, options), timeout_s=600)
    assert max_relative_error(results[0][0][0], oracle(2, tie_word_embeddings=True)) < 1e-12
    assert all(n > 20 for _, n in results)

"""DP-SGD under tensor parallelism against non-private torch tensor parallelism, on the same model and ranks.

    python -m bench.tp_cost                                  # a 2-layer Llama, width 512, T = 2, 2 processes
    python -m bench.tp_cost --width 1024 --layers 4 --rounds 5

Both contenders run in the same 2 processes (gloo on the CPU; 1 thread each), round by round, on the same
Llama-shaped model (random weights, float32, untied head) and batch:
- ``torch TP``: ``torch.distributed.tensor.parallel.parallelize_module`` with transformers' own plan (q/k/v and
  gate/up column-parallel, o and down row-parallel), the embedding row-parallel and the head column-parallel with
  replicated logits (torchtitan's plan); plain cross-entropy, SGD; no privacy;
- ``pipedp TP``: ``PipelineDPTrainer(..., tensor_parallel=2)`` (1 stage, its defaults: auto grad mode), noise
  multiplier 1, C = 1, the same SGD, the loss on vocabulary slices.
Each round times ``--reps`` steps of each (after ``--warmup``); the figure is the median over rounds of the
ratio torch TP step time / pipedp step time (1.0x: DP costs nothing beyond non-private tensor parallelism).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List


def _config(width: int, layers: int, vocab: int):
    from .presets import llama_of_width

    return llama_of_width(width, layers, vocab, head_dim=64)


def _model(config):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _torch_tp(config, lr: float):
    """The model split by torch's tensor parallelism over the 2 ranks; (step(ids, labels))."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model(config)
    mesh = init_device_mesh("cpu", (2,))
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(config.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(ids, labels):
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _pipedp_tp(config, lr: float, batch: int):
    import torch

    from pipedp import PipelineDPTrainer
    from pipedp.models import token_loss

    trainer = PipelineDPTrainer(
        _model(config),
        token_loss,
        lambda p: torch.optim.SGD(p, lr=lr),
        stages=1,
        tensor_parallel=2,
        microbatches=1,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch,
        sample_rate=0.01,
        seed=0,
    )
    return lambda ids, labels: trainer.step({"input_ids": ids}, labels, sampling="poisson")


def run_rank(rank: int, width: int, layers: int, vocab: int, batch: int, seq: int, rounds: int, warmup: int, reps: int):
    import torch

    torch.set_num_threads(1)
    config = _config(width, layers, vocab)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    steps = {"torch TP": _torch_tp(config, 1e-3), "pipedp TP": _pipedp_tp(config, 1e-3, batch)}
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(warmup):
            step(ids, labels)
    for _ in range(rounds):
        for name, step in steps.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                step(ids, labels)
            torch.distributed.barrier()
            times[name].append((time.perf_counter() - start) / reps)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    from pipedp.runtime.launch import launch

    shape = (args.width, args.layers, args.vocab, args.batch, args.seq, args.rounds, args.warmup, args.reps)
    times = launch(run_rank, 2, shape, timeout_s=3600)[0]
    ratios = [t / p for t, p in zip(times["torch TP"], times["pipedp TP"])]
    print(
        f"Llama-shaped, width {args.width}, {args.layers} layers, vocabulary {args.vocab}, batch {args.batch} x "
        f"{args.seq} tokens, float32; tensor_parallel=2 (2 processes, gloo, 1 thread each); {args.rounds} rounds"
    )
    print(f"{'contender':<10} {'s / step (median)':>18}")
    for name, values in times.items():
        print(f"{name:<10} {statistics.median(values):>18.3f}")
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
    print(f"DP under TP at {statistics.median(ratios):.2f}x the speed of non-private torch TP (rounds: {spread})")


if __name__ == "__main__":
    main()

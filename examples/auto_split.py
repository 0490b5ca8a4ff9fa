"""A plain PyTorch model — a ModuleList, its own forward loop, a padding mask and a long skip
connection, no marks, no wrapper — split automatically, each rank loading only its own stage's
weights from a safetensors file, trained with DP-SGD.

    torchrun --nproc_per_node 2 examples/auto_split.py --steps 20
    torchrun --nproc_per_node 2 examples/auto_split.py --weights my_model.safetensors

Without --weights, rank 0 first writes a randomly initialised model to a temporary file (a
stand-in for a checkpoint too large for one process): every rank then builds the model on the
meta device (no memory) and materializes only its stage from the file.
"""

import argparse
import gc
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipedp import PipelineDPTrainer, init_from_env, load_stage


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.mix, self.ff = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h, mask):
        m = mask.unsqueeze(-1).to(h.dtype)
        context = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)  # masked mean
        return h + torch.tanh(self.ff(self.norm(h)) + self.mix(context))


class TokenModel(nn.Module):
    def __init__(self, vocab=64, d=32, layers=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids, mask):
        e = self.embed(ids)
        h = e
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.norm(h + e))  # the embedding output reused at the end: it crosses every cut


def per_sample_loss(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--weights", help="a safetensors file of TokenModel's state dict")
    args = parser.parse_args()

    init_from_env()
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, stages = dist.get_rank(), dist.get_world_size()
    weights = args.weights
    if weights is None:  # rank 0 writes a stand-in checkpoint; the others wait for it
        weights = os.path.join(
            tempfile.gettempdir(), f"pipedp-auto-split-{os.environ.get('MASTER_PORT', '0')}.safetensors"
        )
        if rank == 0:
            from safetensors.torch import save_file

            torch.manual_seed(0)
            save_file(TokenModel().state_dict(), weights)
        dist.barrier()
    with torch.device("meta"):
        model = TokenModel()
    load_stage(model, weights, stages, rank)  # only this rank's stage gets memory

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (256, 16), generator=g)
    lengths = torch.randint(4, 17, (256,), generator=g)
    mask = (torch.arange(16)[None, :] < lengths[:, None]).long()
    trainer = PipelineDPTrainer(
        model,
        per_sample_loss,
        lambda p: torch.optim.Adam(p, lr=1e-2),
        stages=stages,
        microbatches=4,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=32,
        sample_rate=32 / 256,
    )
    if rank == 0:
        print(f"partition: {trainer.partition_report}", flush=True)
    gc.collect()
    gc.freeze()  # the model and libraries live to the end: full collections need not rescan them

    def report(step, loss, tr):
        if rank == 0 and (step % 5 == 0 or step == args.steps):
            print(f"step {step:3d}  loss {loss:.3f}  epsilon {tr.epsilon(1e-5):.3f}", flush=True)

    trainer.fit(({"ids": ids, "mask": mask}, ids), steps=args.steps, callback=report)  # a copy task: learnable
    if args.weights is None and rank == 0:
        os.remove(weights)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

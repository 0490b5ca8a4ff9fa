"""Train a tiny GPT with DP-SGD on 2 pipeline stages.

    torchrun --nproc_per_node 2 examples/train_tiny_gpt.py --steps 100

Each of the 2 processes builds the same model (same seed) and keeps only its stage.
Rank 0 prints the loss and the privacy spent. One record (a short generated sentence) is one
row, right-padded to 36 UTF-8 bytes with targets -100 on the padding: the privacy unit is a
record, as in ``pipedp train``.
"""

import argparse

import torch

from pipedp import PipelineDPTrainer, init_from_env
from pipedp.data import ByteTokenizer, Records, generated_records, to_rows
from pipedp.models import GPTConfig, tiny_gpt, token_loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    init_from_env()  # gloo on CPU, NCCL when CUDA is available
    import torch.distributed as dist

    torch.set_num_threads(1)
    tokenizer = ByteTokenizer()  # a vocabulary fixed in advance: it reveals nothing of the data
    rows = to_rows(Records("generated", generated_records()), tokenizer, seq_len=36)
    x, y = rows.input_ids.long(), rows.labels.long()
    torch.manual_seed(0)  # the same weights on every rank
    model = tiny_gpt(GPTConfig(vocab_size=tokenizer.vocab_size, seq_len=36, d_model=64, n_heads=4, n_layers=4))
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda params: torch.optim.Adam(params, lr=3e-3),
        stages=args.stages,
        replicas=args.replicas,
        microbatches=4,
        schedule="1f1b",
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=args.batch_size,
        sample_rate=args.batch_size / len(x),
    )

    def report(step, loss, tr):
        if dist.get_rank() == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss:.3f}  epsilon {tr.epsilon(1e-5):.3f}", flush=True)

    trainer.fit((x, y), steps=args.steps, callback=report)
    state = trainer.state_dict()  # the whole model on rank 0, None elsewhere
    if dist.get_rank() == 0:
        print(f"gathered {len(state)} tensors of the trained model on rank 0")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

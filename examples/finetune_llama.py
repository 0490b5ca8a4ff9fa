"""DP fine-tuning of a Llama-architecture model across 4 pipeline stages.

    torchrun --nproc_per_node 4 examples/finetune_llama.py --steps 20
    torchrun --nproc_per_node 4 examples/finetune_llama.py --checkpoint /path/to/llama --data corpus.txt

Without --checkpoint a tiny Llama config with random weights is written to a temporary
folder first, so the same path runs either way: every rank builds the model on the meta
device and reads only its own stage's tensors from the (sharded) safetensors checkpoint.
A real checkpoint folder needs its tokenizer files beside the weights.
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from pipedp import PipelineDPTrainer
from pipedp.data import generated_corpus, read_text, windows
from pipedp.split.hf_loading import load_pipeline_stage, resident_parameter_bytes, tokenize_for_model
from pipedp import init_from_env
from pipedp.models import token_loss


def tiny_llama_checkpoint(folder: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="200KB")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default=None, help="local Hugging Face Llama folder")
    parser.add_argument("--data", default=None, help="local .txt or .jsonl file (default: generated corpus)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    init_from_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    folder = args.checkpoint
    if folder is None:
        folder = os.path.join(tempfile.gettempdir(), f"pipedp-tiny-llama-{os.environ.get('MASTER_PORT', '0')}")
        if rank == 0:
            tiny_llama_checkpoint(folder)
        dist.barrier()
    text = read_text(args.data) if args.data else generated_corpus()
    if args.checkpoint:
        ids = tokenize_for_model(folder, text)
    else:
        ids = list(text.encode("utf-8"))  # the tiny model reads bytes (vocab 256)
    x, y = windows(ids, args.seq_len)

    model = load_pipeline_stage(folder, stages=world, stage=rank, untie_weights=True)
    print(f"rank {rank}: {resident_parameter_bytes(model) / 1e6:.2f} MB of parameters resident", flush=True)
    trainer = PipelineDPTrainer(
        model, token_loss, lambda params: torch.optim.AdamW(params, lr=1e-3),
        stages=world, microbatches=4, schedule="1f1b", noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=args.batch_size, sample_rate=args.batch_size / len(x), untie_weights=True,
    )

    def report(step, loss, tr):
        if rank == 0 and (step % 5 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss:.3f}  epsilon {tr.epsilon(1e-5):.3f}", flush=True)

    trainer.fit((x, y), steps=args.steps, callback=report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

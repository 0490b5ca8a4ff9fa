"""DP fine-tuning of a Llama-architecture model with LoRA across pipeline stages, on padded
variable-length sequences, exported as a Hugging Face adapter folder.

    torchrun --nproc_per_node 4 examples/finetune_llama.py --steps 20
    torchrun --nproc_per_node 4 examples/finetune_llama.py --checkpoint /path/to/llama --data corpus.txt \
        --lora-r 8 --export out/

Without --checkpoint a tiny Llama config with random weights is written to a temporary
folder first, so the same path runs either way: every rank builds the model on the meta
device and reads only its own stage's tensors from the (sharded) safetensors checkpoint, then
adds LoRA adapters (PEFT) to q_proj and v_proj; the base weights stay frozen. Sentences are
right-padded to --seq-len and passed as {"input_ids", "attention_mask"} with labels -100 on
the padding. A real checkpoint folder needs its tokenizer files beside the weights.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from pipedp import PipelineDPTrainer, init_from_env
from pipedp.data import generated_corpus, read_text
from pipedp.models import token_loss
from pipedp.split.adapters import model_blocks
from pipedp.split.hf_loading import load_pipeline_stage, resident_parameter_bytes, tokenize_for_model
from pipedp.split.partition import block_costs


def tiny_llama_checkpoint(folder: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="200KB")


def padded_sentences(text: str, encode, seq_len: int, pad_id: int = 0):
    """One row per sentence: input_ids and attention_mask right-padded to seq_len, labels -100 there."""
    rows = [encode(s.strip() + ".")[: seq_len + 1] for s in text.split(".") if len(s.strip()) > 2]
    n = len(rows)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), -100, dtype=torch.long)
    mask = torch.zeros(n, seq_len, dtype=torch.long)
    for i, tokens in enumerate(rows):
        length = len(tokens) - 1
        ids[i, :length] = torch.tensor(tokens[:-1])
        labels[i, :length] = torch.tensor(tokens[1:])
        mask[i, :length] = 1
    return {"input_ids": ids, "attention_mask": mask}, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default=None, help="local Hugging Face Llama folder")
    parser.add_argument("--data", default=None, help="local .txt or .jsonl file (default: generated corpus)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--export", default=None, help="write the trained adapter here (rank 0)")
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
        encode = lambda s: tokenize_for_model(folder, s)  # noqa: E731
    else:
        encode = lambda s: list(s.encode("utf-8"))  # noqa: E731  (the tiny model reads bytes, vocab 256)
    inputs, labels = padded_sentences(text, encode, args.seq_len)

    model = load_pipeline_stage(folder, stages=world, stage=rank, untie_weights=True)
    print(f"rank {rank}: {resident_parameter_bytes(model) / 1e6:.2f} MB of parameters resident", flush=True)
    costs = block_costs(model_blocks(model, untie_weights=True), "compute")  # the split the loader used
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # the same adapter initialisation on every rank
    model = get_peft_model(
        model,
        LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    n = len(labels)
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        stages=world,
        microbatches=4,
        schedule="1f1b",
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=args.batch_size,
        sample_rate=args.batch_size / n,
        untie_weights=True,
        balance=costs,
    )

    def report(step, loss, tr):
        if rank == 0 and (step % 5 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss:.3f}  epsilon {tr.epsilon(1e-5):.3f}", flush=True)

    trainer.fit((inputs, labels), steps=args.steps, callback=report)
    if args.export:
        trainer.save_pretrained(args.export)  # every rank takes part; rank 0 writes the adapter
        if rank == 0:
            print(f"adapter written to {args.export}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""DP fine-tuning of a local Llama-style model on chat records with LoRA: train on the assistant turns only,
evaluate on held-out conversations, export the adapter, and answer a question with the exported model.

    python examples/finetune_chat.py --model /path/to/llama --data chat.jsonl --export out/     # one process
    torchrun --nproc_per_node 2 examples/finetune_chat.py --model DIR --data chat.jsonl --export out/

``chat.jsonl`` holds one conversation per line: {"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}. Each conversation is one row (the privacy unit: one
conversation, protected whole), rendered with the tokenizer's chat template and truncated or padded
to --seq-len; only the assistant turns' tokens are targets (pipedp.data.rows). Without --model, a tiny
random Llama with a character tokenizer and a chat template is written to a temporary folder, with a
generated chat file: the same path runs either way. Under torchrun each rank reads only its own
stage's weights; without it every stage runs in this process.

The evaluation loss on held-out private conversations is not differentially private: it is computed
from those records without noise. Publish it only if the held-out records are public, or report the
training-side epsilon alone.
"""

import argparse
import json
import math
import os
import tempfile

import torch

from pipedp import PipelineDPTrainer, init_from_env
from pipedp.data import assemble, hold_out, load_tokenizer, read_records, record_units, to_rows
from pipedp.models import token_loss
from pipedp.split.adapters import model_blocks
from pipedp.split.hf_loading import load_local_model, load_pipeline_stage
from pipedp.split.partition import block_costs

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_chat_llama(folder: str) -> None:
    """A tiny random Llama and a character tokenizer with a chat template (nothing downloaded)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<s>", "</s>", "<pad>"]
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 .,?!'"))
    vocab = {t: i for i, t in enumerate(["[UNK]"] + specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=specials[:4],
    )
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def generated_chats(path: str, count: int = 200) -> None:
    with open(path, "w") as f:
        for i in range(count):
            a, b = i % 7, (i // 7) % 3
            messages = [
                {"role": "user", "content": f"what is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default=None, help="local Llama-style folder (weights + tokenizer with a chat template)"
    )
    parser.add_argument("--data", default=None, help="chat JSONL (one {'messages': [...]} per line)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--export", default=None, help="write the trained adapter here")
    parser.add_argument("--question", default="what is 3 plus 1?")
    args = parser.parse_args()

    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world = 0, 1
    if distributed:
        import torch.distributed as dist

        init_from_env()
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    scratch = tempfile.mkdtemp(prefix="pipedp-chat-") if args.model is None or args.data is None else None
    folder, data = args.model, args.data
    if folder is None:
        folder = os.path.join(scratch, "model")
        if rank == 0:
            tiny_chat_llama(folder)
    if data is None:
        data = os.path.join(scratch, "chat.jsonl")
        if rank == 0:
            generated_chats(data)
    if distributed and scratch is not None:
        dist.barrier()

    # one conversation -> one row; the assistant turns are the only targets
    rows = to_rows(read_records(data), load_tokenizer(folder), args.seq_len, fmt="chat")
    c = rows.counts
    if rank == 0:
        print(f"{c['records']} conversations -> {c['rows']} rows; {c['truncated']} truncated, {c['dropped']} dropped")
    units = record_units(rows)
    train_units, held = hold_out(len(units), args.eval_fraction, seed=0)
    ids, labels, mask = assemble(rows, units, train_units)
    train = ({"input_ids": ids, "attention_mask": mask}, labels)
    ids, labels, mask = assemble(rows, units, held, padded=False)
    evaluation = ({"input_ids": ids, "attention_mask": mask}, labels)

    stages = max(world, 2)
    if distributed:  # each rank reads only its own stage's tensors
        model = load_pipeline_stage(folder, stages=world, stage=rank, untie_weights=True)
    else:
        model = load_local_model(folder)
    costs = block_costs(model_blocks(model, untie_weights=True), "compute")  # the split the loader used
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # the same adapter initialisation on every rank
    model = get_peft_model(
        model,
        LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    n = len(train_units)
    trainer = PipelineDPTrainer(
        model,
        token_loss,
        lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
        stages=stages,
        microbatches=4,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=args.batch_size,
        sample_rate=args.batch_size / n,
        untie_weights=True,
        balance=costs,
    )
    before = trainer.evaluate(*evaluation)
    trainer.fit(train, steps=args.steps)
    after = trainer.evaluate(*evaluation)
    eps = trainer.epsilon(1e-5) if rank == 0 else None
    if rank == 0:
        print(
            f"trained {args.steps} steps: epsilon {eps:.3f} at delta 1e-05 over {n} conversations; eval loss "
            f"{before:.3f} -> {after:.3f}, perplexity {math.exp(after):.2f} on {len(held)} held-out conversations "
            "(not differentially private)"
        )
    if args.export:
        trainer.save_pretrained(args.export)  # every rank takes part; rank 0 writes the adapter
    if distributed:
        dist.barrier()
    if args.export and rank == 0:
        answer(folder, args.export, args.question)
    if distributed:
        dist.destroy_process_group()


def answer(base: str, adapter: str, question: str) -> None:
    """Load the exported adapter onto the base model, as anyone would, and answer one question."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    reply = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"exported to {adapter}; asked {question!r}, the exported model answers {reply!r}", flush=True)


if __name__ == "__main__":
    main()

"""--export: the trained model as a Hugging Face folder (a PeftModel: its adapter) with the tokenizer."""

from __future__ import annotations

from .spec import Job


def export(trainer, job: Job, lead: bool) -> None:
    trainer.save_pretrained(job.export)  # every rank takes part; rank 0 writes
    if lead:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(job.model.name, local_files_only=True).save_pretrained(job.export)
        print(f"exported: {job.export} (transformers' from_pretrained loads it)", flush=True)

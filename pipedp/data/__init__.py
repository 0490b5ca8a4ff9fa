"""Training data: records from local sources -> one row per record -> privacy units, tokenised once.

    sources   read .txt (a record per line) / .jsonl / .json / .csv / .parquet / save_to_disk folders
    tokenize  the built-in byte tokenizer, or a local Hugging Face one (chat template included)
    rows      one record -> one row of seq_len tokens; which targets train (text / instruction / chat)
    units     rows -> privacy units (a record, or a user's records), the held-out split
    cache     tokenised rows cached by a hash of the data, the tokenizer and the options
    corpus    the generated corpus, the byte and character tokenizers, fixed-length windows

Layer 0: imports only pipedp.errors (and torch; transformers, pyarrow and datasets only when a
source or a tokenizer needs them). Names load on first use: ``sources`` needs no torch.
"""

from typing import Any

_WHERE = {
    "tokenized": "cache",
    "ByteTokenizer": "corpus",
    "CharTokenizer": "corpus",
    "generated_corpus": "corpus",
    "generated_records": "corpus",
    "read_text": "corpus",
    "windows": "corpus",
    "Tokenized": "rows",
    "detect_format": "rows",
    "describe_counts": "rows",
    "to_rows": "rows",
    "record_lengths": "rows",
    "length_from_data": "rows",
    "DataError": "sources",
    "Records": "sources",
    "check_source": "sources",
    "fingerprint": "sources",
    "read_records": "sources",
    "load_tokenizer": "tokenize",
    "UnitGroups": "units",
    "assemble": "units",
    "hold_out": "units",
    "record_units": "units",
    "user_units": "units",
}


def __getattr__(name: str) -> Any:  # names load with their module, so the light modules (sources) need no torch
    if name not in _WHERE:
        raise AttributeError(f"module 'pipedp.data' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [  # noqa: F822 (loaded by __getattr__)
    "ByteTokenizer",
    "CharTokenizer",
    "DataError",
    "Records",
    "Tokenized",
    "UnitGroups",
    "assemble",
    "check_source",
    "describe_counts",
    "detect_format",
    "fingerprint",
    "generated_corpus",
    "generated_records",
    "hold_out",
    "load_tokenizer",
    "read_records",
    "read_text",
    "record_lengths",
    "length_from_data",
    "record_units",
    "to_rows",
    "tokenized",
    "user_units",
    "windows",
]

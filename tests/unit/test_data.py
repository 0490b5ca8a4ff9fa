"""pipedp.data: records from local sources -> one row per record (which targets train), units, the cache."""

import json
import os

import pytest
import torch

from pipedp.cli.options import DataConfig, OptimizerConfig
from pipedp.data import (
    DataError,
    Records,
    assemble,
    check_source,
    hold_out,
    load_tokenizer,
    read_records,
    record_units,
    to_rows,
    tokenized,
    user_units,
)
from pipedp.data.tokenize import Bytes
from pipedp.errors import ConfigError

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<s>", "</s>", "<pad>"]


def chat_tokenizer(folder, template=TEMPLATE):
    """A character-level Hugging Face tokenizer with special tokens and a chat template, saved locally."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 .,?!'"))
    vocab = {t: i for i, t in enumerate(["[UNK]"] + SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[:4],
    )
    fast.chat_template = template
    fast.save_pretrained(folder)
    return fast


def test_text_records_are_one_row_each_truncated_or_padded_with_counts():
    records = Records("mem", [{"text": "abc"}, {"text": "abcdefghij"}, {"text": "x"}, {"text": "hello"}])
    rows = to_rows(records, Bytes(), seq_len=5)
    # "x" has no next token to train on: dropped, and counted
    assert rows.counts == {"records": 4, "truncated": 1, "tokens cut": 4, "dropped": 1, "rows": 3}
    ids, labels = rows.input_ids.tolist(), rows.labels.tolist()
    b = lambda s: list(s.encode())  # noqa: E731
    assert ids[0] == b("ab") + [0, 0, 0] and labels[0] == b("bc") + [-100] * 3  # right padding, targets -100 there
    assert ids[1] == b("abcde") and labels[1] == b("bcdef")  # 10 bytes -> 6 kept: 4 cut
    assert rows.lengths.tolist() == [2, 5, 4]


def test_instruction_records_train_on_the_completion_only(tmp_path):
    fast = chat_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    rows = to_rows(Records("mem", [{"prompt": "what is two?", "completion": " two."}]), tok, seq_len=32)
    prompt = fast("what is two?")["input_ids"]
    completion = fast(" two.", add_special_tokens=False)["input_ids"] + [fast.eos_token_id]
    tokens = prompt + completion
    n = len(tokens) - 1
    assert rows.input_ids[0, :n].tolist() == tokens[:-1]
    labels = rows.labels[0].tolist()
    # position t predicts token t + 1: exactly the completion's tokens (and the end token) are targets
    assert labels[: len(prompt) - 1] == [-100] * (len(prompt) - 1)
    assert labels[len(prompt) - 1 : n] == completion
    assert labels[n:] == [-100] * (32 - n)
    assert rows.format == "instruction"


def test_chat_records_train_on_the_assistant_turns_only(tmp_path):
    fast = chat_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "no."},
    ]
    rows = to_rows(Records("mem", [{"messages": messages}]), tok, seq_len=64)
    assert rows.format == "chat"
    ids = fast.apply_chat_template(messages, tokenize=False)
    tokens = fast(ids, add_special_tokens=False)["input_ids"]
    names = fast.convert_ids_to_tokens(tokens)
    trained = set()
    inside = False
    for j, name in enumerate(names):  # an assistant turn: after <|assistant|>, through its <|end|>
        if inside:
            trained.add(j)
            if name == "<|end|>":
                inside = False
        elif name == "<|assistant|>":
            inside = True
    labels = rows.labels[0].tolist()
    for t in range(len(tokens) - 1):
        assert labels[t] == (tokens[t + 1] if t + 1 in trained else -100), (t, names[t + 1])
    assert fast.convert_ids_to_tokens([x for x in labels if x != -100]) == list("yo") + ["<|end|>"] + list("no.") + [
        "<|end|>"
    ]


def test_chat_needs_a_template_rendered_prefix_by_prefix(tmp_path):
    chat_tokenizer(tmp_path / "tok", template="{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}")
    tok = load_tokenizer(str(tmp_path / "tok"))
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(DataError, match=r"mem: record 1: the chat template does not render this conversation prefix"):
        to_rows(Records("mem", [chat]), tok, seq_len=16)
    with pytest.raises(ConfigError, match="chat records need a tokenizer with a chat template"):
        to_rows(Records("mem", [chat]), Bytes(), seq_len=16)


def test_a_completion_truncated_away_drops_the_record_and_says_so(tmp_path):
    chat_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    records = Records("mem", [{"prompt": "a long prompt", "completion": "x"}, {"prompt": "a", "completion": "bc"}])
    rows = to_rows(records, tok, seq_len=8)
    assert rows.counts["dropped"] == 1 and rows.counts["truncated"] == 1 and rows.rows == 1


def test_sources_one_record_per_line_and_messages_that_name_the_record(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("first line\n\n  \nsecond line\n")
    assert [r["text"] for r in read_records(str(txt)).records] == ["first line", "second line"]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"b.jsonl:3: a text record needs a 'text' field holding a string"):
        to_rows(read_records(str(bad)), Bytes(), 8)
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"c.jsonl:2: not a JSON record"):
        read_records(str(tmp_path / "c.jsonl"))
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps([{"body": "one"}, {"body": "two"}]))
    rows = to_rows(read_records(str(arr)), Bytes(), 8, text_field="body")
    assert rows.rows == 2
    csv = tmp_path / "e.csv"
    csv.write_text('user,text\nu1,"hello, world"\nu2,bye\n')
    assert read_records(str(csv)).records == [{"user": "u1", "text": "hello, world"}, {"user": "u2", "text": "bye"}]
    for path, message in [
        (tmp_path / "none.jsonl", "does not exist"),
        (tmp_path / "f.tsv", "unsupported file type '.tsv'"),
        (tmp_path, "not a folder written by datasets' save_to_disk"),
    ]:
        if path.suffix == ".tsv":
            path.write_text("x")
        with pytest.raises(DataError, match=message):
            check_source(str(path))


def test_datasets_folders_and_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"text": "alpha"}, {"text": "beta"}])
    ds.save_to_disk(str(tmp_path / "saved"))
    assert [r["text"] for r in read_records(str(tmp_path / "saved")).records] == ["alpha", "beta"]
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"holds several splits \['train', 'validation'\]: pass one of them"):
        check_source(str(tmp_path / "dict"))
    assert len(read_records(str(tmp_path / "dict" / "validation"))) == 2
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert read_records(str(tmp_path / "d.parquet")).records == [{"text": "alpha"}, {"text": "beta"}]


def test_tokenised_rows_are_cached_by_data_tokenizer_and_options(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello there"}\n{"text": "general kenobi"}\n')
    cache = str(tmp_path / "cache")
    first, file, hit = tokenized(str(data), Bytes(), 8, cache_dir=cache)
    again, same, hit2 = tokenized(str(data), Bytes(), 8, cache_dir=cache)
    assert not hit and hit2 and file == same and torch.equal(first.labels, again.labels)
    assert again.counts == first.counts
    other, other_file, hit3 = tokenized(str(data), Bytes(), 9, cache_dir=cache)  # another seq_len: another file
    assert not hit3 and other_file != file
    data.write_text('{"text": "hello there!"}\n{"text": "general kenobi"}\n')  # the content changed
    _, changed, hit4 = tokenized(str(data), Bytes(), 8, cache_dir=cache)
    assert not hit4 and changed != file
    assert sorted(os.listdir(cache)) == sorted(os.path.basename(f) for f in (file, other_file, changed))


def test_user_units_group_cap_and_pad_and_the_held_out_split():
    records = [{"text": f"r{i}", "user": u} for i, u in enumerate(["a", "b", "a", "c", "a", "b", "a"])]
    rows = to_rows(Records("mem", records), Bytes(), 4, user_field="user")
    units = user_units(rows, per_user=2)
    assert units.rows == [[0, 2], [1, 5], [3]]  # a's first two, b's two, c's one
    assert units.counts == {"units": 3, "users capped": 1, "records cut": 2, "padding rows": 1}
    ids, labels, mask = assemble(rows, units, [0, 2])  # users a and c: 2 + 2 rows, the last one padding
    assert ids.shape == (4, 4) and ids.dtype == torch.long
    assert (labels[3] == -100).all() and (mask[3] == 0).all() and (labels[:3] != -100).any(dim=1).all()
    assert mask[:3].sum(dim=1).tolist() == [1, 1, 1]  # "rN" -> 1 input token each
    with pytest.raises(DataError, match=r"mem: record 1: no 'user' field"):
        to_rows(Records("mem", [{"text": "ab"}]), Bytes(), 4, user_field="user")
    train, held = hold_out(100, 0.1, seed=3)
    assert len(held) == 10 and not set(train) & set(held) and sorted(train + held) == list(range(100))
    assert hold_out(100, 0.1, seed=3) == (train, held) and hold_out(100, 0.1, seed=4) != (train, held)
    assert hold_out(5, None, 0) == ([0, 1, 2, 3, 4], [])
    assert len(record_units(rows)) == rows.rows


def test_data_and_optimizer_configs_refuse_bad_values():
    for kwargs, message in [
        ({"privacy_unit": "user"}, "needs user_field"),
        ({"privacy_unit": "user", "user_field": "u"}, "needs max_records_per_user"),
        ({"user_field": "u"}, "user_field: only with privacy_unit 'user'"),
        ({"eval_fraction": 1.0}, r"eval_fraction: must be in \(0, 1\)"),
        ({"eval_every": 5}, "eval_every: give evaluation data"),
        ({"seq_len": 0}, "seq_len: must be >= 1"),
        ({"format": "xml"}, "unknown format 'xml'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            DataConfig(**kwargs).validate()
    for kwargs, message in [
        ({"lr": 0.0}, "lr: must be > 0"),
        ({"no_decay": "bias,layers"}, r"no_decay: unknown kind\(s\) \['layers'\]"),
        ({"adam_beta2": 1.0}, r"adam_beta2: must be in \[0, 1\)"),
        ({"warmup_ratio": 1.5}, "warmup_ratio"),
        ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            OptimizerConfig(**kwargs).validate()


def test_learning_rate_schedules():
    warm = OptimizerConfig(lr_schedule="linear", warmup_steps=4)
    assert [warm.lr_factor(s, 10) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [round(warm.lr_factor(s, 10), 6) for s in range(4, 10)] == [1.0, 0.833333, 0.666667, 0.5, 0.333333, 0.166667]
    cosine = OptimizerConfig(lr_schedule="cosine", warmup_ratio=0.1)
    assert cosine.warmup(100) == 10 and cosine.lr_factor(10, 100) == 1.0
    assert abs(cosine.lr_factor(55, 100) - 0.5) < 1e-12 and 0 < cosine.lr_factor(99, 100) < 1e-3
    assert OptimizerConfig().lr_factor(0, 10) == OptimizerConfig().lr_factor(9, 10) == 1.0  # constant

"""--seq-len's default for a Hugging Face model: a private run takes the model's positions (public, at most 512) and
only suggests the data's 95th percentile of the records' token lengths (rounded up to a multiple of 8, bounded by
the positions: a statistic of the private records); a non-private run takes it. Printed with the truncation count,
warned above 5%."""

import json
import math

import pytest

from pipedp.data.rows import length_from_data
from tests.test_cli import tiny_gpt2_folder  # a tiny GPT-2 of 32 positions with a one-token-per-character tokenizer


def test_the_rule_against_a_sorted_list():
    lengths = list(range(2, 102))  # 100 records of 2..101 tokens: a row of L - 1 inputs holds L tokens
    # the 95th of 100 in order needs 96 - 1 = 95 ... rounded up to 96; computed here by hand
    assert length_from_data(lengths, None) == 96
    assert length_from_data(lengths, 64) == 64
    assert length_from_data([5] * 10, None) == 8


def run(cli, tmp_path, texts, *flags):
    transformers = pytest.importorskip("transformers")
    folder, _ = tiny_gpt2_folder(transformers, tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    out = cli(
        "train", "--inprocess", "--model", str(folder), "--data", str(data), "--steps", "1", "--batch-size", "4",
        "--checkpoint-dir", str(tmp_path / "run"), "--no-progress", *flags,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.load(open(tmp_path / "run" / "config.json"))["resolved"]["seq_len"]


def test_a_private_run_only_suggests_the_datas_length_and_a_non_private_one_takes_it(tmp_path, cli):
    texts = ["the cat sat on a mat"] * 40 + ["the dog sat on the log and the frog sat on the bog"]  # 20 and 51 chars
    want = math.ceil((20 - 1) / 8) * 8  # every short record whole: 19 inputs, rounded up to 24
    private, seq_len = run(cli, tmp_path / "private", texts)
    assert seq_len == 32 and "--seq-len 32: the model's positions" in private.stdout  # public: the data's is not
    assert f"The data suggest --seq-len {want}" in private.stdout
    out, seq_len = run(cli, tmp_path, texts, "--disable-dp")
    assert seq_len == want and f"--seq-len {want} from the data" in out.stdout
    assert f"41 text records -> 41 rows of {want} tokens; 1 truncated" in out.stdout
    assert "are truncated at" not in out.stdout  # 1 of 41 is under 5%: no truncation warning


def test_the_models_positions_bound_it_and_a_truncating_length_is_warned_about(tmp_path, cli):
    texts = ["the dog sat on the log and the frog sat on the bog"] * 20  # 51 tokens each; the model has 32 positions
    out, seq_len = run(cli, tmp_path, texts, "--disable-dp")
    assert seq_len == 32 and "at most the model's 32 positions" in out.stdout
    assert "warning: 20 of 20 records (100%) are truncated at --seq-len 32" in out.stdout
    given, _ = run(cli, tmp_path / "given", ["the cat sat on a mat"] * 20, "--seq-len", "8")
    assert "warning: 20 of 20 records (100%) are truncated at --seq-len 8 (as given)" in given.stdout
    assert "from the data" not in given.stdout

"""Inputs at the edges: a frozen base changed outside the old fingerprint's sample, checkpoints written
before the sha256, a tiny learning rate, blank keys, signed folders resumed without their key, undecodable
or BOM-prefixed data files, chat turns with unknown roles."""

import hashlib
import json
import time
import warnings

import pytest
import torch
import torch.nn as nn
from steps import class_data, class_loss

from pipedp import CheckpointError, PipelineDPTrainer
from pipedp.data.rows import to_rows
from pipedp.data.sources import DataError, Records, read_records
from pipedp.train import checkpoint
from pipedp.train.checkpoint import format as fmt
from pipedp.train.checkpoint import tensorfile


def data(n=40):
    return class_data(n, 6, 3, 0)


def model():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 3000), nn.Tanh(), nn.Linear(3000, 3)).double()
    net[0].weight.requires_grad_(False)  # the frozen base: 18 000 elements, 1024 of them in the old sample
    return net


def trainer(net=None, lr=0.05):
    return PipelineDPTrainer(
        net or model(),
        class_loss,
        lambda p: torch.optim.SGD(p, lr=lr),
        stages=2,
        microbatches=2,
        noise_multiplier=0.7,
        max_grad_norm=0.3,
        expected_batch_size=8,
        sample_rate=0.2,
        seed=3,
    )


def outside_the_sample(weight):
    """An element the old fingerprint never read (it sampled every n // 1024-th element)."""
    n = weight.numel()
    return (n // 1024) + 1


# ---- 1. the frozen base, by content ---------------------------------------------------------------------------
def test_a_base_changed_outside_the_old_sample_is_refused_naming_the_tensor(tmp_path):
    trainer().fit(data(), steps=1, checkpoint_dir=str(tmp_path))
    changed = model()
    with torch.no_grad():
        changed[0].weight.view(-1)[outside_the_sample(changed[0].weight)] += 0.5
    before, after = tensorfile.fingerprint(model()[0].weight), tensorfile.fingerprint(changed[0].weight)
    assert sampled(after).matches(sampled(before))  # the planted case: the old check did not see the change
    with pytest.raises(CheckpointError, match=r"frozen tensor 0.weight is not the one .*sha256 differs"):
        trainer(changed).load_checkpoint(str(tmp_path))
    trainer().load_checkpoint(str(tmp_path))  # the same base resumes


def sampled(f):
    """The fingerprint as checkpoints before the sha256 had it."""
    return fmt.Fingerprint(f.shape, f.dtype, f.value, f.scale)


def test_a_checkpoint_without_sha256_is_checked_by_the_old_sample_with_a_warning(tmp_path):
    trainer().fit(data(), steps=1, checkpoint_dir=str(tmp_path))
    step = next(p for p in tmp_path.iterdir() if p.name.startswith("step-"))
    manifest = json.loads((step / "manifest.json").read_text())
    for stage in manifest["stages"]:
        for entry in stage["frozen"].values():
            del entry["sha256"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="checked on a sample of 1024 elements per tensor only"):
        trainer().load_checkpoint(str(tmp_path))
    other = model()
    with torch.no_grad():
        other[0].weight.view(-1)[0] += 0.5  # in the sample: refused by the old rule
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="sampled fingerprint differs"):
        trainer(other).load_checkpoint(str(tmp_path))


def test_the_sha256_is_of_the_bytes_streamed_without_a_copy():
    t = torch.randn(3, 5, dtype=torch.bfloat16)
    assert tensorfile.fingerprint(t).sha256 == hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    strided = torch.randn(6, 5).t()  # a non-contiguous view: hashed in row pieces, as its contiguous copy
    assert tensorfile.fingerprint(strided).sha256 == tensorfile.fingerprint(strided.contiguous()).sha256
    assert tensorfile.fingerprint(torch.empty(0, 3)).sha256 == hashlib.sha256(b"").hexdigest()
    assert tensorfile.fingerprint(torch.empty(2, device="meta")).sha256 is None


@pytest.mark.slow
def test_hashing_cost_of_a_large_tensor():
    """The figure in docs/checkpoints.md: 1 GiB of bf16, one thread."""
    t = torch.zeros(1 << 29, dtype=torch.bfloat16)
    start = time.perf_counter()
    tensorfile.fingerprint(t)
    assert time.perf_counter() - start < 30


# ---- 7. small learning rates, keys -----------------------------------------------------------------------------
@pytest.mark.parametrize("lr", [0.0, 1e-300])
def test_a_learning_rate_that_cannot_change_anything_is_warned(lr):
    with pytest.warns(UserWarning, match="steps change nothing but are charged epsilon"):
        trainer(model().float(), lr=lr)  # 1e-300 is below float32's smallest normal number (1.2e-38)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(model().float(), lr=1e-30)  # above the smallest normal number: not warned


@pytest.mark.parametrize("key", [" ", "\t\n", b"  "])
def test_a_whitespace_only_key_is_refused_like_an_empty_one(key):
    with pytest.raises(CheckpointError, match="only whitespace: a blank key signs with no secret"):
        checkpoint.resolve_key(key)


def test_a_signed_folder_resumed_without_its_key_is_refused(tmp_path):
    trainer().fit(data(), steps=2, checkpoint_dir=str(tmp_path), checkpoint_key="secret")
    with pytest.raises(CheckpointError, match="this folder's checkpoints are signed: pass the key"):
        trainer().fit(data(), steps=4, checkpoint_dir=str(tmp_path), resume=True)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002"]  # no unsigned step was written
    assert trainer().fit(data(), steps=3, checkpoint_dir=str(tmp_path), resume=True, checkpoint_key="secret").steps == 3


# ---- 7. data files -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", [".jsonl", ".txt", ".json", ".csv"])
def test_a_byte_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path, ext):
    body = {
        ".jsonl": b'{"text": "a"}\n{"text": "b"}\n{"text": "caf\xe9"}\n',
        ".txt": b"a\nb\ncaf\xe9\n",
        ".json": b'[{"text": "a"},\n {"text": "b"},\n {"text": "caf\xe9"}]\n',
        ".csv": b"text\na\nb\ncaf\xe9\n",
    }[ext]
    path = tmp_path / f"data{ext}"
    path.write_bytes(body)
    line = 4 if ext == ".csv" else 3
    with pytest.raises(DataError, match=rf"data{ext}:{line}: byte 0xe9 is not UTF-8.*convert it to UTF-8"):
        read_records(str(path))


@pytest.mark.parametrize("ext", [".jsonl", ".txt", ".json", ".csv"])
def test_a_byte_order_mark_is_accepted(tmp_path, ext):
    body = {
        ".jsonl": '{"text": "a"}\n{"text": "b"}\n',
        ".txt": "a\nb\n",
        ".json": '[{"text": "a"}, {"text": "b"}]',
        ".csv": "text\na\nb\n",
    }[ext]
    path = tmp_path / f"data{ext}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert [r["text"] for r in read_records(str(path)).records] == ["a", "b"]


class ChatBytes:
    """A byte tokenizer with a plain chat template (rendered prefix by prefix)."""

    pad_id, eos_id = 0, None

    def encode(self, text, special=True):
        return list(text.encode())

    def render_chat(self, messages, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_a_chat_turn_with_an_unknown_role_is_warned_and_counted():
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 2
    records.append({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "yes"}]})
    with pytest.warns(UserWarning, match=r"1 chat turns have a role other than .*'bot' \(1\).*never trained on"):
        rows = to_rows(Records("chats.jsonl", records), ChatBytes(), 64, "chat")
    assert rows.counts["unknown roles"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the known roles alone: no warning
        to_rows(Records("chats.jsonl", records[:2]), ChatBytes(), 64, "chat")

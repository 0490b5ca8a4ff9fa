"""Hostile and damaged checkpoint folders, each planted as an attacker (or a crash) would leave it:
rolled-back, renamed, copied or foreign step folders, removed signatures, empty keys, non-UTF-8 and
truncated files, manifest fields removed or of the wrong type, pickles and links. Each is refused
with a CheckpointError naming the file (or, for what pipedp never reads, ignored), never loaded."""

import hashlib
import json
import os
import pickle
import shutil

import pytest
import torch
from steps import class_data, class_trainer, classifier

from pipedp import CheckpointError

MARKER = "pipedp-planted-pickle-ran"
KEY = "secret"


def data(n=60, seed=0):
    return class_data(n, 8, 4, seed)


def trainer(lr=0.2, **kw):
    return class_trainer(classifier(), lambda p: torch.optim.SGD(p, lr=lr, momentum=0.5), **kw)


def steps_in(root):
    return sorted(p.name for p in root.glob("step-*"))


def newest(root):
    return root / steps_in(root)[-1]


def rewrite_manifest(folder, edit):
    """What whoever can write the folder does: edit the manifest and write it back (signature untouched)."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def loaded(root, key=None):
    t = trainer()
    t.load_checkpoint(str(root), key=key)
    return t


# ---- rollback: an older step presented as the newest -------------------------------------------------
@pytest.fixture
def three_signed_steps(tmp_path):
    root = tmp_path / "ckpt"
    first = trainer()
    first.fit(data(), steps=3, checkpoint_dir=str(root), checkpoint_every=1, checkpoint_key=KEY)
    assert steps_in(root) == ["step-00000001", "step-00000002", "step-00000003"]
    return root, first.epsilon(1e-5)


def test_a_latest_pointer_is_not_what_a_resume_follows(three_signed_steps):
    root, eps = three_signed_steps
    (root / "latest").write_text("step-00000001")  # the attack on the old layout: point at an older step
    t = trainer()
    t.fit(data(), steps=4, checkpoint_dir=str(root), resume=True, checkpoint_key=KEY)
    assert t.steps_taken == 4 and (root / "step-00000004").is_dir()
    resumed = loaded(root, KEY)
    assert resumed.steps_taken == 4
    (root / "latest").write_bytes(b"\xff\xfe not even UTF-8")  # a damaged pointer is no error either: never read
    assert loaded(root, KEY).steps_taken == 4


@pytest.mark.parametrize("how", ["rename", "copy"])
def test_an_older_signed_step_under_a_newer_name_is_refused(three_signed_steps, how):
    root, _ = three_signed_steps
    move = os.rename if how == "rename" else shutil.copytree
    move(root / "step-00000001", root / "step-00000009")
    for key in (KEY, None):  # the folder's own name is in the manifest: caught with or without a key
        with pytest.raises(CheckpointError, match="step-00000009.*written for the step folder 'step-00000001'"):
            loaded(root, key)


def test_the_newest_manifest_swapped_for_an_older_signed_one_is_refused(three_signed_steps):
    root, _ = three_signed_steps
    for name in ("manifest.json", "manifest.hmac"):
        shutil.copy(root / "step-00000001" / name, root / "step-00000003" / name)
    with pytest.raises(CheckpointError, match="step-00000003.*written for the step folder 'step-00000001'"):
        loaded(root, KEY)


@pytest.mark.parametrize("removed", ["manifest.json", "manifest.hmac"])
def test_a_newest_folder_without_its_manifest_or_signature_is_an_error_not_a_fall_back(three_signed_steps, removed):
    root, _ = three_signed_steps
    os.unlink(root / "step-00000003" / removed)
    with pytest.raises(CheckpointError, match=f"step-00000003/{removed}.*is missing"):
        loaded(root, KEY)
    with pytest.raises(CheckpointError, match=f"step-00000003/{removed}.*is missing"):
        trainer().fit(data(), steps=5, checkpoint_dir=str(root), resume=True, checkpoint_key=KEY)


def test_an_unsigned_older_folder_is_refused_under_a_key(three_signed_steps):
    root, _ = three_signed_steps
    os.unlink(root / "step-00000001" / "manifest.hmac")  # every step folder is checked, not only the newest
    with pytest.raises(CheckpointError, match="step-00000001/manifest.hmac.*is missing"):
        loaded(root, KEY)


def test_deleting_the_newest_folders_is_what_a_key_cannot_catch(three_signed_steps):
    """Documented limit: the older folders are a valid history of the job, so the job resumes from them."""
    root, _ = three_signed_steps
    shutil.rmtree(root / "step-00000003")
    assert loaded(root, KEY).steps_taken == 2


# ---- a folder of another job ----------------------------------------------------------------------
def test_a_step_folder_of_another_job_with_the_same_key_is_refused_by_name(tmp_path):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    trainer().fit(data(), steps=3, checkpoint_dir=str(mine), checkpoint_every=1, checkpoint_key=KEY)
    trainer(lr=0.05).fit(data(), steps=5, checkpoint_dir=str(theirs), checkpoint_every=1, checkpoint_key=KEY)
    # newer than mine: it would resume at step 5 with the other job's model
    shutil.copytree(theirs / "step-00000005", mine / "step-00000005")
    with pytest.raises(CheckpointError, match="two jobs: step-00000005 was written by job .*step-00000003 by another"):
        loaded(mine, KEY)
    shutil.rmtree(mine / "step-00000005")
    # older than mine, in place of one of my steps: the other job's history mixed into mine
    shutil.rmtree(mine / "step-00000002")
    shutil.copytree(theirs / "step-00000002", mine / "step-00000002")
    with pytest.raises(
        CheckpointError, match="two jobs: step-00000003 was written by job .*, but step-00000002 by another"
    ):
        loaded(mine, KEY)


def test_a_fresh_job_replaces_another_jobs_checkpoints_and_says_so(tmp_path):
    root = tmp_path / "ckpt"
    trainer().fit(data(), steps=3, checkpoint_dir=str(root), checkpoint_every=1)
    fresh = trainer(lr=0.05)
    with pytest.warns(UserWarning, match="held 3 step folder\\(s\\) of another job"):
        fresh.fit(data(), steps=2, checkpoint_dir=str(root))  # no resume: it starts afresh, as asked
    # (its step 2 was written beside the other job's before that one was removed: a second name)
    assert steps_in(root) == ["step-00000002-1"]
    again = trainer(lr=0.05)
    again.fit(data(), steps=3, checkpoint_dir=str(root), resume=True)
    assert steps_in(root) == ["step-00000002-1", "step-00000003"]  # the same job: nothing replaced
    assert loaded(root).steps_taken == 3


# ---- keys -------------------------------------------------------------------------------------------
def test_a_key_refuses_a_tampered_manifest_and_accepts_its_own(tmp_path):
    root = tmp_path / "ckpt"
    first = trainer()
    first.fit(data(), steps=3, checkpoint_dir=str(root), checkpoint_key=KEY)
    resumed = loaded(root, KEY)
    assert resumed.steps_taken == 3 and resumed.epsilon(1e-5) == first.epsilon(1e-5)
    with pytest.raises(CheckpointError, match="not signed with this key"):
        loaded(root, "another")
    rewrite_manifest(newest(root), lambda m: m["accountant"].update(history=[]))  # would report a smaller epsilon
    with pytest.raises(CheckpointError, match="not signed with this key"):
        loaded(root, KEY)
    with pytest.raises(CheckpointError, match="this folder's checkpoints are signed: pass the key"):
        loaded(root)  # a signed folder is never resumed unchecked (nor continued with unsigned steps)


@pytest.mark.parametrize("where", ["argument", "environment"])
def test_an_empty_key_is_refused_before_the_first_step(tmp_path, monkeypatch, where):
    kw = {}
    if where == "argument":
        kw["checkpoint_key"] = ""
    else:
        monkeypatch.setenv("PIPEDP_CHECKPOINT_KEY", "")
    t = trainer()
    name = "checkpoint_key" if where == "argument" else "PIPEDP_CHECKPOINT_KEY"
    with pytest.raises(CheckpointError, match=f"{name} is empty: an empty key signs with no secret"):
        t.fit(data(), steps=3, checkpoint_dir=str(tmp_path / "ckpt"), **kw)
    assert t.steps_taken == 0 and not steps_in(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="is empty"):
        t.save_checkpoint(str(tmp_path / "ckpt"), **({"key": ""} if kw else {}))
    with pytest.raises(CheckpointError, match="is empty"):
        t.load_checkpoint(str(tmp_path / "ckpt"), **({"key": b""} if kw else {}))


# ---- damaged files ----------------------------------------------------------------------------------
def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


DAMAGE = {
    "hmac not UTF-8": ("manifest.hmac", lambda p: p.write_bytes(b"\xff\xfe\x00garbage"), "manifest.hmac.*not text"),
    "hmac empty": ("manifest.hmac", lambda p: p.write_bytes(b""), "not signed with this key"),
    "manifest not UTF-8": ("manifest.json", lambda p: p.write_bytes(b"\xff\xfe{}"), "manifest.json.*not valid JSON"),
    "manifest truncated": ("manifest.json", _truncate, "manifest.json.*not valid JSON"),
    "manifest a list": ("manifest.json", lambda p: p.write_text("[1, 2]"), "manifest.json.*is a list, not a JSON"),
    "stage file truncated": ("stage-1.safetensors", _truncate, "stage-1.safetensors.*truncated or corrupted"),
    "stage file missing": ("stage-0.safetensors", os.unlink, "stage-0.safetensors.*missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_file_is_an_error_naming_it(tmp_path, damage):
    root = tmp_path / "ckpt"
    trainer().fit(data(), steps=2, checkpoint_dir=str(root), checkpoint_key=KEY)
    name, harm, message = DAMAGE[damage]
    harm(newest(root) / name)
    key = None if name == "manifest.json" else KEY  # a signed manifest cannot be altered undetected
    with pytest.raises(CheckpointError, match=message):
        loaded(root, key)


def test_a_stage_file_with_a_bad_header_and_a_fixed_hash_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    trainer().fit(data(), steps=2, checkpoint_dir=str(root))
    folder = newest(root)
    for bad in (b"\x00" * 4, (10**9).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"\xff\xfe"):
        (folder / "stage-1.safetensors").write_bytes(bad)
        fixed = {"sha256": hashlib.sha256(bad).hexdigest(), "size": len(bad)}
        rewrite_manifest(folder, lambda m, fixed=fixed: m["stages"][1].update(fixed))
        with pytest.raises(CheckpointError, match="stage-1.safetensors.*not a valid tensor file"):
            loaded(root)


class Planted:
    def __reduce__(self):  # what an attacker puts in a stage file
        return (open, (os.path.join(os.environ["PIPEDP_MARKER_DIR"], MARKER), "w"))


def test_a_planted_pickle_never_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEDP_MARKER_DIR", str(tmp_path))
    root = tmp_path / "ckpt"
    trainer().fit(data(), steps=2, checkpoint_dir=str(root))
    folder = newest(root)
    evil = pickle.dumps({"params": Planted(), "optimizer": {}})
    (folder / "stage-1.safetensors").write_bytes(evil)
    digest = hashlib.sha256(evil).hexdigest()  # whoever writes the folder fixes the hash
    rewrite_manifest(folder, lambda m: m["stages"][1].update(sha256=digest, size=len(evil)))
    with pytest.raises(CheckpointError, match="stage-1.safetensors.*not a valid tensor file"):
        loaded(root)
    assert not (tmp_path / MARKER).exists()


def _paths(value, path=()):
    """Every (path, value) in a JSON tree."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, path + (k,))
    elif isinstance(value, list):
        for k, v in enumerate(value):
            yield from _paths(v, path + (k,))


def _other_kind(value):
    if isinstance(value, bool) or value is None:
        return "text"
    if isinstance(value, (int, float)):
        return "12"
    if isinstance(value, str):
        return 12
    return {} if isinstance(value, list) else []


def adam_trainer():
    return class_trainer(
        classifier(),
        lambda p: torch.optim.Adam(p, lr=0.01),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5),
    )


def test_every_manifest_field_removed_or_of_the_wrong_type_is_a_checkpoint_error(tmp_path):
    """Each field of a real manifest in turn (no key, so nothing but the parser and the loader's checks
    stand in the way): removed, then replaced by a value of another type. Loading must raise a
    CheckpointError naming the manifest, or load a state that still trains: never a KeyError, TypeError..."""
    root = tmp_path / "ckpt"
    adam_trainer().fit(data(), steps=2, checkpoint_dir=str(root))
    folder = newest(root)
    original = (folder / "manifest.json").read_text()
    paths = [p for p, _ in _paths(json.loads(original)) if p]
    assert len(paths) > 100
    x, y = data(20)
    escaped, accepted = [], []
    for path in paths:
        for change in ("remove", "retype"):
            manifest = json.loads(original)
            parent = manifest
            for k in path[:-1]:
                parent = parent[k]
            if change == "remove":
                del parent[path[-1]]
            else:
                parent[path[-1]] = _other_kind(parent[path[-1]])
            (folder / "manifest.json").write_text(json.dumps(manifest))
            victim = adam_trainer()
            try:
                victim.load_checkpoint(str(root))
            except CheckpointError as exc:
                assert str(folder / "manifest.json") in str(exc), (path, change, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - what the test is looking for
                escaped.append((path, change, f"{type(exc).__name__}: {exc}"))
                continue
            try:
                victim.step(x, y, sampling="poisson")
            except Exception as exc:  # noqa: BLE001 - a damage that loaded but breaks the next step
                escaped.append((path, change, f"next step: {type(exc).__name__}: {exc}"))
                continue
            accepted.append((path, change))
    assert not escaped, escaped[:10]
    # what loads: an accountant entry removed. Without a key nothing can tell that from a run that charged
    # fewer steps (a shuffled epoch charges its first step only): tampering needs a key to be caught
    # and an optimizer flag removed (fused, foreach, ...: how this run's torch steps is its own choice, and an
    # older torch saves fewer of them); a flag of the wrong type is refused
    flags = ("fused", "foreach", "capturable", "differentiable")
    optional = {(p, "remove") for p in paths if len(p) == 5 and p[2] == "groups" and p[4] in flags}
    assert any(p[4] == "fused" for p, _ in optional)
    assert set(accepted) <= {(("accountant", "history", 0), "remove")} | optional, accepted


# ---- links and folders ------------------------------------------------------------------------------
def test_a_step_folder_that_is_a_link_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    trainer().fit(data(), steps=1, checkpoint_dir=str(root))
    outside = tmp_path / "elsewhere"
    os.rename(root / "step-00000001", outside)
    os.symlink(outside, root / "step-00000001")
    with pytest.raises(CheckpointError, match="step-00000001.*is a link or not a folder"):
        loaded(root)
    os.unlink(root / "step-00000001")
    (root / "step-00000002").write_text("a file")
    with pytest.raises(CheckpointError, match="step-00000002.*is a link or not a folder"):
        loaded(root)


def test_a_planted_symlink_is_removed_not_followed(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious")
    os.symlink(victim, root / "step-00000001")  # where the first save would go
    os.symlink(victim / "precious.txt", root / "latest")
    with pytest.warns(UserWarning, match="of another job"):
        trainer().fit(data(), steps=1, checkpoint_dir=str(root))
    assert (victim / "precious.txt").read_text() == "precious"
    assert steps_in(root) == ["step-00000001-1"] and loaded(root).steps_taken == 1


def test_a_lock_that_is_a_link_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, root / "lock")
    with pytest.raises(CheckpointError, match="lock' is a link: refused"):
        trainer().fit(data(), steps=1, checkpoint_dir=str(root))
    assert victim.read_text() == "precious"


# ---- crashes ----------------------------------------------------------------------------------------
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from pipedp.train.checkpoint import tensorfile

    root = tmp_path / "ckpt"
    t = trainer()
    t.fit(data(), steps=2, checkpoint_dir=str(root))
    real = tensorfile.write

    def dies_on_stage_1(path, tensors):
        if path.endswith("stage-1.safetensors"):
            raise OSError(28, "No space left on device")
        return real(path, tensors)

    monkeypatch.setattr(tensorfile, "write", dies_on_stage_1)
    with pytest.raises(OSError, match="No space left"):
        t.fit(data(), steps=3, checkpoint_dir=str(root))
    assert steps_in(root) == ["step-00000002"] and not list(root.glob(".tmp-*"))
    assert loaded(root).steps_taken == 2


def test_a_killed_save_leaves_a_temporary_folder_that_is_ignored_then_removed(tmp_path):
    root = tmp_path / "ckpt"
    trainer().fit(data(), steps=2, checkpoint_dir=str(root))
    half = root / ".tmp-step-00000004-123-abcd"  # a save killed before its rename
    half.mkdir()
    (half / "stage-0.safetensors").write_bytes(b"half")
    (root / "stage-0.pt.tmp-123-abcd").write_bytes(b"half a file")  # the older layout's temporaries
    assert loaded(root).steps_taken == 2
    t = trainer()
    t.fit(data(), steps=3, checkpoint_dir=str(root), resume=True)
    assert t.steps_taken == 3 and not list(root.glob("*.tmp-*")) and not list(root.glob(".tmp-*"))


# ---- moved from test_faults.py ------------------------------------------------------------------------
def test_keep_last_keeps_the_newest_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    trainer().fit(data(), steps=5, checkpoint_dir=str(root), checkpoint_every=1, keep_last=2)
    assert steps_in(root) == ["step-00000004", "step-00000005"]


def test_an_unwritable_folder_is_found_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    t = trainer()
    with pytest.raises(CheckpointError, match="cannot create the checkpoint folder"):
        t.fit(data(), steps=3, checkpoint_dir=str(blocker / "ckpt"))
    assert t.steps_taken == 0


def test_resume_without_a_checkpoint_says_so(tmp_path):
    with pytest.warns(UserWarning, match="holds no checkpoint: starting from step 0"):
        trainer().fit(data(), steps=1, checkpoint_dir=str(tmp_path / "empty"), resume=True)

"""The checkpoint's pieces alone, in milliseconds: the manifest's parser, the value codec, the tensor
files, fingerprints, the lock (including the unlink-while-locked race, made deterministic), the
folder's naming and the key."""

import collections
import fcntl
import hashlib
import json
import os

import pytest
import torch

from pipedp.errors import CheckpointError
from pipedp.train.checkpoint import KEY_ENV, FolderLock, exists, resolve_key, tensorfile
from pipedp.train.checkpoint import folder as layout
from pipedp.train.checkpoint import lock as lock_module
from pipedp.train.checkpoint.format import FORMAT, Fingerprint, Manifest, ParamState, StageRecord, decode, encode


def manifest(**changes):
    record = StageRecord(
        index=0,
        file="stage-0.safetensors",
        sha256="0" * 64,
        size=8,
        params={"a.weight": "p/a.weight"},
        groups=[{"lr": 0.1, "betas": {"__tuple__": [0.9, 0.99]}}],
        state={"a.weight": ParamState(0, {"exp_avg": "o/a.weight/exp_avg"}, {"count": 3})},
        scheduler={"last_epoch": 2, "base_lrs": [0.1]},
        aliases={"b.weight": "a.weight"},
        frozen={"c.weight": Fingerprint((2, 3), "float32", 1.5, 4.0)},
    )
    fields = dict(
        format=FORMAT,
        job="ab" * 16,
        step=7,
        folder="step-00000007",
        config={"seed": 1, "clipping": "flat"},
        mechanism="rdp",
        history=[(1.0, 0.01, 7)],
        stages=[record],
        seed=12345,
    )
    fields.update(changes)
    return Manifest(**fields)


# ---- the manifest -----------------------------------------------------------------------------------
def test_a_manifest_survives_its_bytes():
    m = manifest()
    assert Manifest.parse(m.to_bytes(), "x/manifest.json") == m
    assert m.where() == {"a.weight": m.stages[0], "b.weight": m.stages[0]}
    assert m.canonical("b.weight") == "a.weight" and m.canonical("a.weight") == "a.weight"


def _raw():
    return json.loads(manifest().to_bytes())


def _parse(raw):
    return Manifest.parse(json.dumps(raw).encode(), "/ck/step-00000007/manifest.json")


@pytest.mark.parametrize(
    "path",
    [
        ("format",),
        ("job",),
        ("step",),
        ("folder",),
        ("config",),
        ("accountant",),
        ("accountant", "mechanism"),
        ("accountant", "history"),
        ("stages",),
        ("stages", 0, "file"),
        ("stages", 0, "sha256"),
        ("stages", 0, "size"),
        ("stages", 0, "params"),
        ("stages", 0, "groups"),
        ("stages", 0, "state"),
        ("stages", 0, "state", "a.weight"),
        ("stages", 0, "state", "a.weight", "group"),
        ("stages", 0, "state", "a.weight", "tensors"),
        ("stages", 0, "scheduler"),
        ("stages", 0, "aliases"),
        ("stages", 0, "frozen"),
        ("stages", 0, "frozen", "c.weight", "value"),
        ("stages", 0, "index"),
        ("seed",),
    ],
)
def test_a_field_removed_is_named(path):
    raw = _raw()
    parent = raw
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]
    with pytest.raises(CheckpointError, match="step-00000007/manifest.json"):
        _parse(raw)


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("step",), "7", "step is a str, not a int"),
        (("step",), True, "step is a bool"),
        (("step",), -1, "step is -1, not >= 0"),
        (("job",), 5, "job is a int"),
        (("stages",), {}, "stages is a dict, not a list"),
        (("stages", 0), [], "stages\\[0\\] is a list, not a JSON object"),
        (("stages", 0, "size"), 1.5, "size is a float"),
        (("stages", 0, "params"), {"a.weight": 3}, "params maps a name to something other than a string"),
        (("stages", 0, "groups"), "x", "groups is a str"),
        (("stages", 0, "groups", 0), 3, "groups\\[0\\] is not an object"),
        (("stages", 0, "state", "a.weight", "group"), 4, "group is 4, but the stage has 1 param groups"),
        (("stages", 0, "frozen", "c.weight", "shape"), [2, -3], "shape is not a list of sizes"),
        (("stages", 0, "file"), "../../etc/passwd", "not a file name inside the step folder"),
        (("stages", 0, "aliases"), {"b.weight": "nowhere"}, "maps 'b.weight' to 'nowhere', which no stage holds"),
        (("stages", 0, "index"), 3, "stages are numbered \\[3\\]"),
        (("stages", 0, "groups", 0, "betas"), {"__tuple__": 5}, "malformed '__tuple__'"),
        (("stages", 0, "scheduler"), {"__tensor__": {"dtype": "float32", "data": "x"}}, "does not decode"),
        (("accountant", "history", 0), [1.0, 0.1], "is not \\[noise multiplier, sample rate, steps\\]"),
        (("accountant", "history", 0), [1.0, "q", 3], "history\\[0\\].1 is a str"),
        (("format",), "pipedp-checkpoint-1", "written by another version of pipedp"),
        (("seed",), "12345", "seed is a str, not a int"),
        (("seed",), -2, "seed is -2, not >= 0"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(path, value, message):
    raw = _raw()
    parent = raw
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    with pytest.raises(CheckpointError, match=message):
        _parse(raw)


@pytest.mark.parametrize("data", [b"\xff\xfe{}", b"", b"{", b"null", b"[1]", b'{"format": 1}'])
def test_bytes_that_are_no_manifest_are_named(data):
    with pytest.raises(CheckpointError, match="step-00000007/manifest.json"):
        Manifest.parse(data, "/ck/step-00000007/manifest.json")


def test_the_format_before_the_secret_seed_resumes_with_the_seed_its_config_holds():
    raw = _raw()
    raw["format"] = "pipedp-checkpoint-2"
    del raw["seed"]
    assert _parse(raw).seed == 1  # the config's (seeds were always given then)
    raw["config"] = {"clipping": "flat"}
    with pytest.raises(CheckpointError, match="holds no integer seed"):
        _parse(raw)


def test_the_earlier_format_is_named():
    old = {"step": 3, "config": {}, "accountant": {"mechanism": "rdp", "history": []}, "stage_sha256": ["0" * 64]}
    with pytest.raises(CheckpointError, match="earlier format \\(stage-K.pt files\\)"):
        _parse(old)


def test_a_parameter_saved_without_its_optimizer_state_is_refused():
    raw = _raw()
    raw["stages"][0]["params"]["z"] = "p/z"
    with pytest.raises(CheckpointError, match="state has no entry for parameter 'z'"):
        _parse(raw)


# ---- plain values -----------------------------------------------------------------------------------
def test_values_json_cannot_hold_survive_the_codec():
    value = {
        "betas": (0.9, 0.999),
        "milestones": collections.Counter({30: 1, 80: 2}),
        "by_int": {1: "a", 2: (3, None)},
        "__looks_like_a_tag": [1, 2],
        "nested": [{"lr": float("inf")}, True, None, "x"],
    }
    back = decode(json.loads(json.dumps(encode(value, "w"))), "w", "f")
    assert back == value and isinstance(back["milestones"], collections.Counter)
    assert isinstance(back["betas"], tuple) and isinstance(back["by_int"][2], tuple)
    t = decode(json.loads(json.dumps(encode(torch.tensor([0.5, 0.25]), "w"))), "w", "f")
    assert torch.equal(t, torch.tensor([0.5, 0.25])) and t.dtype == torch.float32


@pytest.mark.parametrize("value", [object(), lambda s: s, torch.zeros(10_000), {1, 2}])
def test_values_a_checkpoint_cannot_hold_are_refused_by_name(value):
    with pytest.raises(CheckpointError, match="the LR scheduler holds a"):
        encode({"x": [value]}, "the LR scheduler")


@pytest.mark.parametrize(
    "bad",
    [{"__dict__": 3}, {"__dict__": [[1]]}, {"__dict__": [[[1], 2]]}, {"__counter__": "x"}, {"__tensor__": {}}],
)
def test_malformed_tags_are_named(bad):
    with pytest.raises(CheckpointError, match="manifest.json' is damaged: the scheduler"):
        decode(bad, "the scheduler", "manifest.json")


# ---- tensor files -----------------------------------------------------------------------------------
TENSORS = [
    ("f64", torch.randn(3, 4, dtype=torch.float64)),
    ("f32 0-dim", torch.tensor(2.5)),
    ("bf16", torch.randn(5, dtype=torch.bfloat16)),
    ("f16", torch.randn(2, 2).half()),
    ("i64", torch.arange(7)),
    ("bool", torch.tensor([True, False, True])),
    ("u8", torch.arange(5, dtype=torch.uint8)),
    ("empty", torch.zeros(0, 3)),
    ("transposed", torch.randn(4, 6).t()),  # not contiguous: written in row chunks
    ("a view", torch.randn(10)[3:8]),
]


def test_tensor_files_round_trip_and_the_safetensors_library_reads_them(tmp_path):
    path = str(tmp_path / "t.safetensors")
    sha, size = tensorfile.write(path, TENSORS)
    assert size == os.path.getsize(path) and sha == hashlib.sha256(open(path, "rb").read()).hexdigest()
    f = tensorfile.TensorFile(path, sha, size)
    for key, t in TENSORS:
        got = f.read(key)
        assert got.dtype == t.dtype and torch.equal(got, t), key
    f.close()
    safetensors = pytest.importorskip("safetensors.torch")
    loaded = safetensors.load_file(path)
    assert all(torch.equal(loaded[k], t) for k, t in TENSORS)


def test_a_tensor_file_is_checked_before_it_is_read(tmp_path):
    path = tmp_path / "t.safetensors"
    sha, size = tensorfile.write(str(path), TENSORS[:2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        tensorfile.TensorFile(str(path), "1" * 64, size)
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        tensorfile.TensorFile(str(path), sha, size + 1)
    with pytest.raises(CheckpointError, match="missing or unreadable"):
        tensorfile.TensorFile(str(tmp_path / "nope"), sha, size)
    f = tensorfile.TensorFile(str(path), sha, size)
    with pytest.raises(CheckpointError, match="holds no tensor 'other'"):
        f.read("other")
    f.close()


def _file(tmp_path, header, data=b""):
    head = json.dumps(header).encode()
    raw = len(head).to_bytes(8, "little") + head + data
    path = tmp_path / "h.safetensors"
    path.write_bytes(raw)
    return str(path), hashlib.sha256(raw).hexdigest(), len(raw)


@pytest.mark.parametrize(
    "header, data",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, b"\0" * 12),  # wrong size for the shape
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),  # past the end
        ({"a": {"dtype": "X99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
        ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4),
        ({"a": 3}, b""),
        ([1, 2], b""),
    ],
)
def test_a_tensor_file_with_a_hostile_header_is_refused(tmp_path, header, data):
    with pytest.raises(CheckpointError, match="not a valid tensor file"):
        tensorfile.TensorFile(*_file(tmp_path, header, data))


def test_fingerprints_tell_tensors_apart_cheaply():
    t = torch.randn(1000, 300)
    fp = tensorfile.fingerprint(t)
    assert fp.matches(tensorfile.fingerprint(t.clone())) and fp.matches(tensorfile.fingerprint(t.t().contiguous().t()))
    other = t.clone()
    other[0, 0] += 1e-3  # the first element is always in the sample
    assert not fp.matches(tensorfile.fingerprint(other))
    assert not fp.matches(tensorfile.fingerprint(t.double()))
    assert not fp.matches(tensorfile.fingerprint(t.reshape(300, 1000)))
    assert not fp.matches(tensorfile.fingerprint(torch.randn(1000, 300)))
    swapped = torch.cat([t[1:], t[:1]])  # the same values elsewhere: weighted by position
    assert not fp.matches(tensorfile.fingerprint(swapped))
    assert tensorfile.fingerprint(torch.zeros(0)).matches(tensorfile.fingerprint(torch.zeros(0)))


# ---- the lock ---------------------------------------------------------------------------------------
def test_one_lock_per_folder_even_within_one_process(tmp_path):
    first, second = FolderLock(str(tmp_path)), FolderLock(str(tmp_path))
    first.acquire()
    owner = json.loads((tmp_path / "lock").read_text())
    assert owner["pid"] == os.getpid()
    with pytest.raises(CheckpointError, match=f"in use by another job \\(pid {os.getpid()} on"):
        second.acquire()
    first.release()
    assert not (tmp_path / "lock").exists()
    second.acquire()
    second.release()
    first.release()  # twice: nothing


def test_a_lock_released_between_a_contenders_open_and_lock_is_taken_again_not_orphaned(tmp_path, monkeypatch):
    """The unlink-while-locked race, made to happen: the holder releases (unlinks) the file after the
    contender opened it and before it locks it. Without the inode check the contender would hold a lock
    on a deleted file and a third job would take the folder too."""
    holder, contender, third = (FolderLock(str(tmp_path)) for _ in range(3))
    holder.acquire()
    real = fcntl.flock
    calls = []

    def release_first(fd, op):
        calls.append(op)
        if len(calls) == 1:
            holder.release()  # unlinks the path the contender has just opened, then unlocks it
        return real(fd, op)

    monkeypatch.setattr(lock_module.fcntl, "flock", release_first)
    contender.acquire()
    monkeypatch.setattr(lock_module.fcntl, "flock", real)
    assert len(calls) == 2  # locked the orphan, saw it, locked the file now at the path
    assert os.stat(tmp_path / "lock").st_ino == os.fstat(contender._fd).st_ino
    with pytest.raises(CheckpointError, match="in use by another job"):
        third.acquire()
    contender.release()


def test_taking_the_lock_removes_what_a_killed_save_left(tmp_path):
    (tmp_path / ".tmp-step-00000003-1-ab").mkdir()
    (tmp_path / ".tmp-step-00000003-1-ab" / "stage-0.safetensors").write_bytes(b"half")
    (tmp_path / "stage-0.pt.tmp-1-ab").write_bytes(b"half")  # the older layout's
    (tmp_path / "step-00000002").mkdir()
    lock = FolderLock(str(tmp_path))
    lock.acquire()
    assert sorted(os.listdir(tmp_path)) == ["lock", "step-00000002"]
    lock.release()


def test_a_lock_that_is_a_link_or_an_unwritable_place_is_refused(tmp_path):
    os.symlink(tmp_path / "elsewhere", tmp_path / "lock")
    with pytest.raises(CheckpointError, match="is a link: refused"):
        FolderLock(str(tmp_path)).acquire()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot create the checkpoint folder"):
        FolderLock(str(tmp_path / "file" / "sub")).acquire()


# ---- the folder -------------------------------------------------------------------------------------
def test_step_folders_are_ordered_by_step_then_save_and_named_without_clashes(tmp_path):
    assert not exists(str(tmp_path)) and not exists(str(tmp_path / "missing"))
    assert layout.next_name(str(tmp_path), 3) == "step-00000003"
    for name in ("step-00000010", "step-00000003", "step-00000003-1", ".tmp-step-00000099-1-ab", "lock", "latest"):
        (tmp_path / name).mkdir()
    assert exists(str(tmp_path))
    assert layout.step_folders(str(tmp_path)) == ["step-00000003", "step-00000003-1", "step-00000010"]
    assert layout.next_name(str(tmp_path), 3) == "step-00000003-2"
    assert layout.next_name(str(tmp_path), 4) == "step-00000004"
    with pytest.raises(CheckpointError, match="step-00000010/manifest.json.*is missing"):
        layout.newest(str(tmp_path), None)


def test_the_signature_covers_the_manifest_bytes_and_nothing_else():
    assert layout.sign(b"k", b"m") != layout.sign(b"k", b"m ")
    assert layout.sign(b"k", b"m") != layout.sign(b"K", b"m")
    assert len(layout.sign(b"k", b"")) == 64


# ---- the key ----------------------------------------------------------------------------------------
def test_the_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert resolve_key(None) is None
    assert resolve_key("s") == b"s" and resolve_key(b"s") == b"s"
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert resolve_key(None) == b"from-env" and resolve_key("given") == b"given"
    for empty in ("", b""):
        with pytest.raises(CheckpointError, match="checkpoint_key is empty"):
            resolve_key(empty)
    monkeypatch.setenv(KEY_ENV, "")
    with pytest.raises(CheckpointError, match=f"{KEY_ENV} is empty"):
        resolve_key(None)
    assert resolve_key("given") == b"given"  # an explicit key wins over the environment
    with pytest.raises(CheckpointError, match="must be a string or bytes"):
        resolve_key(3)

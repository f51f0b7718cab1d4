"""The loader the training loop consumes: batch format, per-process shares, prefetch, resume, valid split, errors."""

import threading
import time

import numpy as np
import pytest

from mjax.config import Config, ConfigError
from mjax.data import DataError, DataIterator, IndexedDatasetWriter, build_data_iterators, make_batch


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sample_cache"))


def config(cache, **data) -> Config:
    return Config().replace(model=dict(vocab_size=1024),
                            train=dict(seq_length=32, global_batch_size=8, eval_iters=3, seed=7),
                            data=dict(data_cache_path=cache, **data))


def take(it, n):
    with it:
        return [next(it) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_sample_corpus_batches(cache):
    train, evals = build_data_iterators(config(cache))
    b = take(train, 1)[0]
    assert {k: (v.shape, v.dtype.name) for k, v in b.items()} == {
        "inputs": ((8, 32), "int32"), "targets": ((8, 32), "int32"), "loss_mask": ((8, 32), "float32"),
        "positions": ((8, 32), "int32"), "segment_ids": ((8, 32), "int32")}
    assert np.array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert b["inputs"].max() < 1024 and (b["segment_ids"] == 1).all() and (b["loss_mask"] == 1).all()
    assert (b["positions"] == np.arange(32)).all()
    assert set(evals) == {"valid", "test"}


def test_document_options(cache):
    train, _ = build_data_iterators(config(cache, reset_attention_mask=True, reset_position_ids=True,
                                           eod_mask_loss=True))
    batches = take(train, 4)
    seg = np.concatenate([b["segment_ids"] for b in batches])
    pos = np.concatenate([b["positions"] for b in batches])
    inputs = np.concatenate([b["inputs"] for b in batches])
    mask = np.concatenate([b["loss_mask"] for b in batches])
    assert seg.max() > 1  # some rows cross a document boundary
    new_doc = np.diff(seg, axis=1) != 0
    assert (pos[:, 1:][new_doc] == 0).all() and (pos[:, 1:][~new_doc] == pos[:, :-1][~new_doc] + 1).all()
    assert (inputs[:, :-1][new_doc] == 0).all()  # the sample corpus ends documents with EOD = 0
    assert np.array_equal(mask == 0, inputs == 0)


def test_resume_gives_identical_next_batches(cache):
    cfg = config(cache)
    reference = take(build_data_iterators(cfg)[0], 5)
    it = build_data_iterators(cfg)[0]
    with it:
        assert same([next(it), next(it)], reference[:2])
        state = it.state()
    assert state == {"consumed_samples": 16}
    resumed = build_data_iterators(cfg, consumed_samples=state["consumed_samples"])[0]
    assert same(take(resumed, 3), reference[2:])
    restored = build_data_iterators(cfg)[0]
    restored.restore(state)
    assert same(take(restored, 3), reference[2:])


def test_process_shares_make_the_global_batch(cache):
    cfg = config(cache)
    whole = take(build_data_iterators(cfg)[0], 2)
    parts = [take(build_data_iterators(cfg, process_index=p, process_count=2)[0], 2) for p in range(2)]
    for step in range(2):
        for k in whole[step]:
            assert parts[0][step][k].shape == (4, 32)
            assert np.array_equal(np.concatenate([parts[0][step][k], parts[1][step][k]]), whole[step][k])
    with pytest.raises(ConfigError, match="not divisible by the 3 processes"):
        build_data_iterators(cfg, process_count=3)


def test_prefetch_runs_ahead_and_matches_on_demand(cache):
    ahead = build_data_iterators(config(cache, prefetch=3))[0]
    deadline = time.time() + 10
    while ahead._queue.qsize() < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert ahead._queue.qsize() == 3  # prepared before being asked for
    assert same(take(ahead, 4), take(build_data_iterators(config(cache, prefetch=0))[0], 4))
    assert not any(t.name == "mjax-data-prefetch" and t.is_alive() for t in threading.enumerate())


def test_valid_iterator_is_eval_iters_batches_the_same_each_time(cache):
    train, evals = build_data_iterators(config(cache))
    with train, evals["valid"]() as first, evals["valid"]() as second:
        a, b = list(first), list(second)
        assert len(a) == 3 and same(a, b)
        assert not np.array_equal(a[0]["inputs"], next(train)["inputs"])
    assert build_data_iterators(config(cache, split="100,0,0"))[1] == {}


def test_mock_data(cache):
    cfg = config(cache, mock_data=True).replace(model=dict(vocab_size=50))
    train, evals = build_data_iterators(cfg)
    batches = take(train, 3)
    assert batches[0]["inputs"].shape == (8, 32) and batches[0]["inputs"].max() < 50
    assert same(batches, take(build_data_iterators(cfg)[0], 3))
    assert same(batches[1:], take(build_data_iterators(cfg, consumed_samples=8)[0], 2))
    assert len(list(evals["valid"]())) == 3


def write(path, docs, dtype=np.uint16):
    with IndexedDatasetWriter(path, dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(path)


def test_blend_of_two_datasets(cache, tmp_path):
    rng = np.random.default_rng(0)
    a = write(tmp_path / "a", [rng.integers(1, 500, 40) for _ in range(50)])
    b = write(tmp_path / "b", [rng.integers(500, 1000, 40) for _ in range(150)])
    for data_path, share_of_b in [(("0.25", a, "0.75", b), 0.75), ((a, b), 0.75), (("1", a, "0", b), 0.0)]:
        rows = np.concatenate([x["inputs"] for x in take(build_data_iterators(config(cache, data_path=data_path))[0],
                                                         8)])
        from_b = (rows >= 500).all(axis=1)
        assert ((rows < 500).all(axis=1) | from_b).all()  # a sample never mixes datasets
        assert abs(from_b.sum() - share_of_b * len(rows)) <= 1


@pytest.mark.parametrize("make, data, message", [
    (lambda p: write(p, [[1, 2, 3] * 30], np.uint8), {}, r"d\.bin stores uint8 token ids.*--tokenizer_type"),
    (lambda p: write(p, [[1, 2000, 3] * 30]), {}, r"d\.bin holds token id 2000.*--tokenizer_model"),
    (lambda p: str(p), {}, r"d\.idx does not exist"),
    (lambda p: write(p, [[1, 2, 3] * 30]), {"split": "0,1,0"}, "--split=0,1,0 leaves no training data"),
    (lambda p: write(p, [[1, 2, 3] * 30, [4] * 15]), {"split": "1,1"},
     r"valid split of .*d holds 15 tokens.*--seq_len"),
])
def test_bad_data(cache, tmp_path, make, data, message):
    cfg = config(cache, data_path=(make(tmp_path / "d"),), **data)
    with pytest.raises((DataError, ConfigError, FileNotFoundError), match=message):
        build_data_iterators(cfg)


def test_bad_flags(cache, tmp_path):
    with pytest.raises(ConfigError, match="--data_path=0.3 x 0.7: expected weight/prefix pairs"):
        build_data_iterators(config(cache, data_path=("0.3", "x", "0.7")))
    with pytest.raises(ConfigError, match="1024 tokens but --vocab_size=256"):
        build_data_iterators(config(cache).replace(model=dict(vocab_size=256)))


def test_errors_in_the_prefetch_thread_reach_the_caller():
    class Broken:
        def __getitem__(self, i):
            raise RuntimeError("disk on fire")

    with DataIterator(Broken(), 4) as it:
        for _ in range(2):  # asked again, it fails again instead of waiting for a thread that has stopped
            with pytest.raises(RuntimeError, match="disk on fire"):
                next(it)


def test_make_batch_is_the_iterator_format():
    it = DataIterator(type("D", (), {"__getitem__": lambda s, i: (np.arange(5) + i, np.ones(5, np.int32))})(), 2,
                      prefetch=0)
    b = next(it)
    assert b.keys() == make_batch(np.zeros((1, 5)), np.ones((1, 5))).keys()
    assert b["inputs"].tolist() == [[0, 1, 2, 3], [1, 2, 3, 4]]


@pytest.mark.parametrize("data, message", [
    (dict(tokenizer_type="huggingface", tokenizer_model="gpt2"), "--tokenizer_type=huggingface needs --data_path"),
    (dict(mock_data=True, data_path=("some/prefix",)), "--mock_data and --data_path are both set"),
])
def test_data_flags_that_would_be_silently_ignored_are_errors(data, message):
    with pytest.raises(ConfigError, match=message):
        build_data_iterators(Config().replace(data=data))

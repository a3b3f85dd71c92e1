import json

import numpy as np
import pytest

from gemmalab.data import documents, grain_batches, packing, token_cache
from gemmalab.data.packing import (
    FIELDS,
    BatchStream,
    WindowSource,
    assemble_rows,
    eval_batches,
    packed_fill,
    plan_rows,
    steps_per_epoch,
)
from gemmalab.data.tokenizer import BOS_ID, EOS_ID
from gemmalab.errors import ConfigError
from tests.helpers import write_text

SEP = "<|endoftext|>"


# --- reading -------------------------------------------------------------------------------


def test_iter_stories_splits_strips_and_drops_empty(tmp_path):
    path = write_text(tmp_path / "s.txt",
                      f"\ufeffOne.\n{SEP}\n  \n{SEP}\nTwo\nlines.\n{SEP}\n{SEP}Three{SEP}\n")
    assert list(documents.iter_stories(str(path))) == ["One.", "Two\nlines.", "Three"]


def test_iter_stories_keeps_text_after_the_last_separator(tmp_path):
    path = write_text(tmp_path / "s.txt", f"a{SEP}b")
    assert list(documents.iter_stories(str(path))) == ["a", "b"]


def test_iter_stories_streams_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "READ_CHUNK_BYTES", 7)  # cuts separators and multi-byte chars
    stories = [f"story {i} with ünïcödé ✓" for i in range(50)]
    path = write_text(tmp_path / "s.txt", "".join(f"{s}\n{SEP}\n" for s in stories))
    assert list(documents.iter_stories(str(path))) == stories


def test_non_utf8_byte_is_reported_with_its_offset(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "READ_CHUNK_BYTES", 16)
    path = write_text(tmp_path / "s.txt", b"good story " + SEP.encode() + b" caf\xe9 " * 10)
    with pytest.raises(ConfigError, match=r"^data_path: .* not UTF-8 .*offset 28\)"):
        list(documents.iter_stories(str(path)))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"caf\xe9 au lait" + SEP.encode(), "is not UTF-8 text"),
        (b"just one long text without the marker", "has no <|endoftext|> separator"),
        ((SEP + "\n  " + SEP).encode(), "only separators"),
    ],
)
def test_bad_data_files_fail_early_with_one_line(tmp_path, content, message):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        documents.validate_data_file(str(path))
    assert str(error.value).startswith("data_path: ")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_directory_is_not_a_data_file(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        documents.validate_data_file(str(tmp_path))


def test_gcs_data_path_without_credentials(monkeypatch):
    monkeypatch.setattr("gemmalab.storage._gcs_credentials_found", lambda: False)
    with pytest.raises(ConfigError, match="^data_path: gs://b/s.txt is on Google Cloud Storage"):
        documents.validate_data_file("gs://b/s.txt")


def test_split_rule_is_deterministic_and_shards_train_stories():
    stories = [f"s{i}" for i in range(100)]
    rule = documents.SplitRule(eval_fraction=0.1, max_eval_stories=5)
    labelled = list(rule.label_stories(iter(stories), datacount=None))
    evals = [s for label, s in labelled if label == "eval"]
    assert evals == ["s9", "s19", "s29", "s39", "s49"]  # every 10th, capped at 5
    shards = [
        [s for label, s in documents.SplitRule(0.1, 5, p, 3).label_stories(iter(stories), None)
         if label == "train"]
        for p in range(3)
    ]
    assert sorted(sum(shards, [])) == sorted(set(stories) - set(evals))
    assert not set(shards[0]) & set(shards[1])
    assert [len(s) for s in shards] == [32, 32, 31]


def test_datacount_caps_the_stories_read(stories_file):
    rule = documents.SplitRule(eval_fraction=0.5, max_eval_stories=100)
    stories = iter(["a"] * 50)
    assert len(list(rule.label_stories(stories, datacount=10))) == 10
    assert len(list(stories)) == 40  # not one more read
    labelled = documents.labelled_documents(str(stories_file), documents.TEXT, rule, 10)
    assert (len(list(labelled)), labelled.read) == (10, 10)  # the data table's "stories read"


# --- token cache ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_tokenizer(stories_file, tmp_path_factory):
    from gemmalab.data.tokenizer import load_tokenizer

    rule = documents.SplitRule(0.1, 100)
    stories = documents.training_stories(str(stories_file), rule, None)
    _, info = load_tokenizer("local", cache_dir=tmp_path_factory.mktemp("tok"),
                             training_stories=stories, vocab_size=600, corpus_fingerprint="test")
    return info


def test_token_cache_holds_bos_story_eos_and_is_reused(stories_file, local_tokenizer, tmp_path,
                                                       monkeypatch):
    import sentencepiece as spm

    corpus = documents.Corpus(str(stories_file), "fp", embedded=False)
    rule = documents.SplitRule(0.1, 100)
    cache = token_cache.load_or_build_token_cache(corpus, local_tokenizer, rule=rule,
                                                  datacount=None, cache_dir=tmp_path, workers=2)
    assert cache.meta["stories_read"] == 400
    assert cache.eval.num_docs == 40 and cache.train.num_docs == 360
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(local_tokenizer.model_proto)
    first_train = next(s for i, s in enumerate(documents.iter_stories(str(stories_file))) if i == 0)
    doc = cache.train.doc(0)
    assert doc[0] == BOS_ID and doc[-1] == EOS_ID
    assert processor.DecodeIds(doc[1:-1].tolist()) == first_train

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(token_cache, "_build_token_cache", no_rebuild)
    again = token_cache.load_or_build_token_cache(corpus, local_tokenizer, rule=rule,
                                                  datacount=None, cache_dir=tmp_path, workers=1)
    np.testing.assert_array_equal(again.train.tokens, cache.train.tokens)


def test_a_tokenizing_worker_that_dies_is_a_one_line_error_not_a_hang(local_tokenizer):
    """A worker killed mid-task (the kernel's OOM killer) fails the build at once, naming the
    setting that avoids workers; multiprocessing.Pool waited for its result forever."""
    from tests.helpers.dying_encoder import die

    stories = iter([("train", "Once upon a time.")] * 10)
    with pytest.raises(ConfigError, match=r"^tokenize_workers: a tokenizing worker process "
                                          r"died .* Fix: .*tokenize_workers=1"):
        list(token_cache._tokenize_in_order(stories, local_tokenizer.model_proto, 2, die))


def test_datacount_above_the_corpus_warns_and_uses_all(stories_file, local_tokenizer, tmp_path):
    corpus = documents.Corpus(str(stories_file), "fp", embedded=False)
    with pytest.warns(UserWarning, match="datacount=10000 but .* has only 400 stories"):
        cache = token_cache.load_or_build_token_cache(corpus, local_tokenizer,
                                                      rule=documents.SplitRule(0.1, 100),
                                                      datacount=10000, cache_dir=tmp_path,
                                                      workers=1)
    assert cache.train.num_docs + cache.eval.num_docs == 400


def test_too_few_stories_for_training_is_an_error(tmp_path, local_tokenizer):
    path = write_text(tmp_path / "s.txt", f"only one{SEP}")
    corpus = documents.Corpus(str(path), "fp", embedded=False)
    with pytest.raises(ConfigError, match="no training stories left"):
        token_cache.load_or_build_token_cache(corpus, local_tokenizer,
                                              rule=documents.SplitRule(0.5, 10, 1, 2),
                                              datacount=None, cache_dir=tmp_path, workers=1)


# --- rows ----------------------------------------------------------------------------------


def _split(*docs):
    tokens = np.concatenate([np.asarray(d, np.int32) for d in docs])
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return token_cache.TokenizedSplit(tokens=tokens, offsets=offsets)


def test_windows_cover_every_target_once_and_never_truncate():
    long_doc = list(range(100, 121))  # 21 tokens -> 20 pairs -> windows of 8, 8, 4
    split = _split([2, 5, 1], long_doc, [2, 1])
    source = WindowSource(split, maxlen=8)
    windows = [source[i] for i in range(len(source))]
    assert [len(w["inputs"]) for w in windows] == [2, 8, 8, 4, 1]
    assert source.num_targets == 2 + 20 + 1
    assert source.num_split_docs == 1
    targets = np.concatenate([w["targets"] for w in windows[1:4]])
    np.testing.assert_array_equal(targets, long_doc[1:])
    for w in windows:
        np.testing.assert_array_equal(w["inputs"][1:], w["targets"][:-1])


def test_padded_rows_mask_padding():
    split = _split([2, 10, 11, 1], [2, 20, 1])
    (batch,) = eval_batches(split, maxlen=6, batch_size=2, packing=False)
    np.testing.assert_array_equal(batch["tokens"], [[2, 10, 11, 0, 0, 0], [2, 20, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["targets"], [[10, 11, 1, 0, 0, 0], [20, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])


def test_packed_rows_have_segments_positions_and_masks():
    split = _split([2, 10, 11, 1], [2, 20, 1], [2, 30, 31, 32, 1])
    batches = eval_batches(split, maxlen=8, batch_size=2, packing=True)
    rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    real = rows["segment_ids"] > 0
    assert real.sum() == 3 + 2 + 4  # every next-token pair, nothing more
    for r in range(len(rows["tokens"])):
        for segment in set(rows["segment_ids"][r][real[r]]):
            where = rows["segment_ids"][r] == segment
            np.testing.assert_array_equal(rows["positions"][r][where], np.arange(where.sum()))
            assert rows["tokens"][r][where][0] == BOS_ID  # each segment starts its own story
        assert (rows["targets"][r][~real[r]] == 0).all()
    assert sorted(rows["targets"][real].tolist()) == sorted([10, 11, 1, 20, 1, 30, 31, 32, 1])


def test_eval_batches_are_padded_and_sliced_per_process():
    split = _split(*[[2, 5 + i, 1] for i in range(5)])
    whole = eval_batches(split, maxlen=4, batch_size=4, packing=False)
    assert len(whole) == 2 and whole[1]["segment_ids"][1:].sum() == 0  # 5 rows -> 8, padded
    parts = [eval_batches(split, maxlen=4, batch_size=4, packing=False,
                                  process_index=p, process_count=2) for p in range(2)]
    for b in range(2):
        joined = np.concatenate([parts[0][b]["tokens"], parts[1][b]["tokens"]])
        np.testing.assert_array_equal(joined, whole[b]["tokens"])


def test_train_batches_are_endless_reshuffled_and_checkpointable():
    split = _split(*[[2, 10 + i, 1] for i in range(6)])
    iterator = grain_batches.train_batches(split, maxlen=4, rows_per_process=3, packing=False,
                                           seed=0)
    epoch = [next(iterator)["tokens"][:, 1] for _ in range(2)]
    assert sorted(np.concatenate(epoch).tolist()) == list(range(10, 16))
    state = iterator.get_state()
    upcoming = [next(iterator)["tokens"] for _ in range(3)]
    iterator.set_state(state)
    for expected in upcoming:
        np.testing.assert_array_equal(next(iterator)["tokens"], expected)
    json.dumps(state)  # grain states are JSON-serialisable: resumable from Orbax


def test_steps_per_epoch():
    assert steps_per_epoch(1000, 50, batch_size=4, maxlen=100, packing=True) == 3
    # Rows half full: twice the steps, so that one epoch reads every window once.
    assert steps_per_epoch(1000, 50, batch_size=4, maxlen=100, packing=True, fill=0.5) == 5
    assert steps_per_epoch(1000, 50, batch_size=4, maxlen=100, packing=False) == 12
    assert steps_per_epoch(1, 1, batch_size=4, maxlen=100, packing=False) == 1


def _windows(targets_per_doc, maxlen):
    offsets = np.concatenate([[0], np.cumsum(np.asarray(targets_per_doc) + 1)]).astype(np.int64)
    split = token_cache.TokenizedSplit(tokens=np.ones(int(offsets[-1]), np.int32), offsets=offsets)
    return WindowSource(split, maxlen)


def test_packed_fill_follows_what_fits_in_a_row():
    assert packed_fill(_windows([50] * 8, 100)) == 1.0  # two per row
    assert packed_fill(_windows([60] * 8, 100)) == pytest.approx(0.6)  # one per row
    # 60s alone, each 40 joining one: full rows.
    assert packed_fill(_windows([60, 40] * 4, 100)) == 1.0
    # Documents longer than maxlen become full windows plus a remainder.
    assert packed_fill(_windows([250], 100)) == pytest.approx(250 / 300)


def test_packed_fill_is_what_the_training_packer_does():
    """Conversation-like lengths (~155 targets at maxlen 256, rarely two to a row): the estimate
    is the fill of the rows training packs (every epoch's plan has as many rows)."""
    from gemmalab.data import layouts

    lengths = np.random.default_rng(0).normal(155, 25, 1500).clip(20, 400).astype(np.int64)
    windows = _windows(lengths - 1, 256)
    estimate = packed_fill(windows)
    assert estimate < 0.75  # vs 1.0 assumed before: a third of the steps were missing
    assert estimate == pytest.approx(layouts.packed_real_share(lengths, 256))
    for epoch in range(3):
        plan = plan_rows(windows.lengths, 256, seed=1, epoch=epoch)
        assert estimate == pytest.approx(windows.num_targets / (plan.num_rows * 256))


# --- packing plans, rows gathered in bulk, the batch stream --------------------------------

# Story-like window lengths: the embedded corpus's stories are 128 +- 17 targets (90..187);
# plus the full windows of documents longer than maxlen.
def _story_lengths(n=4000, seed=0):
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.normal(128, 17, n).clip(40, 256), np.full(n // 40, 256),
                           rng.integers(1, 256, n // 40)]).astype(np.int64)


def _members(plan):
    return {frozenset(plan.window_ids[a:b].tolist())
            for a, b in zip(plan.row_starts[:-1], plan.row_starts[1:], strict=True)}


def test_plan_packs_every_window_once_into_full_rows():
    lengths, maxlen = _story_lengths(), 256
    plans = {(seed, epoch): plan_rows(lengths, maxlen, seed=seed, epoch=epoch)
             for seed in (0, 1) for epoch in (0, 1)}
    for plan in plans.values():
        np.testing.assert_array_equal(np.sort(plan.window_ids), np.arange(len(lengths)))
        per_row = np.diff(plan.row_starts)
        assert (per_row > 0).all()  # no empty row
        loads = np.add.reduceat(lengths[plan.window_ids], plan.row_starts[:-1])
        assert loads.max() <= maxlen
        assert lengths.sum() / (plan.num_rows * maxlen) >= 0.96
        assert plan.num_rows == plans[0, 0].num_rows  # the order never changes the row count
    again = plan_rows(lengths, maxlen, seed=0, epoch=0)
    np.testing.assert_array_equal(again.window_ids, plans[0, 0].window_ids)
    np.testing.assert_array_equal(again.row_starts, plans[0, 0].row_starts)
    # Another epoch (or seed) puts other windows together, and rows in another order.
    assert len(_members(plans[0, 0]) & _members(plans[0, 1])) < plans[0, 0].num_rows / 2
    assert len(_members(plans[0, 0]) & _members(plans[1, 0])) < plans[0, 0].num_rows / 2
    # Eval: no seed, the same plan every time; without packing, one window per row.
    np.testing.assert_array_equal(plan_rows(lengths, maxlen).window_ids,
                                  plan_rows(lengths, maxlen).window_ids)
    single = plan_rows(lengths, maxlen, packing=False, seed=0, epoch=1)
    np.testing.assert_array_equal(single.row_starts, np.arange(len(lengths) + 1))
    assert sorted(single.window_ids.tolist()) == list(range(len(lengths)))


def _best_fit_one_at_a_time(lengths, maxlen):
    """Best-fit decreasing the obvious way: the final room left in each row."""
    rooms = []
    for length in sorted(lengths.tolist(), reverse=True):
        fits = [i for i, room in enumerate(rooms) if room >= length]
        if fits:
            best = min(fits, key=lambda i: rooms[i])
            rooms[best] -= length
        else:
            rooms.append(maxlen - length)
    return sorted(rooms)


@pytest.mark.parametrize("maxlen", [7, 64, 256])
def test_plan_is_best_fit_decreasing(maxlen):
    rng = np.random.default_rng(maxlen)
    for size in (1, 5, 300):
        lengths = rng.integers(1, maxlen + 1, size)
        plan = plan_rows(lengths, maxlen, seed=0)
        loads = np.add.reduceat(lengths[plan.window_ids], plan.row_starts[:-1])
        assert sorted((maxlen - loads).tolist()) == _best_fit_one_at_a_time(lengths, maxlen)


def _rows_window_by_window(windows, per_row, window_ids):
    maxlen = windows.maxlen
    rows = {k: np.zeros((len(per_row), maxlen), np.int32) for k in packing.FIELDS}
    ids = iter(window_ids.tolist())
    for r, count in enumerate(per_row):
        at = 0
        for segment in range(1, count + 1):
            window = windows[next(ids)]
            n = len(window["inputs"])
            rows["tokens"][r, at:at + n] = window["inputs"]
            rows["targets"][r, at:at + n] = window["targets"]
            rows["segment_ids"][r, at:at + n] = segment
            rows["positions"][r, at:at + n] = np.arange(n)
            rows["loss_mask"][r, at:at + n] = window["loss_mask"]
            at += n
        assert at <= maxlen
    return rows


def _mixed_split(kind, seed=0):
    """Documents of 2..60 tokens (many over maxlen 16, so cut into windows); for chat data a
    response mask (0 at each BOS) beside the tokens."""
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[BOS_ID], rng.integers(3, 1000, n - 2), [EOS_ID]])
            for n in rng.integers(2, 61, 80)]
    split = _split(*docs)
    if kind == "stories":
        return split
    mask = rng.integers(0, 2, len(split.tokens)).astype(np.uint8)
    mask[split.offsets[:-1]] = 0
    return token_cache.TokenizedSplit(tokens=split.tokens, offsets=split.offsets,
                                      response_mask=mask,
                                      train_on_prompt=kind == "chat, train_on_prompt")


@pytest.mark.parametrize("kind", ["stories", "chat", "chat, train_on_prompt"])
@pytest.mark.parametrize("packing", [True, False])
def test_rows_gathered_in_bulk_equal_rows_built_window_by_window(kind, packing):
    windows = WindowSource(_mixed_split(kind), maxlen=16)
    assert windows.num_split_docs > 10
    plan = plan_rows(windows.lengths, 16, packing=packing, seed=3, epoch=2)
    for lo, hi in [(0, plan.num_rows), (5, 6), (3, 17)]:
        per_row, window_ids = plan.rows(lo, hi)
        bulk = assemble_rows(windows, per_row, window_ids)
        slow = _rows_window_by_window(windows, per_row, window_ids)
        for name in FIELDS:
            assert bulk[name].dtype == np.int32
            np.testing.assert_array_equal(bulk[name], slow[name], err_msg=name)
    if kind == "chat":
        assert 0 < bulk["loss_mask"].sum() < (bulk["segment_ids"] > 0).sum()


def test_batches_run_on_across_epochs_without_dropping_rows():
    windows = WindowSource(_mixed_split("chat"), maxlen=16)
    stream = BatchStream(windows, rows_per_batch=7, packing=True, seed=4)
    rows_per_epoch = stream.plan(0).num_rows
    assert rows_per_epoch % 7  # some batch straddles each epoch boundary
    batches = [stream.next_batch() for _ in range(-(-2 * rows_per_epoch // 7))]
    streamed = {k: np.concatenate([b[k] for b in batches]) for k in packing.FIELDS}
    expected = [_rows_window_by_window(windows, *stream.plan(e).rows(0, rows_per_epoch))
                for e in (0, 1, 2)]
    for name in packing.FIELDS:
        whole = np.concatenate([e[name] for e in expected])[:len(streamed[name])]
        np.testing.assert_array_equal(streamed[name], whole, err_msg=name)
    assert (streamed["segment_ids"].max(axis=1) > 0).all()  # no empty row


def test_train_batches_resume_bit_for_bit_mid_epoch_and_across_epochs():
    split = _mixed_split("chat")
    kwargs = dict(maxlen=16, rows_per_process=16, packing=True, seed=7)
    iterator = grain_batches.train_batches(split, **kwargs)
    states, batches = [], []
    for _ in range(30):
        states.append(iterator.get_state())
        batches.append(next(iterator))
    epochs = [s["epoch"] for s in states]
    assert epochs[-1] >= 2
    straddling = next(i for i in range(29) if epochs[i + 1] > epochs[i] and states[i + 1]["row"])
    for at in (3, straddling, straddling + 1, 25):  # mid-epoch, over the boundary, after it
        resumed = grain_batches.train_batches(split, **kwargs)
        resumed.set_state(json.loads(json.dumps(states[at])))
        for expected in batches[at:at + 4]:
            got = next(resumed)
            for name in FIELDS:
                np.testing.assert_array_equal(got[name], expected[name])


def test_a_data_position_saved_by_the_old_pipeline_is_refused_in_one_line():
    iterator = grain_batches.train_batches(_mixed_split("stories"), maxlen=16, rows_per_process=4,
                                  packing=True, seed=0)
    with pytest.raises(ConfigError, match="^resume: .*older gemmalab input pipeline"):
        iterator.set_state({"parent": {"next_index": 3}})  # grain's packer's kind of state


def test_sliced_streams_interleave_to_the_whole_stream():
    """grain's worker processes each take every n-th batch: together, the same stream."""
    from gemmalab.data.grain_batches import PackedBatchDataset

    windows = WindowSource(_mixed_split("stories"), maxlen=16)

    def dataset(sl=None):
        ds = PackedBatchDataset(windows, rows_per_batch=6, packing=True, seed=2)
        if sl is not None:
            ds.set_slice(sl)
        return iter(ds)

    whole = [next(dataset_iter) for dataset_iter in [dataset()] for _ in range(12)]
    workers = [dataset(slice(i, None, 3)) for i in range(3)]
    for b, expected in enumerate(whole):
        np.testing.assert_array_equal(next(workers[b % 3])["tokens"], expected["tokens"])
    moved = dataset(slice(1, None, 3))
    moved.set_state(workers[1].get_state())
    np.testing.assert_array_equal(next(moved)["tokens"], next(workers[1])["tokens"])


def test_a_cached_split_pickles_as_its_file_names(tmp_path):
    import pickle

    tokens = np.arange(1000, dtype=np.int32)
    tokens.tofile(tmp_path / "t.bin")
    tokens = np.memmap(tmp_path / "t.bin", dtype=np.int32, mode="r")
    split = token_cache.TokenizedSplit(tokens=tokens, offsets=np.asarray([0, 400, 1000], np.int64))
    pickled = pickle.dumps(WindowSource(split, 16))
    assert len(pickled) < 1000  # not the tokens: grain's workers reopen the file
    again = pickle.loads(pickled)
    assert isinstance(again.split.tokens, np.memmap)
    np.testing.assert_array_equal(again.split.tokens, tokens)
    np.testing.assert_array_equal(again.start, WindowSource(split, 16).start)


@pytest.mark.slow
def test_grain_worker_processes_hand_over_the_same_batches_through_shared_memory():
    """Under ``mp_prefetch`` the workers build batches in shared memory (their arrays cross as
    names, not bytes): the stream is the one a single process makes, and so is its position."""
    import grain
    from absl import flags
    from grain.multiprocessing import SharedMemoryArray

    from gemmalab.data.grain_batches import PackedBatchDataset

    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags; pytest parsed none
    windows = WindowSource(_mixed_split("chat"), maxlen=16)
    dataset = PackedBatchDataset(windows, rows_per_batch=5, packing=True, seed=3)
    whole = iter(dataset)
    expected = [next(whole) for _ in range(8)]
    in_workers = PackedBatchDataset(windows, rows_per_batch=5, packing=True, seed=3)
    in_workers.enable_shared_memory_output()  # what mp_prefetch does in each worker
    built = next(iter(in_workers))
    for name in packing.FIELDS:
        assert isinstance(built[name], SharedMemoryArray)
        built[name].unlink_on_del()
        np.testing.assert_array_equal(built[name], expected[0][name])
    options = grain.multiprocessing.MultiprocessingOptions(num_workers=2,
                                                           per_worker_buffer_size=2)
    workers = iter(dataset.mp_prefetch(options))
    try:
        for b, want in enumerate(expected[:4]):
            got = next(workers)
            for name in FIELDS:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} {b}")
        state = workers.get_state()
    finally:
        workers.close()
    resumed = iter(dataset.mp_prefetch(options))
    try:
        resumed.set_state(state)
        np.testing.assert_array_equal(next(resumed)["targets"], expected[4]["targets"])
    finally:
        resumed.close()


def test_data_that_holds_nothing_out_is_refused_before_any_model_work(tmp_path, cache_dir,
                                                                        stories_file):
    """Every evaluation would read NaN for the whole run (400 stories, one in 1,000 held out)."""
    from gemmalab.config import TrainConfig
    from gemmalab.data.preparation import prepare_data
    from gemmalab.weights import resolution

    config = TrainConfig.flat(model="gemma3-tiny", data_path=str(stories_file), eval_fraction=0.001,
                         tokenizer_vocab_size=600, cache_dir=str(cache_dir), tokenize_workers=1,
                         output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^eval_fraction: holds out none of the 400 documents "
                       r"read \(one in 1000 is held out\)\. Fix: use eval_fraction >= 0\.0025, "
                       r"or more data$"):
        prepare_data(resolution.resolve(config).config)


def test_a_cache_dir_that_cannot_be_written_is_refused_by_name(tmp_path):
    from gemmalab.config import TrainConfig
    from gemmalab.data.preparation import prepare_data
    from gemmalab.weights import resolution

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = TrainConfig.flat(model="gemma3-tiny", cache_dir=str(blocker / "cache"),
                         output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^cache_dir: cannot write to .*a-file/cache "
                       r"\((FileExistsError|NotADirectoryError): .*\)\. Fix: choose a directory"):
        prepare_data(resolution.resolve(config).config)

"""Parquet data: the same documents, records and tokens as the text/JSONL files they hold; many
files and globs as one corpus; bad columns, types and rows as one-line errors; rows dealt to
processes by row group; gs:// through the storage layer."""

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gemmalab import storage
from gemmalab.data import corpus, documents, parquet, preference_corpus, records, token_cache
from gemmalab.data.tokenizer import TokenizerInfo, train_local_tokenizer
from gemmalab.errors import ConfigError
from tests.helpers import write_jsonl

RULE = documents.SplitRule(0.1, 100)
FACTS = pa.map_(pa.string(), pa.string())
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


def write_parquet(path: Path, columns: dict, schema: pa.Schema | None = None,
                  row_group_size: int = 7) -> Path:
    """A Parquet file of ``columns`` (name: values) in row groups of ``row_group_size``."""
    table = pa.table(columns, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_shards(folder: Path, columns: dict, shards: int, schema: pa.Schema | None = None,
                 row_group_size: int = 7) -> list[Path]:
    """``columns`` cut into ``shards`` files train-0000.parquet, ... in order."""
    rows = len(next(iter(columns.values())))
    cuts = np.linspace(0, rows, shards + 1).astype(int)
    return [write_parquet(folder / f"train-{i:04d}.parquet",
                          {k: v[a:b] for k, v in columns.items()}, schema, row_group_size)
            for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))]


def jsonl_columns(path: Path, names: tuple[str, ...]) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {name: [line.get(name) for line in lines] for name in names}


def resolve(data_path, tmp_path, **kwargs) -> documents.Corpus:
    return documents.resolve_corpus(str(data_path), cache_dir=tmp_path, embedded_stories=10,
                                    seed=0, **kwargs)


@pytest.fixture(scope="module")
def stories(stories_file) -> list[str]:
    return list(documents.iter_stories(str(stories_file)))


@pytest.fixture(scope="module")
def story_shards(stories, tmp_path_factory) -> Path:
    """The 400 stories in 3 files of 7-row groups; returns their folder."""
    folder = tmp_path_factory.mktemp("stories")
    write_shards(folder, {"text": stories, "id": list(range(len(stories)))}, 3)
    return folder


@pytest.fixture(scope="module")
def instructions_file(tmp_path_factory) -> Path:
    return corpus.embedded_instructions_path(tmp_path_factory.mktemp("corpus"), 120, seed=0)


@pytest.fixture(scope="module")
def preferences_file(tmp_path_factory) -> Path:
    return preference_corpus.embedded_preferences_path(tmp_path_factory.mktemp("corpus"), 40)


# --- the same documents as text and JSONL ---------------------------------------------------


def test_a_glob_of_text_files_yields_the_stories_of_the_text_file(stories_file, stories,
                                                                   story_shards, tmp_path):
    pattern = str(story_shards / "train-*.parquet")
    resolved = resolve(pattern, tmp_path)
    assert resolved.format == documents.TEXT and not resolved.embedded
    assert resolved.path == pattern
    assert list(documents.iter_documents(pattern)) == stories
    assert (list(documents.training_stories(pattern, RULE, None))
            == list(documents.training_stories(str(stories_file), RULE, None)))
    assert (list(documents.training_stories(pattern, RULE, 50))
            == list(documents.training_stories(str(stories_file), RULE, 50)))


def test_rows_are_streamed_in_batches_never_read_whole(story_shards, stories, monkeypatch):
    def whole(*args, **kwargs):
        raise AssertionError("a Parquet file was read whole")

    monkeypatch.setattr(pq, "read_table", whole)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    monkeypatch.setattr(parquet, "BATCH_ROWS", 3)  # batches cut row groups of 7
    read_columns = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        read_columns.append(kwargs["columns"])
        return iter_batches(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    assert list(documents.iter_documents(str(story_shards / "*.parquet"))) == stories
    assert read_columns and all(columns == ["text"] for columns in read_columns)  # not "id"


def test_blank_and_null_texts_are_skipped_but_keep_their_row(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", {"text": ["\ufeff a ", None, "  ", "b"]})
    assert list(documents.iter_documents(str(path))) == ["a", "b"]
    rule = documents.SplitRule(0.5, 100)  # rows 1 and 3 held out: row 1 is null
    labelled = list(documents.labelled_documents(str(path), documents.TEXT, rule, None))
    assert labelled == [("train", "a"), ("eval", "b")]


def test_chat_rows_are_the_jsonl_records(instructions_file, tmp_path):
    columns = jsonl_columns(instructions_file, ("prompt", "response", "facts"))
    path = write_parquet(tmp_path / "chat.parquet", columns,
                         pa.schema([("prompt", pa.string()), ("response", pa.string()),
                                    ("facts", FACTS)]))
    resolved = resolve(path, tmp_path)
    assert resolved.format == documents.CHAT and resolved.bad_records == 0
    from_parquet = list(documents.iter_documents(str(path), documents.CHAT))
    assert from_parquet == list(records.iter_conversations(str(instructions_file)))
    assert from_parquet[0].facts == json.loads(instructions_file.read_text().split("\n")[0])[
        "facts"]
    assert (list(documents.heldout_conversations(str(path), RULE, None))
            == list(documents.heldout_conversations(str(instructions_file), RULE, None)))


def test_messages_with_a_system_turn_and_struct_facts(tmp_path):
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                 {"role": "assistant", "content": " Hello! "}],
                [{"role": "user", "content": "A story?"}, {"role": "model", "content": "Once."}]]
    facts = [{"name": "Mia", "toy": None}, None]
    path = write_parquet(tmp_path / "m.parquet", {"messages": messages, "facts": facts},
                         pa.schema([("messages", pa.list_(MESSAGE)),
                                    ("facts", pa.struct([("name", pa.string()),
                                                         ("toy", pa.string())]))]))
    jsonl = write_jsonl(tmp_path / "m.jsonl", {"messages": messages[0], "facts": {"name": "Mia"}},
                        {"messages": messages[1]})
    assert (list(documents.iter_documents(str(path)))
            == list(documents.iter_documents(str(jsonl))))


def test_preference_rows_are_the_jsonl_pairs(preferences_file, tmp_path):
    columns = jsonl_columns(preferences_file, ("prompt", "chosen", "rejected", "facts"))
    path = write_parquet(tmp_path / "pairs.parquet", columns,
                         pa.schema([("prompt", pa.string()), ("chosen", pa.string()),
                                    ("rejected", pa.string()), ("facts", FACTS)]))
    resolved = resolve(path, tmp_path, preferences=True)
    assert resolved.format == documents.PREFERENCES
    pairs = list(documents.iter_documents(str(path), documents.PREFERENCES))
    assert pairs == list(records.iter_pairs(str(preferences_file)))
    assert len(pairs) == 40


def test_conversational_preference_rows(tmp_path):
    prompt = [[{"role": "user", "content": "Name a fruit."}]]
    path = write_parquet(tmp_path / "c.parquet", {
        "prompt": prompt, "chosen": [[{"role": "assistant", "content": "Apple."}]],
        "rejected": [[{"role": "assistant", "content": "Rock."}]]})
    jsonl = write_jsonl(tmp_path / "c.jsonl", {
        "prompt": prompt[0], "chosen": [{"role": "assistant", "content": "Apple."}],
        "rejected": [{"role": "assistant", "content": "Rock."}]})
    assert (list(documents.iter_documents(str(path), documents.PREFERENCES))
            == list(records.iter_pairs(str(jsonl))))


def test_the_token_cache_of_parquet_is_the_jsonl_one(instructions_file, tmp_path):
    columns = jsonl_columns(instructions_file, ("prompt", "response", "facts"))
    write_shards(tmp_path / "shards", columns, 4, pa.schema(
        [("prompt", pa.string()), ("response", pa.string()), ("facts", FACTS)]), 5)
    pattern = str(tmp_path / "shards" / "*.parquet")
    train_local_tokenizer(documents.training_stories(pattern, RULE, None, documents.CHAT),
                          tmp_path / "local.model", vocab_size=600)
    info = TokenizerInfo("local", (tmp_path / "local.model").read_bytes(), 600)
    caches = [token_cache.load_or_build_token_cache(
        resolve(path, tmp_path), info, rule=RULE, datacount=None, cache_dir=tmp_path / name,
        workers=1) for name, path in (("jsonl", instructions_file), ("parquet", pattern))]
    jsonl_cache, parquet_cache = caches
    assert parquet_cache.meta["stories_read"] == jsonl_cache.meta["stories_read"] == 120
    for split in ("train", "eval"):
        a, b = getattr(jsonl_cache, split), getattr(parquet_cache, split)
        assert a.num_docs > 0
        np.testing.assert_array_equal(a.offsets, b.offsets)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.response_mask, b.response_mask)


# --- several files ------------------------------------------------------------------------


def test_a_comma_list_keeps_its_order_and_a_glob_sorts(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", {"text": ["a1", "a2"]})
    b = write_parquet(tmp_path / "b.parquet", {"text": ["b1"]})
    assert list(documents.iter_documents(f"{b}, {a}")) == ["b1", "a1", "a2"]
    assert list(documents.iter_documents(f"{b},{tmp_path}/*.parquet")) == ["b1", "a1", "a2"]
    assert list(documents.iter_documents(str(tmp_path / "?.parquet"))) == ["a1", "a2", "b1"]


def test_a_parquet_file_is_known_by_its_magic_whatever_its_name(tmp_path):
    path = write_parquet(tmp_path / "export.bin", {"text": ["x", "y"]})
    assert resolve(path, tmp_path).format == documents.TEXT
    assert list(documents.iter_documents(str(path))) == ["x", "y"]


def test_the_fingerprint_covers_every_file(tmp_path):
    write_parquet(tmp_path / "d" / "p-0.parquet", {"text": ["a", "b"]})
    write_parquet(tmp_path / "d" / "p-1.parquet", {"text": ["c"]})
    pattern = str(tmp_path / "d" / "*.parquet")
    first = resolve(pattern, tmp_path).fingerprint
    assert resolve(pattern, tmp_path).fingerprint == first
    write_parquet(tmp_path / "d" / "p-1.parquet", {"text": ["C"]})  # same size, new content
    changed = resolve(pattern, tmp_path).fingerprint
    assert changed != first
    write_parquet(tmp_path / "d" / "p-2.parquet", {"text": ["d"]})
    assert resolve(pattern, tmp_path).fingerprint not in (first, changed)


# --- errors -------------------------------------------------------------------------------


def _error(data_path, tmp_path, **kwargs) -> str:
    with pytest.raises(ConfigError) as error:
        resolve(data_path, tmp_path, **kwargs)
    message = str(error.value)
    assert message.startswith("data_path: ") and "\n" not in message
    return message


def test_a_missing_column_names_the_columns_found(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"body": ["a"], "n": [1]})
    message = _error(path, tmp_path)
    assert message.startswith(f"data_path: {path} has none of the columns 'text', 'messages' or "
                              "'prompt'+'response' (columns found: body: string, n: int64). "
                              "Fix: give it a string column 'text'")


def test_a_wrong_type_names_the_column_its_type_and_the_columns_found(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"text": [1, 2], "id": ["a", "b"]})
    assert _error(path, tmp_path).startswith(
        f"data_path: {path} column 'text' is int64, not a string (columns found: text: int64, "
        "id: string)")
    bad_messages = write_parquet(tmp_path / "m.parquet", {"messages": [["hi"]]})
    assert ("column 'messages' is list<element: string>, not list<struct<role: string, "
            "content: string>>" in _error(bad_messages, tmp_path))
    mixed = write_parquet(tmp_path / "p.parquet", {"prompt": ["q"], "chosen": [["a"]],
                                                   "rejected": ["b"]})
    assert "column 'chosen' is list<element: string>, not a string like 'prompt'" in _error(
        mixed, tmp_path, preferences=True)


@pytest.mark.parametrize(("columns", "preferences", "expected"), [
    ({"text": ["a"]}, True, "has no column 'prompt' (columns found: text: string). Fix: give "
                            "it columns 'prompt', 'chosen' and 'rejected'"),
    ({"prompt": ["q"], "chosen": ["a"], "rejected": ["b"]}, False,
     "holds preference pairs (columns found: prompt: string, chosen: string, rejected: string)"
     ". Fix: train on them with objective='dpo'"),
    ({"prompt": ["q"], "response": ["a"], "facts": [["x"]]}, False,
     "column 'facts' is list<element: string>, not map<string, string> or a struct"),
])
def test_columns_of_the_wrong_kind(tmp_path, columns, preferences, expected):
    path = write_parquet(tmp_path / "x.parquet", columns)
    assert f"data_path: {path} {expected}" in _error(path, tmp_path, preferences=preferences)


def test_empty_missing_and_unmatched_files(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    assert _error(empty, tmp_path).startswith(f"data_path: {empty} is empty")
    assert _error(tmp_path / "none.parquet", tmp_path).startswith(
        f"data_path: {tmp_path / 'none.parquet'} does not exist")
    assert _error(tmp_path / "train-*.parquet", tmp_path).startswith(
        f"data_path: {tmp_path / 'train-*.parquet'} matches no file. Fix: check the pattern")
    junk = tmp_path / "junk.parquet"
    junk.write_text('{"text": "not parquet"}\n')
    assert _error(junk, tmp_path).startswith(f"data_path: {junk} is not a Parquet file")
    no_rows = write_parquet(tmp_path / "d" / "zero.parquet", {"text": pa.array([], pa.string())})
    assert _error(no_rows, tmp_path).startswith(f"data_path: {no_rows} holds no rows")
    folder_message = _error(f"{no_rows},{tmp_path / 'd'}", tmp_path)
    assert folder_message.startswith(f"data_path: {tmp_path / 'd'} is not a file. Fix: name its "
                                     f"files, e.g. {tmp_path / 'd'}/*.parquet")


def test_files_with_different_columns_are_refused(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": ["a"]})
    write_parquet(tmp_path / "b.parquet", {"prompt": ["q"], "response": ["a"]})
    assert _error(tmp_path / "*.parquet", tmp_path).startswith(
        f"data_path: {tmp_path / 'b.parquet'} holds prompt_response columns but "
        f"{tmp_path / 'a.parquet'} holds text columns")


def test_a_bad_row_is_named_by_its_file_and_row(tmp_path):
    write_parquet(tmp_path / "train-0000.parquet", {"prompt": ["q1", "q2"],
                                                    "response": ["a1", "a2"]})
    write_parquet(tmp_path / "train-0001.parquet", {"prompt": ["q3", "q4", "q5"],
                                                    "response": ["a3", "  ", None]})
    pattern = tmp_path / "train-*.parquet"
    assert _error(pattern, tmp_path).startswith(
        f"data_path: {tmp_path / 'train-0001.parquet'} row 1 'response' is empty. Fix: give "
        "'response' some text, or drop the record, or set skip_bad_records=True")
    with pytest.warns(UserWarning, match=r"skipped 2 bad record\(s\) of 5 .*\(first: .*"
                                         r"train-0001.parquet row 1 'response' is empty\)"):
        resolved = resolve(pattern, tmp_path, skip_bad_records=True)
    assert resolved.bad_records == 2
    assert [c.turns[0][1] for c in documents.iter_documents(str(pattern))] == ["q1", "q2", "q3"]


# --- processes: dealt by row group ------------------------------------------------------------


@pytest.mark.parametrize("datacount", [None, 150])
def test_processes_share_the_train_rows_and_read_only_their_row_groups(
        stories, story_shards, monkeypatch, datacount):
    pattern = str(story_shards / "*.parquet")
    rows_read: list[int] = []
    iter_rows = parquet.iter_rows

    def spy(*args, **kwargs):
        for row in iter_rows(*args, **kwargs):
            rows_read.append(row[0])
            yield row

    monkeypatch.setattr(parquet, "iter_rows", spy)
    whole = documents.SplitRule(0.1, 3)  # eval rows 9, 19, 29: the first 5 row groups hold them
    expected = list(whole.label_stories(iter(stories), datacount))
    shares, reads = [], []
    for p in range(3):
        rule = documents.SplitRule(0.1, 3, p, 3)
        rows_read.clear()
        labelled = list(documents.labelled_documents(pattern, documents.TEXT, rule, datacount))
        assert [doc for label, doc in labelled if label == "eval"] == [
            doc for label, doc in expected if label == "eval"]
        shares.append([doc for label, doc in labelled if label == "train"])
        reads.append(set(rows_read))
    # Contiguous shares, in order, one document apart at most: together the whole train split.
    assert sum(shares, []) == [doc for label, doc in expected if label == "train"]
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    rows = len(stories) if datacount is None else datacount
    assert set.union(*reads) >= set(range(rows))
    for p, read in enumerate(reads):
        # The row groups (7 rows) of the eval rows (0-34) and of its share (train ordinal t is
        # row t + 3 past the 3 eval rows), nothing else.
        start, stop = documents.SplitRule(0.1, 3, p, 3).train_share(rows)
        first, last = start + 3 if start else 0, stop - 1 + 3
        assert read <= set(range(35)) | set(range(first - first % 7, last + 7 - last % 7))
        assert len(read) < 0.6 * rows


def test_a_process_caches_only_its_share(story_shards, stories, tmp_path):
    pattern = str(story_shards / "*.parquet")
    resolved = resolve(pattern, tmp_path)
    train_local_tokenizer(iter(stories), tmp_path / "local.model", vocab_size=600)
    info = TokenizerInfo("local", (tmp_path / "local.model").read_bytes(), 600)
    caches = [token_cache.load_or_build_token_cache(
        resolved, info, rule=documents.SplitRule(0.1, 100, p, 2), datacount=None,
        cache_dir=tmp_path, workers=1) for p in range(2)]
    assert [c.meta["stories_read"] for c in caches] == [400, 400]
    assert [c.train.num_docs for c in caches] == [180, 180] and caches[0].eval.num_docs == 40
    np.testing.assert_array_equal(caches[0].eval.tokens, caches[1].eval.tokens)


# --- gs:// ---------------------------------------------------------------------------------


class GFileLike:
    """What epath's tf.io.gfile backend yields for a gs:// object: read, seek and tell, but no
    ``closed``, and a ``seek`` that returns None."""

    def __init__(self, path: str):
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()

    def read(self, n: int = -1) -> bytes:
        return self._file.read(n)

    def seek(self, offset: int, whence: int = 0) -> None:
        self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


class FakeObject:
    """A gs:// path served from a local folder: epath's listing, a GFile-like to read."""

    def __init__(self, local: Path):
        from etils import epath

        self._path = epath.Path(local)

    def __getattr__(self, name: str):
        return getattr(self._path, name)

    def __fspath__(self) -> str:
        return str(self._path)

    @contextlib.contextmanager
    def open(self, mode: str):
        handle = GFileLike(str(self._path))
        try:
            yield handle
        finally:
            handle.close()


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch) -> Path:
    """gs://bucket/... served from a local folder through the storage layer's one door."""
    root = tmp_path / "gcs"
    monkeypatch.setattr(storage, "_gcs_credentials_found", lambda: True)
    monkeypatch.setattr(storage, "_gcs_path",
                        lambda path: FakeObject(root / str(path).removeprefix("gs://")))
    return root


def test_a_gs_glob_reads_through_the_storage_layer(fake_gcs, story_shards, stories, tmp_path):
    shutil.copytree(story_shards, fake_gcs / "bucket" / "data")
    pattern = "gs://bucket/data/train-*.parquet"
    assert storage.glob(pattern) == [f"gs://bucket/data/train-{i:04d}.parquet" for i in range(3)]
    resolved = resolve(pattern, tmp_path)
    assert resolved.format == documents.TEXT
    assert list(documents.iter_documents(pattern)) == stories
    assert _error("gs://bucket/data/test-*.parquet", tmp_path).startswith(
        "data_path: gs://bucket/data/test-*.parquet matches no file")
    assert _error("gs://b*/x.parquet", tmp_path).startswith(
        "data_path: gs://b*/x.parquet has a wildcard in its bucket name")
    assert _error("gs://bucket/**/*.parquet", tmp_path).startswith(
        "data_path: gs://bucket/**/*.parquet: ** is not supported on gs://")
    (fake_gcs / "bucket" / "more" / "deeper").mkdir(parents=True)
    shutil.copy(story_shards / "train-0001.parquet", fake_gcs / "bucket" / "more" / "deeper")
    assert (list(documents.iter_documents("gs://bucket/*/train-0001.parquet,"
                                          "gs://bucket/*/*/train-0001.parquet"))
            == stories[133:266] * 2)


def test_gs_without_credentials_fails_before_reading(monkeypatch, tmp_path):
    monkeypatch.setattr(storage, "_gcs_credentials_found", lambda: False)
    assert _error("gs://bucket/train-*.parquet", tmp_path).startswith(
        "data_path: gs://bucket/train-*.parquet is on Google Cloud Storage but no credentials")

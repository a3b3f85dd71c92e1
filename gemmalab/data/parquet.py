"""Parquet data: one file, a glob or a comma-separated list of files (local or ``gs://``) read
as one corpus, row group by row group, only the columns a format needs.

Which columns make which data (the first that applies; other columns are ignored):

- preference pairs (objective "dpo"): ``prompt``, ``chosen`` and ``rejected``, all strings or
  all lists of ``{role, content}`` messages (TRL's standard and conversational forms);
- chat: ``messages`` (a list of ``struct<role: string, content: string>``), else the strings
  ``prompt`` and ``response``; an optional ``facts`` column (``map<string, string>`` or a struct
  of strings) names what a reply should contain, as in JSONL;
- documents: ``text`` (a string column), one document a row.

A row is exactly what a JSONL record or a story of a text file would be, read by the same
checks (``gemmalab.data.records``); a bad row is named by its file and row, counted from 0 as
pyarrow and pandas count (``train-0003.parquet row 1234``). A null or blank ``text`` is skipped.

Files are taken in the order listed, each glob's matches sorted by name; rows are numbered
across them in that order (``ParquetCorpus.parts``), which is what the train/eval split and the
dealing of rows to hosts (``gemmalab.data.documents``) go by. Nothing is ever read whole: only
the footers up front, then the wanted row groups in batches of ``BATCH_ROWS``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from gemmalab import storage
from gemmalab.errors import ConfigError

BATCH_ROWS = 1024
STREAM_BUFFER_BYTES = 8 << 20
SUFFIXES = (".parquet", ".pq")
MAGIC = b"PAR1"

# Layouts: which columns a corpus reads.
TEXT, MESSAGES, PROMPT_RESPONSE, PREFERENCES = "text", "messages", "prompt_response", "preferences"
FACTS = "facts"
CHAT_EXPECTED = ("a string column 'text' (documents), or for chat a 'messages' column "
                 "(list<struct<role: string, content: string>>) or string columns 'prompt' and "
                 "'response'")
PREFERENCES_EXPECTED = ("columns 'prompt', 'chosen' and 'rejected': all strings, or all lists "
                        "of struct<role: string, content: string> messages")


@dataclasses.dataclass(frozen=True)
class ParquetPart:
    """One file of the corpus: its rows are global rows ``first_row ...`` in row groups of
    ``row_group_rows``."""

    path: str
    first_row: int
    row_group_rows: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ParquetCorpus:
    data_path: str
    layout: str  # TEXT, MESSAGES, PROMPT_RESPONSE or PREFERENCES
    columns: tuple[str, ...]  # the columns read
    parts: tuple[ParquetPart, ...]
    fingerprint: str  # every file's name, size, mtime (local) and footer

    @property
    def num_rows(self) -> int:
        last = self.parts[-1]
        return last.first_row + sum(last.row_group_rows)


# ---------------------------------------------------------------------------------------------
# Naming the files.


def _entries(data_path: str) -> list[str]:
    return [entry.strip() for entry in data_path.split(",") if entry.strip()]


def names_parquet(data_path: str) -> bool:
    """Parquet by its name alone: several files, a glob, or a ``.parquet``/``.pq`` name."""
    entries = _entries(data_path)
    return (len(entries) > 1 or any(storage.has_wildcards(e) for e in entries)
            or any(e.lower().endswith(SUFFIXES) for e in entries))


def is_parquet(data_path: str) -> bool:
    """Named as Parquet, or one existing file that opens with Parquet's magic bytes."""
    if names_parquet(data_path):
        return True
    with storage.open_binary(data_path) as f:
        return f.read(len(MAGIC)) == MAGIC


def expand(data_path: str) -> list[str]:
    """The files ``data_path`` names: entries separated by commas, each a file or a glob
    (sorted matches), in the order given, without repeats."""
    files: list[str] = []
    seen: set[str] = set()
    for entry in _entries(data_path):
        if storage.is_gcs(entry):
            if storage.has_wildcards(entry.removeprefix("gs://").split("/")[0]):
                raise ConfigError("data_path", f"{entry} has a wildcard in its bucket name",
                                  "name the bucket; wildcards may follow it")
            if "**" in entry:  # one listing per folder level: thousands of calls on GCS
                raise ConfigError("data_path", f"{entry}: ** is not supported on gs://",
                                  "name each folder level, e.g. gs://bucket/*/train-*.parquet")
            storage.require_gcs_credentials("data_path", entry)
        if storage.has_wildcards(entry):
            matches = storage.glob(entry)
            if not matches:
                raise ConfigError("data_path", f"{entry} matches no file",
                                  "check the pattern (e.g. gs://bucket/train-*.parquet) and "
                                  "that the files exist")
        elif not storage.exists(entry):
            raise ConfigError("data_path", f"{entry} does not exist",
                              "name Parquet files, a glob of them, or a list separated by commas")
        elif not storage.is_gcs(entry) and not os.path.isfile(entry):
            raise ConfigError("data_path", f"{entry} is not a file",
                              f"name its files, e.g. {entry.rstrip('/')}/*.parquet")
        else:
            matches = [entry]
        files.extend(dict.fromkeys(m for m in matches if m not in seen))
        seen.update(matches)
    if not files:
        raise ConfigError("data_path", f"{data_path!r} names no file",
                          "name Parquet files, a glob of them, or a list separated by commas")
    return files


# ---------------------------------------------------------------------------------------------
# Footers and columns.


def open_corpus(data_path: str, *, preferences: bool) -> ParquetCorpus:
    """Every file's footer read and its columns checked (the first bad file is a one-line
    ``ConfigError`` naming it and the columns found): the corpus's layout, rows and
    fingerprint. No row is read."""
    parts: list[ParquetPart] = []
    layout: tuple[str, tuple[str, ...]] | None = None
    digest = hashlib.sha256()
    first_row = 0
    for path in expand(data_path):
        size = storage.file_size(path)
        if size == 0:
            raise ConfigError("data_path", f"{path} is empty",
                              "write a Parquet file there, or leave it out of data_path")
        with storage.open_binary(path) as f:
            footer = _footer(f, size, path)
            import pyarrow.parquet as pq

            parquet_file = pq.ParquetFile(f)
            found = _layout(parquet_file.schema_arrow, path, preferences)
            groups = tuple(parquet_file.metadata.row_group(g).num_rows
                           for g in range(parquet_file.num_row_groups))
        if layout is not None and found[0] != layout[0]:
            raise ConfigError("data_path", f"{path} holds {found[0]} columns but "
                              f"{parts[0].path} holds {layout[0]} columns",
                              "give every file of data_path the same columns")
        layout = layout or found
        mtime = None if storage.is_gcs(path) else os.stat(path).st_mtime_ns
        digest.update(json.dumps([path, size, mtime]).encode())
        digest.update(footer)
        parts.append(ParquetPart(path, first_row, groups))
        first_row += sum(groups)
    assert layout is not None
    if first_row == 0:
        raise ConfigError("data_path", f"{data_path} holds no rows",
                          "write rows into its Parquet files")
    return ParquetCorpus(data_path, layout[0], layout[1], tuple(parts),
                         digest.hexdigest()[:16])


def _footer(f: Any, size: int, path: str) -> bytes:
    """The file's metadata as stored (schema, row groups, column statistics): with its size,
    what identifies its content for the token cache."""
    f.seek(max(0, size - 8))
    tail = f.read(8)
    if size < 12 or tail[4:] != MAGIC:
        raise ConfigError("data_path", f"{path} is not a Parquet file (no {MAGIC.decode()} "
                          "footer)", "write it with pyarrow or pandas' to_parquet, or give "
                          "JSONL or text data as one file")
    length = int.from_bytes(tail[:4], "little")
    f.seek(max(0, size - 8 - length))
    return f.read(length)


def _layout(schema: Any, path: str, preferences: bool) -> tuple[str, tuple[str, ...]]:
    """(layout, columns to read) of a file's schema, or the one-line error."""
    types = {field.name: field.type for field in schema}
    found = ", ".join(f"{name}: {_short(t)}" for name, t in types.items())

    def wrong(problem: str) -> ConfigError:
        return ConfigError("data_path", f"{path} {problem} (columns found: {found})",
                           f"give it {PREFERENCES_EXPECTED if preferences else CHAT_EXPECTED}")

    def require(name: str, check: Callable[[Any], bool], what: str) -> None:
        if name not in types:
            raise wrong(f"has no column '{name}'")
        if not check(types[name]):
            raise wrong(f"column '{name}' is {_short(types[name])}, not {what}")

    if preferences:
        require("prompt", lambda t: _is_text(t) or _is_messages(t), "a string or messages")
        conversational = _is_messages(types["prompt"])
        for side in ("chosen", "rejected"):
            if conversational:
                require(side, _is_messages, "messages like 'prompt'")
            else:
                require(side, _is_text, "a string like 'prompt'")
        layout = PREFERENCES, ("prompt", "chosen", "rejected")
    elif MESSAGES in types:
        require(MESSAGES, _is_messages, "list<struct<role: string, content: string>>")
        layout = MESSAGES, (MESSAGES,)
    elif "prompt" in types and "response" in types:
        require("prompt", _is_text, "a string")
        require("response", _is_text, "a string")
        layout = PROMPT_RESPONSE, ("prompt", "response")
    elif "chosen" in types or "rejected" in types:
        raise ConfigError("data_path", f"{path} holds preference pairs (columns found: {found})",
                          "train on them with objective='dpo', or give chat data as 'messages' "
                          "or 'prompt' and 'response'")
    elif "text" in types:
        require("text", _is_text, "a string")
        return TEXT, ("text",)
    else:
        raise wrong("has none of the columns 'text', 'messages' or 'prompt'+'response'")
    if FACTS not in types:
        return layout
    require(FACTS, _is_facts, "map<string, string> or a struct of strings")
    return layout[0], (*layout[1], FACTS)


def _short(arrow_type: Any) -> str:
    text = str(arrow_type)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_text(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _is_text(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t: Any) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)
            or pa.types.is_large_list_view(t)):
        return False
    item = t.value_type
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)} if (
        pa.types.is_struct(item)) else {}
    return all(name in names and _is_text(names[name]) for name in ("role", "content"))


def _is_facts(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_map(t):
        return _is_text(t.key_type) and _is_text(t.item_type)
    return pa.types.is_struct(t) and all(_is_text(t.field(i).type) for i in range(t.num_fields))


# ---------------------------------------------------------------------------------------------
# Rows.


def iter_rows(corpus: ParquetCorpus, wanted: Callable[[int, int], bool] | None = None
              ) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """``(global row, where, values)`` of every row of the row groups ``wanted(first, stop)``
    accepts (global rows ``first`` to ``stop`` - 1; all when None), in order. ``where`` names
    the file and row ("/data/train-0003.parquet row 1234"); ``values`` holds the layout's
    columns, null ones left out."""
    for part in corpus.parts:
        starts = [part.first_row + sum(part.row_group_rows[:g])
                  for g in range(len(part.row_group_rows))]
        groups = [g for g, (start, rows) in enumerate(zip(starts, part.row_group_rows,
                                                          strict=True))
                  if rows and (wanted is None or wanted(start, start + rows))]
        if not groups:  # this file holds nothing wanted: not even opened
            continue
        import pyarrow.parquet as pq

        with storage.open_binary(part.path) as f:
            # Pages streamed through a buffer: a row group's columns are never held whole.
            parquet_file = pq.ParquetFile(f, buffer_size=STREAM_BUFFER_BYTES, pre_buffer=False)
            for g in groups:
                row = starts[g]
                for batch in parquet_file.iter_batches(batch_size=BATCH_ROWS, row_groups=[g],
                                                       columns=list(corpus.columns)):
                    values = {name: batch.column(name).to_pylist() for name in corpus.columns}
                    for i in range(batch.num_rows):
                        yield (row, f"{part.path} row {row - part.first_row}",
                               {name: _plain(name, column[i])
                                for name, column in values.items() if column[i] is not None})
                        row += 1


def _plain(name: str, value: Any) -> Any:
    """A cell as JSON would have given it: ``facts`` a dict (a map arrives as key-value pairs,
    a struct with nulls for its absent fields)."""
    if name != FACTS:
        return value
    if isinstance(value, list):
        return dict(value)
    return {key: text for key, text in value.items() if text is not None}

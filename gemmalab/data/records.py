"""Instruction and chat data: JSONL records read, checked and turned into conversations.

One JSON object per line, either ``{"prompt": str, "response": str}`` or
``{"messages": [{"role": "system" | "user" | "model" | "assistant", "content": str}, ...]}``
(``assistant`` is read as ``model``; a ``system`` message may only come first). Turns must
alternate user/model and end with a model turn. An optional ``"facts": {str: str}`` names what a
reply should contain (the task metric scores held-out conversations on it); other keys are
ignored. Blank lines are skipped. Contents are trimmed, as Gemma's chat template does.

Preference records (DPO) take TRL's two forms: ``{"prompt": str, "chosen": str, "rejected":
str}``, or conversational, ``{"prompt": [messages ending with a user turn], "chosen":
[messages], "rejected": [messages]}``: the prompt's messages followed by either side's must
make a conversation as above. Both sides share the prompt; they must differ.

The file is streamed line by line, never held in memory. ``validate`` reads it once before any
tokenizing: the first bad record is a one-line ``ConfigError`` naming its line, or, with
``skip_bad_records``, every bad record is counted and skipped. Parquet rows
(``gemmalab.data.parquet``) are records too: ``checked`` and ``count_records`` judge them alike.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from gemmalab import storage
from gemmalab.data.chat import MODEL, USER, Conversation, PreferencePair, Turn
from gemmalab.errors import ConfigError

READ_CHUNK_BYTES = 8 << 20
SNIFF_BYTES = 4096
ROLE_NAMES = {"user": USER, "model": MODEL, "assistant": MODEL}
SYSTEM = "system"
SKIP_FIX = "or set skip_bad_records=True to skip such records"


class BadRecord(ValueError):
    """What is wrong with one record, and how to write it instead."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Fix: {fix}")


def is_jsonl(path: str) -> bool:
    """JSONL if named ``*.jsonl``, or if its first non-blank character opens a JSON object."""
    if str(path).endswith(".jsonl"):
        return True
    with storage.open_binary(path) as f:
        head = f.read(SNIFF_BYTES)
    return head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")


# ---------------------------------------------------------------------------------------------
# One record.


def parse_record(record: Any) -> Conversation | PreferencePair:
    """A conversation (or, with ``chosen``/``rejected``, a preference pair) from one decoded
    record, or ``BadRecord`` saying what is wrong."""
    if not isinstance(record, dict):
        raise BadRecord(f"is a JSON {type(record).__name__}, not an object",
                        'write {"prompt": ..., "response": ...} or {"messages": [...]}')
    facts = _facts(record.get("facts"))
    if "chosen" in record or "rejected" in record:
        return _preference(record, facts)
    has_pair = "prompt" in record or "response" in record
    if has_pair and "messages" in record:
        raise BadRecord("has both 'messages' and 'prompt'/'response'", "keep one of the two")
    if "messages" in record:
        return Conversation(_turns(record["messages"]), facts)
    if not has_pair:
        raise BadRecord(f"has neither 'prompt'/'response' nor 'messages' (keys: "
                        f"{sorted(record)})",
                        'write {"prompt": ..., "response": ...} or {"messages": [...]}')
    prompt = _text(record, "prompt", "'prompt'")
    response = _text(record, "response", "'response'")
    return Conversation(((USER, prompt), (MODEL, response)), facts)


def _preference(record: dict, facts: dict[str, str] | None) -> PreferencePair:
    extra = {"response", "messages"} & set(record)
    if extra:
        raise BadRecord(f"has 'chosen'/'rejected' and {sorted(extra)}",
                        "a preference record holds 'prompt', 'chosen' and 'rejected' only")
    for key in ("prompt", "chosen", "rejected"):
        if key not in record:
            raise BadRecord(f"has no '{key}'", "a preference record needs 'prompt', 'chosen' "
                            "and 'rejected'")
    prompt = record["prompt"]
    if isinstance(prompt, str):  # the standard form: three strings
        prompt_text = _text(record, "prompt", "'prompt'")
        sides = [((USER, prompt_text), (MODEL, _text(record, key, f"'{key}'")))
                 for key in ("chosen", "rejected")]
    elif isinstance(prompt, list):  # the conversational form: lists of messages
        sides = []
        for key in ("chosen", "rejected"):
            side = record[key]
            if not isinstance(side, list) or not side:
                raise BadRecord(f"'{key}' is not a non-empty list of messages",
                                f'write "{key}": [{{"role": "assistant", "content": ...}}]')
            try:
                sides.append(_turns(prompt + side))
            except BadRecord as bad:
                raise BadRecord(f"prompt + '{key}': {bad.problem}", bad.fix) from None
        if len(sides[0]) != len(sides[1]) or sides[0][:-1] != sides[1][:-1]:
            raise BadRecord("'chosen' and 'rejected' differ before their last model turn",
                            "let both sides continue the prompt with one model turn each")
    else:
        raise BadRecord(f"'prompt' is a {type(prompt).__name__}",
                        "write 'prompt' as a string, or as a list of messages")
    if sides[0][-1][1] == sides[1][-1][1]:
        raise BadRecord("'chosen' and 'rejected' are the same reply",
                        "give a rejected reply that differs from the chosen one, or drop the "
                        "record")
    return PreferencePair(Conversation(tuple(sides[0]), facts),
                          Conversation(tuple(sides[1]), facts))


def _text(holder: dict, key: str, what: str) -> str:
    if key not in holder:
        raise BadRecord(f"has no {what}", f"add {what} as a non-empty string")
    value = holder[key]
    if not isinstance(value, str):
        raise BadRecord(f"{what} is a {type(value).__name__}, not a string",
                        f"write {what} as a string")
    if not value.strip():
        raise BadRecord(f"{what} is empty", f"give {what} some text, or drop the record")
    return value.strip()


def _turns(messages: Any) -> tuple[Turn, ...]:
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' is not a non-empty list",
                        'write "messages": [{"role": "user", "content": ...}, ...]')
    system, turns = None, []
    for i, message in enumerate(messages, 1):
        what = f"message {i}"
        if not isinstance(message, dict):
            raise BadRecord(f"{what} is a {type(message).__name__}, not an object",
                            'write each message as {"role": ..., "content": ...}')
        role = message.get("role")
        if role == SYSTEM and i == 1:
            system = _text(message, "content", f"{what}'s 'content'")
            continue
        if role == SYSTEM:
            raise BadRecord(f"{what} is a 'system' message after the first",
                            "put the system message first (Gemma folds it into the first "
                            "user turn)")
        if role not in ROLE_NAMES:
            raise BadRecord(f"{what} has role {role!r}",
                            "use 'user', 'model' (or 'assistant') or a first 'system'")
        turns.append((ROLE_NAMES[role], _text(message, "content", f"{what}'s 'content'")))
        expected = USER if len(turns) % 2 else MODEL
        if turns[-1][0] != expected:
            raise BadRecord(f"{what} is a {role!r} turn where a {expected!r} turn belongs",
                            "alternate user and model turns, starting with a user turn")
    if not turns or turns[-1][0] != MODEL:
        raise BadRecord("does not end with a model turn",
                        "end each conversation with the model's reply (what it learns)")
    if system is not None:  # Gemma 3's template: the system text opens the first user turn
        turns[0] = (USER, f"{system}\n\n{turns[0][1]}")
    return tuple(turns)


def _facts(facts: Any) -> dict[str, str] | None:
    if facts is None:
        return None
    if not isinstance(facts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in facts.items()):
        raise BadRecord("'facts' is not an object of non-empty strings",
                        'write "facts": {"name": "Mia", "toy": "kite"}, or leave it out')
    return facts


# ---------------------------------------------------------------------------------------------
# A whole file.


def iter_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of every line, streamed in chunks (local or gs://)."""
    number, pending = 0, b""
    with storage.open_binary(path) as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            *complete, pending = (pending + chunk).split(b"\n")
            for line in complete:
                number += 1
                yield number, line
    if pending:
        yield number + 1, pending


def iter_records(path: str, *, preferences: bool = False
                 ) -> Iterator[tuple[int, Conversation | PreferencePair | BadRecord]]:
    """Every non-blank line: its number and its conversation (``preferences``: its preference
    pair), or what is wrong with it; a record of the other kind is wrong too."""
    decode = codecs.getdecoder("utf-8")
    for number, raw in iter_lines(path):
        try:
            line = decode(raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw)[0]
        except UnicodeDecodeError as e:
            yield number, BadRecord(f"is not UTF-8 (invalid byte at column {e.start + 1})",
                                    "convert the file to UTF-8")
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            yield number, BadRecord(f"is not valid JSON ({e.msg} at column {e.colno})",
                                    "write one JSON object per line")
            continue
        yield number, checked(record, preferences=preferences)


def checked(record: Any, *, preferences: bool) -> Conversation | PreferencePair | BadRecord:
    """One decoded record (a JSONL line's object, a Parquet row) as a conversation
    (``preferences``: a preference pair), or what is wrong with it; a record of the other kind
    is wrong too."""
    try:
        parsed = parse_record(record)
    except BadRecord as bad:
        return bad
    if isinstance(parsed, PreferencePair) == preferences:
        return parsed
    if not preferences:
        return BadRecord("is a preference record (it has 'chosen'/'rejected')",
                         "train on it with objective='dpo', or give it 'prompt'/'response' or "
                         "'messages'")
    return BadRecord("has no 'chosen'/'rejected' (objective='dpo' trains on preference pairs)",
                     'write {"prompt": ..., "chosen": ..., "rejected": ...}')


def iter_conversations(path: str) -> Iterator[Conversation]:
    """The good records in order (``validate`` has already refused or counted the bad ones)."""
    for _, record in iter_records(path):
        if isinstance(record, Conversation):
            yield record


@dataclasses.dataclass(frozen=True)
class RecordCounts:
    records: int  # good ones
    bad_records: int  # skipped (only ever > 0 with skip_bad_records)


def iter_pairs(path: str) -> Iterator[PreferencePair]:
    """The good preference records in order (``validate(..., preferences=True)`` first)."""
    for _, record in iter_records(path, preferences=True):
        if isinstance(record, PreferencePair):
            yield record


def validate(path: str, *, skip_bad_records: bool, preferences: bool = False) -> RecordCounts:
    """Read every record once; the first bad one is a ``ConfigError`` naming ``data_path``, its
    line and the fix, unless ``skip_bad_records`` (then they are counted, with a warning).
    ``preferences``: the records must be preference pairs (DPO), else conversations."""
    located = ((f"line {number}", record)
               for number, record in iter_records(path, preferences=preferences))
    return count_records(located, path, in_file=True, skip_bad_records=skip_bad_records,
                         preferences=preferences)


def count_records(located: Iterable[tuple[str, Conversation | PreferencePair | BadRecord]],
                  data_path: str, *, in_file: bool, skip_bad_records: bool,
                  preferences: bool) -> RecordCounts:
    """``validate``'s verdict on records given as ``(where, record or BadRecord)``: ``where``
    says where in ``data_path`` (``in_file``: "line 3"), or which file and where in it
    ("/data/train-0003.parquet row 1234")."""
    good = bad = 0
    first_bad = ""
    for where, record in located:
        if not isinstance(record, BadRecord):
            good += 1
            continue
        if not skip_bad_records:
            place = f"{data_path} {where}" if in_file else where
            raise ConfigError("data_path", f"{place} {record.problem}",
                              f"{record.fix}, {SKIP_FIX}")
        bad += 1
        first_bad = first_bad or f"{where} {record.problem}"
    if good == 0:
        shape = ('{"prompt": ..., "chosen": ..., "rejected": ...}' if preferences else
                 '{"prompt": ..., "response": ...} or {"messages": [...]}')
        raise ConfigError("data_path", f"{data_path} holds no usable record ({bad} bad)",
                          f"write one {shape} object per line" if in_file else
                          f"give every row the fields of {shape}")
    if bad:
        warnings.warn(f"data_path: skipped {bad} bad record(s) of {good + bad} in {data_path} "
                      f"(first: {first_bad})", stacklevel=3)
    return RecordCounts(records=good, bad_records=bad)

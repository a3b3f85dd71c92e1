"""Preference records (DPO): TRL's standard and conversational forms, read and checked."""

import json
from pathlib import Path

import pytest

from gemmalab.data import records
from gemmalab.data.chat import MODEL, USER, PreferencePair
from gemmalab.errors import ConfigError

STANDARD = {"prompt": "Write about Mia.", "chosen": "Mia had a kite.", "rejected": "Tom ran."}
CONVERSATIONAL = {
    "prompt": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Write about Mia."}],
    "chosen": [{"role": "assistant", "content": "Mia had a kite."}],
    "rejected": [{"role": "assistant", "content": "Tom ran."}],
}


def write_jsonl(path: Path, *lines: object) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n",
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("record", [STANDARD, CONVERSATIONAL], ids=["standard", "chat"])
def test_both_forms_give_two_conversations_with_one_prompt(record):
    pair = records.parse_record(record)
    assert isinstance(pair, PreferencePair)
    user = "Write about Mia." if record is STANDARD else "Be brief.\n\nWrite about Mia."
    assert pair.prompt_turns == ((USER, user),) == pair.rejected.prompt_turns
    assert pair.chosen.turns[-1] == (MODEL, "Mia had a kite.")
    assert pair.rejected.turns[-1] == (MODEL, "Tom ran.")


def test_a_multi_turn_prompt_keeps_its_history_on_both_sides():
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "A story?"}]
    pair = records.parse_record({**CONVERSATIONAL, "prompt": history})
    assert pair.prompt_turns == ((USER, "Hi."), (MODEL, "Hello!"), (USER, "A story?"))


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ({**STANDARD, "rejected": "Mia had a kite."}, "'chosen' and 'rejected' are the same reply"),
        ({**STANDARD, "chosen": " "}, "'chosen' is empty"),
        ({"prompt": "x", "chosen": "y"}, "has no 'rejected'"),
        ({**STANDARD, "response": "z"}, "has 'chosen'/'rejected' and ['response']"),
        ({**STANDARD, "prompt": 3}, "'prompt' is a int"),
        ({**CONVERSATIONAL, "rejected": []}, "'rejected' is not a non-empty list of messages"),
        ({**CONVERSATIONAL, "chosen": [{"role": "user", "content": "x"}]},
         "prompt + 'chosen': message 3 is a 'user' turn where a 'model' turn belongs"),
        ({**CONVERSATIONAL, "prompt": [{"role": "assistant", "content": "x"}]},
         "prompt + 'chosen': message 1 is a 'assistant' turn where a 'user' turn belongs"),
        ({**CONVERSATIONAL, "rejected": CONVERSATIONAL["rejected"] + [
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]},
         "'chosen' and 'rejected' differ before their last model turn"),
        ({"prompt": "Hi.", "response": "Hello!"}, "has no 'chosen'/'rejected'"),
    ],
)
def test_every_bad_preference_record_names_its_line_and_the_fix(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "pairs.jsonl", STANDARD, line, CONVERSATIONAL)
    with pytest.raises(ConfigError) as error:
        records.validate(str(path), skip_bad_records=False, preferences=True)
    message = str(error.value)
    assert message.startswith(f"data_path: {path} line 2 {problem}"), message
    assert "Fix: " in message and "skip_bad_records=True" in message and "\n" not in message


def test_bad_pairs_are_skipped_and_counted_and_the_good_ones_read(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", STANDARD, {**STANDARD, "rejected": STANDARD[
        "chosen"]}, "", CONVERSATIONAL)
    with pytest.warns(UserWarning, match=r"skipped 1 bad record\(s\) of 3 .* line 2"):
        counts = records.validate(str(path), skip_bad_records=True, preferences=True)
    assert (counts.records, counts.bad_records) == (2, 1)
    assert [p.chosen.response for p in records.iter_pairs(str(path))] == ["Mia had a kite."] * 2


def test_sft_data_refuses_a_preference_record_and_says_which_objective(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", {"prompt": "Hi.", "response": "Hello!"},
                       STANDARD)
    with pytest.raises(ConfigError, match=r"line 2 is a preference record .*objective='dpo'"):
        records.validate(str(path), skip_bad_records=False)
    only_sft = write_jsonl(tmp_path / "sft.jsonl", {"prompt": "Hi.", "response": "Hello!"})
    with pytest.raises(ConfigError, match=r"holds no usable record \(1 bad\).*\"chosen\""):
        records.validate(str(only_sft), skip_bad_records=True, preferences=True)

import numpy as np
import pytest

from gemmalab.data import layouts, token_cache


def test_layout_table_by_hand():
    lengths = np.asarray([5, 9, 17])  # 4, 8 and 16 next-token targets
    table = layouts.layout_table(lengths, [8])
    row = table.loc[8]
    assert row["stories over maxlen"] == pytest.approx(1 / 3)
    assert row["truncate: tokens lost"] == pytest.approx(8 / 28)  # 16 -> 8
    assert row["truncate: padding"] == pytest.approx(1 - 20 / 24)
    assert row["split: padding"] == pytest.approx(1 - 28 / 32)  # rows: 1 + 1 + 2
    assert row["split: tokens lost"] == 0 and row["pack: tokens lost"] == 0
    assert 0 <= row["pack: padding"] <= row["split: padding"]


class _Tokenizer:
    class special_tokens:  # noqa: N801 - mirrors gemma's enum attribute
        PAD, EOS, BOS = 0, 1, 2

    def decode(self, ids):
        return "".join(chr(ord("a") + i - 10) for i in ids)


def test_render_row_shows_special_tokens_and_padding():
    tokens = np.asarray([2, 10, 11, 2, 12, 0, 0])
    targets = np.asarray([10, 11, 1, 12, 1, 0, 0])
    segments = np.asarray([1, 1, 1, 2, 2, 0, 0])
    assert layouts.render_row(_Tokenizer(), tokens, targets, segments) == (
        "<bos>ab<eos><bos>c<eos><pad>×2")


def test_example_rows_pack_whole_stories():
    offsets = np.asarray([0, 4, 7])
    split = token_cache.TokenizedSplit(tokens=np.asarray([2, 10, 11, 1, 2, 12, 1], np.int32),
                                       offsets=offsets)
    rows = layouts.example_rows(_Tokenizer(), split, maxlen=8, packing=True, count=1)
    assert rows == ["<bos>ab<eos><bos>c<eos><pad>×3"] or rows == ["<bos>c<eos><bos>ab<eos><pad>×3"]


def test_render_row_marks_the_targets_that_bear_loss():
    class Chat(_Tokenizer):
        class special_tokens(_Tokenizer.special_tokens):  # noqa: N801
            START_OF_TURN, END_OF_TURN = 5, 6

    # <bos><sot>a<eot><sot>b c<eot>: the reply "bc" and its <eot> are the targets with loss.
    tokens = np.asarray([2, 5, 10, 6, 5, 11, 12, 0])
    targets = np.asarray([5, 10, 6, 5, 11, 12, 6, 0])
    segments = np.asarray([1, 1, 1, 1, 1, 1, 1, 0])
    loss = np.asarray([0, 0, 0, 0, 1, 1, 1, 0])
    assert layouts.render_row(Chat(), tokens, targets, segments, loss) == (
        "<bos><start_of_turn>a<end_of_turn><start_of_turn>⟦bc<end_of_turn>⟧<pad>×1")
    assert layouts.render_row(Chat(), tokens, targets, segments) == (
        "<bos><start_of_turn>a<end_of_turn><start_of_turn>bc<end_of_turn><pad>×1")


def test_chat_tables_count_prompts_responses_and_cut_conversations():
    # Two conversations of 6 and 12 tokens; 2 and 5 of their tokens are the model's.
    mask = np.asarray([0, 0, 0, 0, 1, 1] + [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1], np.uint8)
    split = token_cache.TokenizedSplit(tokens=np.full(18, 7, np.int32),
                                       offsets=np.asarray([0, 6, 18]), response_mask=mask)
    prompt, response = layouts.response_lengths(split)
    assert prompt.tolist() == [4, 7] and response.tolist() == [2, 5]
    tokens = layouts.chat_token_table(split)
    assert tokens.loc["response (loss)", "total"] == 7
    assert tokens.loc["prompt (no loss)", "share"] == pytest.approx(11 / 18)
    cut = layouts.chat_split_table(split, [5, 11]).loc[5]
    # maxlen 5: the first fits (5 pairs); the second (11 pairs) is cut into 3 windows.
    assert cut["conversations over maxlen"] == 1 and cut["windows"] == 4
    assert cut["windows without a loss target"] == 1  # pairs 1-5 of the second: prompt only
    assert cut["loss targets cut from their conversation's start"] == pytest.approx(5 / 7)
    assert layouts.chat_split_table(split, [11]).loc[11, "conversations over maxlen"] == 0

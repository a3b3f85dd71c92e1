import numpy as np
import pytest

from gemmalab import data, layouts


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
    split = data.TokenizedSplit(tokens=np.asarray([2, 10, 11, 1, 2, 12, 1], np.int32),
                                offsets=offsets)
    rows = layouts.example_rows(_Tokenizer(), split, maxlen=8, packing=True, count=1)
    assert rows == ["<bos>ab<eos><bos>c<eos><pad>×3"] or rows == ["<bos>c<eos><bos>ab<eos><pad>×3"]

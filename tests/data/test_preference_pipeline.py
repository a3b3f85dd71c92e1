"""Preference pairs from file to rows: the config's checks, the token cache (two documents a
pair), packing that keeps a pair in one row as segments 2k+1 (chosen) and 2k+2 (rejected), and
the refusal of a pair longer than maxlen."""

import json

import numpy as np
import pytest
import sentencepiece as spm

from gemmalab.config import EMBEDDED_PREFERENCES, TrainConfig
from gemmalab.data import chat, documents, packing, preference_corpus, records, token_cache
from gemmalab.data.tokenizer import TokenizerInfo, train_local_tokenizer
from gemmalab.errors import ConfigError
from gemmalab.weights import resolution

RULE = documents.SplitRule(0.1, 100)


@pytest.fixture(scope="module")
def preferences_file(tmp_path_factory):
    return preference_corpus.embedded_preferences_path(tmp_path_factory.mktemp("corpus"), 60)


@pytest.fixture(scope="module")
def cache(preferences_file, tmp_path_factory):
    """The pairs' token cache, with a local tokenizer trained on both sides of the pairs."""
    directory = tmp_path_factory.mktemp("cache")
    texts = documents.training_stories(str(preferences_file), RULE, None, documents.PREFERENCES)
    train_local_tokenizer(texts, directory / "local.model", vocab_size=1000)
    processor = spm.SentencePieceProcessor(model_file=str(directory / "local.model"))
    info = TokenizerInfo("local", processor.serialized_model_proto(), 1000)
    corpus = documents.resolve_corpus(str(preferences_file), cache_dir=directory,
                                      embedded_stories=60, seed=0, preferences=True)
    assert corpus.format == documents.PREFERENCES and corpus.conversational
    built = token_cache.load_or_build_token_cache(corpus, info, rule=RULE, datacount=None,
                                                  cache_dir=directory, workers=1)
    return built, processor


def _longest_pair(split) -> int:
    """Next-token targets of the split's longest pair (both sides)."""
    return int((split.lengths.reshape(-1, 2) - 1).sum(axis=1).max())


@pytest.mark.parametrize("values, parameter", [
    ({"objective": "ppo"}, "objective"),
    ({"objective": "dpo", "data_path": "embedded:instructions"}, "data_path"),
    ({"objective": "dpo", "dpo_beta": 0.0}, "dpo_beta"),
    ({"objective": "dpo", "dpo_label_smoothing": 0.5}, "dpo_label_smoothing"),
    ({"objective": "dpo", "dpo_rpo_alpha": -1.0}, "dpo_rpo_alpha"),
    ({"objective": "dpo", "train_on_prompt": True}, "train_on_prompt"),
    ({"data_path": EMBEDDED_PREFERENCES}, "data_path"),
])
def test_bad_preference_settings_are_one_line_errors_naming_the_parameter(values, parameter):
    with pytest.raises(ConfigError) as error:
        TrainConfig.flat(**values)
    assert str(error.value).startswith(f"{parameter}:") and "\n" not in str(error.value)


def test_dpo_defaults_to_the_embedded_preference_set():
    config = resolution.resolve(TrainConfig.flat(objective="dpo")).config
    assert config.data.path == EMBEDDED_PREFERENCES and config.dpo.beta == 0.1


def test_a_text_file_is_refused_as_preference_data(stories_file, tmp_path):
    with pytest.raises(ConfigError, match="data_path: .* not a JSONL file of preference pairs"):
        documents.resolve_corpus(str(stories_file), cache_dir=tmp_path, embedded_stories=10,
                                 seed=0, preferences=True)


def test_each_pair_is_cached_as_its_chosen_then_its_rejected_conversation(cache,
                                                                         preferences_file):
    built, processor = cache
    assert built.train.group == built.eval.group == 2
    assert built.meta["data_format"] == documents.PREFERENCES
    assert built.meta["train_pairs"] + built.meta["eval_pairs"] == 60
    assert built.meta["train_docs"] == 2 * built.meta["train_pairs"]
    first = next(records.iter_pairs(str(preferences_file)))
    for side, conversation in enumerate((first.chosen, first.rejected)):
        ids, mask = chat.encode(processor, conversation)
        np.testing.assert_array_equal(built.train.doc(side), ids)
        start = built.train.offsets[side]
        np.testing.assert_array_equal(built.train.response_mask[start:start + len(ids)], mask)


@pytest.mark.parametrize("packed", [True, False])
def test_rows_keep_every_pair_whole_chosen_then_rejected(cache, packed):
    built, _ = cache
    split = built.train
    maxlen = 2 * _longest_pair(split)  # rows of two pairs and more
    windows = packing.WindowSource(split, maxlen)
    assert windows.num_units == split.num_docs // 2
    stream = packing.BatchStream(windows, rows_per_batch=4, packing=packed, seed=3)
    rows = stream.plan(0).num_rows
    batches = [stream.next_batch() for _ in range(-(-rows // 4))]
    fields = {k: np.concatenate([b[k] for b in batches])[:rows] for k in batches[0]}
    seen = []
    for r in range(rows):
        ids = fields["segment_ids"][r]
        count = int(ids.max())
        assert count % 2 == 0 and set(ids[ids > 0].tolist()) == set(range(1, count + 1))
        if not packed:
            assert count == 2
        for k in range(count // 2):
            sides = []
            for segment in (2 * k + 1, 2 * k + 2):
                where = ids == segment
                tokens = fields["tokens"][r][where]
                targets = fields["targets"][r][where]
                sides.append(np.concatenate([tokens, targets[-1:]]))
                assert fields["positions"][r][where].tolist() == list(range(where.sum()))
                mask = fields["loss_mask"][r][where]
                assert 0 < mask.sum() < len(mask)  # the reply bears loss, the prompt does not
            # One prompt: the two sides agree up to where the replies start.
            prompt = np.argmax(fields["loss_mask"][r][ids == 2 * k + 1])
            np.testing.assert_array_equal(sides[0][:prompt], sides[1][:prompt])
            seen.append((sides[0].tolist(), sides[1].tolist()))
    expected = [(split.doc(2 * p).tolist(), split.doc(2 * p + 1).tolist())
                for p in range(split.num_docs // 2)]
    assert sorted(seen) == sorted(expected)  # every pair once, as its two sides, in order
    if packed:
        assert rows < windows.num_units  # packing did put several pairs in a row


def test_eval_rows_keep_pairs_whole_and_fill_counts_pairs(cache):
    built, _ = cache
    maxlen = 2 * _longest_pair(built.train)
    windows = packing.WindowSource(built.eval, maxlen)
    batches = packing.eval_batches(built.eval, maxlen=maxlen, batch_size=2, packing=True)
    segments = [int(b["segment_ids"][r].max()) for b in batches for r in range(len(b["tokens"]))]
    assert sum(segments) == 2 * windows.num_units and all(s % 2 == 0 for s in segments)
    fill = packing.packed_fill(packing.WindowSource(built.train, maxlen))
    assert 0 < fill <= 1


def test_a_pair_longer_than_maxlen_is_refused_naming_the_maxlen_that_fits(cache):
    built, _ = cache
    pairs = built.train.lengths.reshape(-1, 2).sum(axis=1) - 2
    maxlen = int(np.median(pairs))
    with pytest.raises(ConfigError) as error:
        packing.WindowSource(built.train, maxlen)
    message = str(error.value)
    assert message.startswith("maxlen: ") and f"raise maxlen to {int(pairs.max())}" in message
    assert f"{int(np.sum(pairs > maxlen))} of {len(pairs)} preference pairs" in message
    packing.WindowSource(built.train, int(pairs.max()))  # the named maxlen fits


def test_sft_data_refuses_preference_pairs_naming_the_objective(preferences_file, tmp_path):
    with pytest.raises(ConfigError, match="objective='dpo'"):
        documents.resolve_corpus(str(preferences_file), cache_dir=tmp_path, embedded_stories=10,
                                 seed=0)
    line = json.loads(preferences_file.read_text().splitlines()[0])
    assert {"prompt", "chosen", "rejected"} <= line.keys()


def test_only_the_last_reply_bears_loss_when_the_prompt_has_model_turns(cache):
    from gemmalab.data.tokenizer import encode_pairs, init_encoder

    _, processor = cache
    pair = records.parse_record({
        "prompt": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": "A story?"}],
        "chosen": [{"role": "assistant", "content": "Mia had a kite."}],
        "rejected": [{"role": "assistant", "content": "Tom ran."}]})
    init_encoder(processor.serialized_model_proto())
    [sides] = encode_pairs([pair])
    for (ids, mask), conversation in zip(sides, (pair.chosen, pair.rejected), strict=True):
        reply = processor.EncodeAsIds(conversation.response)
        assert int(mask.sum()) == len(reply) + 1  # the reply and its <end_of_turn>, nothing else
        assert ids[mask == 1][:len(reply)].tolist() == reply


@pytest.mark.parametrize("packed", [True, False])
def test_the_segment_bound_holds_every_row_and_is_two_without_packing(cache, packed):
    from gemmalab.data.preparation import _max_segments

    built, _ = cache
    maxlen = 2 * _longest_pair(built.train)
    windows = packing.WindowSource(built.train, maxlen)
    bound = _max_segments(windows, built, maxlen, packed)
    stream = packing.BatchStream(windows, rows_per_batch=8, packing=packed, seed=0)
    most = max(int(stream.next_batch()["segment_ids"].max()) for _ in range(8))
    assert most <= bound and bound % 2 == 0
    assert bound == 2 if not packed else bound < maxlen // 8


def test_data_prep_tables_count_pairs_and_the_maxlen_that_holds_them(cache):
    from gemmalab.data import layouts

    built, _ = cache
    pairs = built.train.lengths.reshape(-1, 2).sum(axis=1) - 2
    longest = int(pairs.max())
    tokens, fits = layouts.preference_table(built.train, [longest - 1, longest, 4 * longest])
    assert tokens.loc["pair in one row", "longest"] == longest
    assert tokens.loc["chosen reply (loss)", "mean"] > 0
    assert fits.loc[longest - 1, "pairs that fit"] == pytest.approx(np.mean(pairs <= longest - 1))
    assert fits.loc[longest, "pairs that fit"] == 1.0
    assert fits.loc[4 * longest, "pairs per packed row"] > 2  # packed rows hold several pairs
    assert 0 < fits.loc[4 * longest, "row positions filled"] <= 1
    summary = layouts.corpus_summary(built)
    assert summary.loc["train pairs (this process)", "value"] == len(pairs)

"""Instruction/chat data: Gemma's chat template, the loss mask, JSONL records and bad records,
packing, and one short training run on the embedded instruction set."""

import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from gemmalab.config import EMBEDDED_INSTRUCTIONS, TrainConfig
from gemmalab.data import chat, corpus, documents, packing, records, token_cache
from gemmalab.data.chat import MODEL, USER, Conversation
from gemmalab.data.tokenizer import LOCAL_SPECIAL_IDS, train_local_tokenizer
from gemmalab.errors import ConfigError
from tests.helpers import write_jsonl

PAIR = Conversation(((USER, "Write a story about Mia."), (MODEL, "Mia had a kite.")))
TWO_TURNS = Conversation(((USER, "Hi."), (MODEL, "Hello!"), (USER, "A story?"),
                          (MODEL, "Once upon a time.")))


@pytest.fixture(scope="module")
def instructions_file(tmp_path_factory) -> Path:
    return corpus.embedded_instructions_path(tmp_path_factory.mktemp("corpus"), 200, seed=0)


@pytest.fixture(scope="module")
def local_processor(instructions_file, tmp_path_factory):
    """gemmalab's local tokenizer, trained on the embedded instruction set."""
    path = tmp_path_factory.mktemp("tok") / "local.model"
    texts = documents.training_stories(str(instructions_file), documents.SplitRule(0.1, 100), None)
    train_local_tokenizer(texts, path, vocab_size=600)
    return spm.SentencePieceProcessor(model_file=str(path))


# --- the template --------------------------------------------------------------------------


def test_template_text_is_gemmas():
    assert chat.format_text(PAIR) == (
        "<start_of_turn>user\nWrite a story about Mia.<end_of_turn>\n"
        "<start_of_turn>model\nMia had a kite.<end_of_turn>")
    # What a sampler is given: gemma's own single-turn prompt (gm.text._template.PROMPT).
    assert chat.user_prompt("Hi.") == (
        "<start_of_turn>user\nHi.<end_of_turn>\n<start_of_turn>model\n")
    assert chat.prompt_text(TWO_TURNS.prompt_turns) == (
        "<start_of_turn>user\nHi.<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nA story?<end_of_turn>\n<start_of_turn>model\n")


def test_system_folds_into_the_first_user_turn_and_assistant_is_model():
    record = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": " Hi. "},
                           {"role": "assistant", "content": "Hello!"}]}
    assert records.parse_record(record).turns == ((USER, "Be brief.\n\nHi."), (MODEL, "Hello!"))


@pytest.mark.parametrize("conversation", [PAIR, TWO_TURNS])
def test_ids_use_the_real_special_ids_and_the_mask_covers_model_turns(local_processor,
                                                                      conversation):
    ids, mask = chat.encode(local_processor, conversation)
    start, end = LOCAL_SPECIAL_IDS["START_OF_TURN"], LOCAL_SPECIAL_IDS["END_OF_TURN"]
    assert chat.turn_token_ids(local_processor) == (start, end) == (10, 11)
    assert ids[0] == 2 and ids[-1] == end and len(ids) == len(mask)
    turns = len(conversation.turns)
    assert (ids == start).sum() == turns and (ids == end).sum() == turns
    # The special ids are single tokens, never "<", "start", ... pieces.
    assert "<" not in local_processor.DecodeIds([int(i) for i in ids if i not in (start, end)])
    # The same ids as SentencePiece gives for the whole template text.
    assert ids.tolist() == [2, *local_processor.EncodeAsIds(chat.format_text(conversation))]
    # Targets that bear loss: each model turn's content and its <end_of_turn>, nothing else.
    target_ids = ids[mask == 1]
    replies = [content for role, content in conversation.turns if role == MODEL]
    assert local_processor.DecodeIds(target_ids.tolist()) == "".join(
        reply + "<end_of_turn>" for reply in replies)
    assert (target_ids == end).sum() == len(replies)
    assert not set(ids[mask == 1].tolist()) & {start, 2}


def test_gemma3_tokenizer_ids(cache_dir):
    """Gemma 3's own vocabulary (the original where cached, else rebuilt from the embedded base's
    GGUF): the turn tokens are ids 105 and 106, matched as single pieces in the template text."""
    from gemmalab.data.tokenizer import load_tokenizer

    _, info = load_tokenizer("gemma3", cache_dir=cache_dir, training_stories=None, vocab_size=0,
                             corpus_fingerprint="")
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(info.model_proto)
    assert chat.turn_token_ids(processor) == (105, 106)
    ids, mask = chat.encode(processor, PAIR)
    assert (ids == 105).sum() == 2 and (ids == 106).sum() == 2
    assert ids.tolist() == [2, *processor.EncodeAsIds(chat.format_text(PAIR))]
    assert processor.DecodeIds(ids[mask == 1].tolist()) == "Mia had a kite.<end_of_turn>"


def test_a_tokenizer_without_turn_pieces_is_refused(stories_file, tmp_path):
    path = tmp_path / "plain.model"
    spm.SentencePieceTrainer.train(input=str(stories_file), model_prefix=str(path.with_suffix("")),
                                   vocab_size=300, minloglevel=2)
    with pytest.raises(ConfigError, match=r"^tokenizer: it has no <start_of_turn>.*\(nor Gemma 4"):
        chat.encode(spm.SentencePieceProcessor(model_file=str(path)), PAIR)


def test_a_gemma4_tokenizer_gets_gemma4_turns(stories_file, tmp_path):
    """A vocabulary with Gemma 4's turn pieces (``<|turn>``/``<turn|>``, as its 105/106): the
    template, its ids and the prompts use them."""
    path = tmp_path / "g4.model"
    spm.SentencePieceTrainer.train(input=str(stories_file), model_prefix=str(path.with_suffix("")),
                                   vocab_size=400, minloglevel=2, add_dummy_prefix=False,
                                   normalization_rule_name="identity", byte_fallback=True,
                                   remove_extra_whitespaces=False,
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   user_defined_symbols=["<|turn>", "<turn|>"])
    processor = spm.SentencePieceProcessor(model_file=str(path))
    assert chat.markers_of(processor) == chat.GEMMA4_TURNS
    start, end = chat.turn_token_ids(processor)
    ids, mask = chat.encode(processor, PAIR)
    assert (ids == start).sum() == 2 and (ids == end).sum() == 2
    text = chat.format_text(PAIR, chat.GEMMA4_TURNS)
    assert text.startswith("<|turn>user\n") and text.endswith("<turn|>")
    assert processor.DecodeIds(ids[1:].tolist()) == text
    assert processor.DecodeIds(ids[mask == 1].tolist()) == "Mia had a kite.<turn|>"
    assert chat.user_prompt("Hi", chat.GEMMA4_TURNS) == "<|turn>user\nHi<turn|>\n<|turn>model\n"


# --- records -------------------------------------------------------------------------------

GOOD = {"prompt": "Hi.", "response": "Hello!"}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "Hi.", "response": ', "is not valid JSON"),
        ("[1, 2]", "is a JSON list, not an object"),
        ({"question": "Hi.", "answer": "Hello!"}, "has neither 'prompt'/'response' nor"),
        ({"prompt": "Hi."}, "has no 'response'"),
        ({"prompt": 3, "response": "Hello!"}, "'prompt' is a int, not a string"),
        ({"prompt": "Hi.", "response": "  "}, "'response' is empty"),
        ({"messages": []}, "'messages' is not a non-empty list"),
        ({"messages": ["Hi."]}, "message 1 is a str, not an object"),
        ({"messages": [{"role": "user"}]}, "has no message 1's 'content'"),
        ({"messages": [{"role": "user", "content": ""}, {"role": "model", "content": "x"}]},
         "message 1's 'content' is empty"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "message 1 has role 'bot'"),
        ({"messages": [{"role": "model", "content": "x"}]},
         "message 1 is a 'model' turn where a 'user' turn belongs"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]},
         "message 2 is a 'user' turn where a 'model' turn belongs"),
        ({"messages": [{"role": "user", "content": "x"}]}, "does not end with a model turn"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]},
         "message 2 is a 'system' message after the first"),
        ({**GOOD, "messages": []}, "has both 'messages' and 'prompt'/'response'"),
        ({**GOOD, "facts": {"name": 3}}, "'facts' is not an object of non-empty strings"),
    ],
)
def test_every_bad_record_kind_names_data_path_its_line_and_the_fix(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "chat.jsonl", GOOD, "", line, GOOD)  # the bad one: line 3
    with pytest.raises(ConfigError) as error:
        documents.resolve_corpus(str(path), cache_dir=tmp_path, embedded_stories=10, seed=0)
    message = str(error.value)
    assert message.startswith(f"data_path: {path} line 3 {problem}"), message
    assert "Fix: " in message and "skip_bad_records=True" in message and "\n" not in message


def test_non_utf8_line_is_a_bad_record(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b'\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"line 2 is not UTF-8 \(invalid byte at column 16\)"):
        records.validate(str(path), skip_bad_records=False)


def test_skip_bad_records_counts_and_warns(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", GOOD, "not json", {"prompt": "x"}, GOOD,
                       {"messages": [{"role": "user", "content": "x"}]})
    with pytest.warns(UserWarning, match=r"skipped 3 bad record\(s\) of 5 .* \(first: line 2 is "
                                         r"not valid JSON"):
        resolved = documents.resolve_corpus(str(path), cache_dir=tmp_path, embedded_stories=10,
                                            seed=0, skip_bad_records=True)
    assert (resolved.format, resolved.bad_records) == (documents.CHAT, 3)
    assert len(list(documents.iter_documents(str(path)))) == 2


def test_a_file_of_only_bad_records_is_refused_even_when_skipping(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", "{}", "[]")
    with pytest.raises(ConfigError, match="holds no usable record"):
        records.validate(str(path), skip_bad_records=True)


def test_jsonl_is_recognised_by_name_or_content(tmp_path, stories_file):
    assert records.is_jsonl(str(write_jsonl(tmp_path / "a.txt", GOOD)))
    assert records.is_jsonl(str(tmp_path / "b.jsonl"))  # by name alone, even before it exists
    assert not records.is_jsonl(str(stories_file))


def test_records_are_streamed_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "READ_CHUNK_BYTES", 7)
    lines = [{"prompt": f"Q{i} ✓", "response": f"A{i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "chat.jsonl", *lines)
    assert [c.response for c in records.iter_conversations(str(path))] == [
        f"A{i}" for i in range(20)]


# --- cache, windows, packing ---------------------------------------------------------------


def _chat_split(processor, conversations, *, train_on_prompt=False) -> token_cache.TokenizedSplit:
    encoded = [chat.encode(processor, c) for c in conversations]
    offsets = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in encoded])]).astype(np.int64)
    return token_cache.TokenizedSplit(tokens=np.concatenate([ids for ids, _ in encoded]),
                                      offsets=offsets,
                                      response_mask=np.concatenate([m for _, m in encoded]),
                                      train_on_prompt=train_on_prompt)


def test_packing_keeps_each_conversation_whole_with_its_mask(local_processor):
    conversations = [PAIR, TWO_TURNS, PAIR, TWO_TURNS, PAIR]
    split = _chat_split(local_processor, conversations)
    batches = packing.eval_batches(split, maxlen=64, batch_size=2, packing=True)
    rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    expected = sorted((ids[1:].tolist(), mask[1:].tolist())
                      for ids, mask in (chat.encode(local_processor, c) for c in conversations))
    segments = []
    for r in range(len(rows["tokens"])):
        for segment in set(rows["segment_ids"][r][rows["segment_ids"][r] > 0].tolist()):
            where = rows["segment_ids"][r] == segment
            assert rows["tokens"][r][where][0] == 2  # a segment starts its conversation
            segments.append((rows["targets"][r][where].tolist(),
                             rows["loss_mask"][r][where].tolist()))
    assert sorted(segments) == expected  # one segment per conversation, whole, mask and all
    assert (rows["loss_mask"][rows["segment_ids"] == 0] == 0).all()


def test_train_on_prompt_makes_every_real_token_a_target(local_processor):
    for train_on_prompt in (False, True):
        split = _chat_split(local_processor, [PAIR, TWO_TURNS], train_on_prompt=train_on_prompt)
        (batch,) = packing.eval_batches(split, maxlen=64, batch_size=2, packing=False)
        real = batch["segment_ids"] > 0
        windows = packing.WindowSource(split, 64)
        if train_on_prompt:
            np.testing.assert_array_equal(batch["loss_mask"], real)
            assert windows.num_loss_targets == windows.num_targets
        else:
            assert 0 < batch["loss_mask"].sum() < real.sum()
            assert windows.num_loss_targets == batch["loss_mask"].sum()


def test_a_conversation_over_maxlen_is_cut_into_windows_not_dropped(local_processor):
    long = Conversation(((USER, "Tell me a story. " * 10), (MODEL, "Once upon a time. " * 10)))
    split = _chat_split(local_processor, [PAIR, long])
    maxlen = int(split.lengths[0]) - 1  # PAIR's next-token pairs: it just fits
    windows = packing.WindowSource(split, maxlen)
    assert windows.num_split_docs == 1 and len(windows) > 3
    assert windows.num_loss_targets == int(split.response_mask.sum())  # every reply token kept
    rows = packing.eval_batches(split, maxlen=maxlen, batch_size=1, packing=False)
    assert sum(int(b["loss_mask"].sum()) for b in rows) == windows.num_loss_targets


def test_token_cache_stores_the_mask_beside_the_tokens(instructions_file, local_processor,
                                                       tmp_path):
    from gemmalab.data.tokenizer import TokenizerInfo

    info = TokenizerInfo("local", local_processor.serialized_model_proto(), 600)
    resolved = documents.Corpus(str(instructions_file), "fp", embedded=True, format=documents.CHAT)
    rule = documents.SplitRule(0.1, 100)
    cache = token_cache.load_or_build_token_cache(resolved, info, rule=rule, datacount=None,
                                                  cache_dir=tmp_path, workers=1)
    directory = next((tmp_path / "tokens").iterdir())
    assert (directory / "train_mask.bin").stat().st_size == cache.meta["train_tokens"]
    assert cache.meta["data_format"] == documents.CHAT and cache.meta["stories_read"] == 200
    first = next(records.iter_conversations(str(instructions_file)))
    ids, mask = chat.encode(local_processor, first)
    np.testing.assert_array_equal(cache.train.doc(0), ids)
    np.testing.assert_array_equal(cache.train.response_mask[:len(mask)], mask)
    assert cache.meta["train_response_tokens"] == int(cache.train.response_mask.sum())
    # train_on_prompt is applied when opening: the same cache, every target bearing loss.
    again = token_cache.load_or_build_token_cache(resolved, info, rule=rule, datacount=None,
                                                  cache_dir=tmp_path, workers=1,
                                                  train_on_prompt=True)
    assert again.train.loss_mask is None and again.train.response_mask is not None


def test_held_out_instructions_keep_their_facts(instructions_file):
    rule = documents.SplitRule(0.1, 100)
    held_out = list(documents.heldout_conversations(str(instructions_file), rule, None))
    every = list(corpus.generate_instructions(200, seed=0))
    assert [c.response for c in held_out] == [r["response"] for r in every[9::10]]
    assert [c.facts for c in held_out] == [r["facts"] for r in every[9::10]]


# --- the embedded instruction set, end to end ----------------------------------------------


def test_unknown_embedded_data_set_is_refused():
    with pytest.raises(ConfigError, match="^data_path: unknown embedded data set 'embedded:x'"):
        TrainConfig.flat(data_path="embedded:x")


@pytest.mark.slow
def test_training_on_the_embedded_instruction_set(tmp_path, cache_dir):
    from gemmalab.train.experiment import Experiment

    config = TrainConfig.flat(model="gemma3-tiny", data_path=EMBEDDED_INSTRUCTIONS,
                              embedded_stories=100,
                         cache_dir=str(cache_dir), output_dir=str(tmp_path / "run"), batch_size=8,
                         maxlen=64, max_steps=8, eval_every=0, tokenizer_vocab_size=600,
                         tokenize_workers=1, compute_dtype="float32", seed=5, num_layers=2)
    experiment = Experiment.prepare(config)
    stats = experiment.data_stats
    assert stats["data_format"] == documents.CHAT and stats["embedded_corpus"]
    assert stats["bad_records_skipped"] == 0 and stats["stories_read"] == 100
    # The prompts (instruction, turn headers) bear no loss: ~15% of the real targets here.
    assert 0.5 < stats["train_loss_target_tokens"] / stats["train_target_tokens"] < 0.9
    # Stories are ~250 tokens: each is cut into windows at maxlen 64, none dropped.
    assert stats["conversations_split_over_maxlen"] == stats["train_docs"]
    summary = experiment.train(progress=False)
    assert summary["useful_token_share"] < 1
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert summary["data"] == stats
    # Sampled as a user turn in the chat template (what the run trained on), not raw text.
    reply = experiment.sample("Write a story about a dog.", max_new_tokens=4)
    assert reply.prompt.startswith("<start_of_turn>user\nWrite a story about a dog.<end_of_turn>")
    assert experiment.sample("Once", chat=False, max_new_tokens=4).prompt == "Once"

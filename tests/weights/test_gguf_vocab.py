"""The embedded GGUF's vocabulary, rebuilt as SentencePiece, encodes as Google's Gemma 3 does.

Every expected id below was produced by Google's Gemma 3 tokenizer (262,144 pieces) and published
in the repository named beside it; none was generated here. Hugging Face's Gemma 3 tokenizers were
converted from the same SentencePiece file, so their ids count as Google's.
"""

import collections
import time
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_model

from gemmalab.errors import ConfigError
from gemmalab.weights import embedded, gguf_vocab
from gemmalab.weights.gguf import read_header

Piece = sp_model.ModelProto.SentencePiece

EDGERUNNER = ("christopherkarani/EdgeRunner Tests/EdgeRunnerTests/GemmaTokenizerParityTest.swift"
              " (HF google/gemma-3-1b-it, use_fast=False, add_special_tokens=False)")
KERAS_HUB = ("keras-team/keras-hub keras_hub/src/models/gemma3/gemma3_tokenizer_test.py"
             " (test_tokenizer_basics, on the real Gemma 3 .spm)")
SD_CPP = ("leejet/stable-diffusion.cpp tests/ltx_parity/test_gemma_tokenizer.cpp"
          " (HF google/gemma-3-12b-it, add_special_tokens=False)")
ADVERSARIA = ("LLM-QC/AdversariaLLM tests/test_lm_utils.py (MODEL_GROUND_TRUTH"
              " google/gemma-3-1b-it/-4b-it/-12b-it chat-template segments; BOS 2 stripped)")
GEMMA3_BLOG = ("DhruvPatel01/DhruvPatel01.github.io content/posts/gemma3_tokenizer/index.md"
               " (Google's gemma3 tokenizer.model in sentencepiece; pieces, not ids)")


class IdCase(NamedTuple):
    text: str
    ids: list[int]
    source: str


class PieceCase(NamedTuple):
    text: str
    pieces: list[str]
    source: str
    add_bos_eos: bool = False


ID_CASES = [
    IdCase("Hello, world!", [9259, 236764, 1902, 236888], EDGERUNNER),
    IdCase("The capital of France is", [818, 5279, 529, 7001, 563], EDGERUNNER),
    IdCase("1+1=2", [236770, 236862, 236770, 236784, 236778], EDGERUNNER),  # digits split
    IdCase("def foo():\n    return 42",  # code: newline, a 4-space run (140), digits
           [2063, 46293, 6141, 107, 140, 2060, 236743, 236812, 236778], EDGERUNNER),
    IdCase("I'm don't can't",
           [236777, 236789, 236757, 1537, 236789, 236745, 740, 236789, 236745], EDGERUNNER),
    IdCase("Hello 你好", [9259, 43758, 237389], EDGERUNNER),
    IdCase("  spaces  and\ttabs", [138, 35220, 138, 624, 255968, 39218], EDGERUNNER),
    IdCase("emoji: 🎉🚀", [67906, 236787, 204906, 242015], EDGERUNNER),
    IdCase("the quick brown fox", [1437, 3823, 8864, 37423], KERAS_HUB),
    IdCase("the earth is round", [1437, 7764, 563, 4886], KERAS_HUB),
    IdCase("hello", [23391], SD_CPP),
    IdCase("hello world", [23391, 1902], SD_CPP),
    IdCase("  a  b", [138, 236746, 138, 236763], SD_CPP),
    IdCase("naïve", [1789, 238527, 560], SD_CPP),
    IdCase("你好", [144626], SD_CPP),
    IdCase("→ a", [238183, 496], SD_CPP),
    IdCase("The quick brown fox jumps over the lazy dog.",
           [818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761], SD_CPP),
    IdCase("", [], SD_CPP),
    IdCase(" ", [236743], SD_CPP),
    IdCase("\n\n\ttabs and\nnewlines", [108, 255968, 39218, 532, 107, 208697], SD_CPP),
    IdCase("mixed: ABCdef 123 !@# UNK char: \u200b",
           [63258, 236787, 21593, 2063, 236743, 236770, 236778, 236800,
            1717, 236940, 236865, 7866, 236855, 1577, 236787, 36504], SD_CPP),
    IdCase("<start_of_turn>user\n", [105, 2364, 107], ADVERSARIA),
    IdCase("Hello, how are you?", [9259, 236764, 1217, 659, 611, 236881], ADVERSARIA),
    IdCase("<end_of_turn>\n<start_of_turn>model\n", [106, 107, 105, 4368, 107], ADVERSARIA),
    IdCase("I'm good, thank you!", [236777, 236789, 236757, 1535, 236764, 7806, 611, 236888],
           ADVERSARIA),
    IdCase("<end_of_turn>\n<start_of_turn>user\n", [106, 107, 105, 2364, 107], ADVERSARIA),
    IdCase("What is the capital of France?", [3689, 563, 506, 5279, 529, 7001, 236881],
           ADVERSARIA),
    IdCase("Paris.", [50429, 236761], ADVERSARIA),
    IdCase("x x x x x", [236781, 1123, 1123, 1123, 1123], ADVERSARIA),
    # The source's first turn, its pre + prompt + post segments joined (BOS stripped).
    IdCase("<start_of_turn>user\nHello, how are you?<end_of_turn>\n<start_of_turn>model\n",
           [105, 2364, 107, 9259, 236764, 1217, 659, 611, 236881, 106, 107, 105, 4368, 107],
           ADVERSARIA),
]

PIECE_CASES = [
    # Raw SentencePiece keeps <bos> typed in text as characters; add_bos/add_eos add the ids.
    PieceCase("<bos>Heyllo", ["<bos>", "<", "bos", ">", "Hey", "llo", "<eos>"], GEMMA3_BLOG,
              add_bos_eos=True),
    PieceCase("<start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model",
              ["<start_of_turn>", "user", "\n", "Who", "▁are", "▁you", "?", "<end_of_turn>",
               "\n", "<start_of_turn>", "model"], GEMMA3_BLOG),
    PieceCase("<unused10> blahblahblah", ["<unused10>", "▁blah", "blah", "blah"], GEMMA3_BLOG),
    PieceCase("🫩", ["<0xF0>", "<0x9F>", "<0xAB>", "<0xA9>"], GEMMA3_BLOG),  # byte fallback
]


@pytest.fixture(scope="module")
def gguf_path(cache_dir):
    return embedded.gguf_path("embedded:gemma3-270m", cache_dir)


@pytest.fixture(scope="module")
def proto(gguf_path) -> bytes:
    return gguf_vocab.sentencepiece_proto(gguf_path)


@pytest.fixture(scope="module")
def processor(proto) -> spm.SentencePieceProcessor:
    loaded = spm.SentencePieceProcessor()
    loaded.LoadFromSerializedProto(proto)
    return loaded


@pytest.fixture(scope="module")
def model(proto) -> sp_model.ModelProto:
    parsed = sp_model.ModelProto()
    parsed.ParseFromString(proto)
    return parsed


@pytest.mark.parametrize("case", ID_CASES, ids=lambda case: repr(case.text)[:40])
def test_encodes_like_googles_tokenizer(processor, case):
    assert processor.encode(case.text) == case.ids, case.source
    assert processor.decode(case.ids) == case.text


@pytest.mark.parametrize("case", PIECE_CASES, ids=lambda case: repr(case.text)[:40])
def test_splits_like_googles_tokenizer(processor, case):
    pieces = processor.encode_as_pieces(case.text, add_bos=case.add_bos_eos,
                                        add_eos=case.add_bos_eos)
    assert pieces == case.pieces, case.source


def test_turn_markers_typed_in_text_are_single_ids(processor):
    # Gemma's chat prompts are plain text; the markers must come out as ids 105/106.
    assert processor.encode("<start_of_turn>") == [105]
    assert processor.encode("<end_of_turn>") == [106]
    assert processor.decode([105]) == "<start_of_turn>"
    assert processor.decode([106]) == "<end_of_turn>"
    chat = "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert processor.decode(processor.encode(chat)) == chat


def test_loads_with_gemmas_vocabulary_and_special_ids(processor):
    assert processor.GetPieceSize() == 262_144
    assert (processor.pad_id(), processor.eos_id(), processor.bos_id(), processor.unk_id()) == \
        (0, 1, 2, 3)
    assert [processor.IdToPiece(i) for i in (4, 5, 6, 105, 106, 255_999, 256_000)] == \
        ["<mask>", "[multimodal]", "<unused0>", "<start_of_turn>", "<end_of_turn>",
         "<start_of_image>", "<end_of_image>"]
    assert all(processor.IsByte(i) for i in range(238, 494))


def test_piece_types_and_scores_are_googles(model):
    # Google's file, as the blog counted it: only pad/eos/bos are CONTROL, <unk> is UNKNOWN.
    counts = collections.Counter(Piece.Type.Name(piece.type) for piece in model.pieces)
    assert counts == {"NORMAL": 255_474, "USER_DEFINED": 6410, "BYTE": 256, "CONTROL": 3,
                      "UNKNOWN": 1}, GEMMA3_BLOG
    scores = {piece.piece: piece.score for piece in model.pieces}
    assert {p: scores[p] for p in ("He", "el", "ll", "lo", "<start_of_turn>")} == \
        {"He": -1715.0, "el": -41.0, "ll": -365.0, "lo": -350.0, "<start_of_turn>": 0.0}
    assert model.pieces[105].type == Piece.USER_DEFINED
    assert model.pieces[138].piece == "▁▁"  # llama.cpp stored it as two spaces


def test_trainer_and_normalizer_settings_are_gemmas(model):
    trainer, normalizer = model.trainer_spec, model.normalizer_spec
    assert trainer.model_type == sp_model.TrainerSpec.BPE
    assert trainer.byte_fallback and trainer.split_digits
    assert (trainer.pad_piece, trainer.eos_piece, trainer.bos_piece, trainer.unk_piece) == \
        ("<pad>", "<eos>", "<bos>", "<unk>")
    assert normalizer.name == "identity" and not normalizer.precompiled_charsmap
    assert not normalizer.add_dummy_prefix and not normalizer.remove_extra_whitespaces


def test_conversion_takes_seconds_not_minutes(gguf_path):
    # gguf.GGUFReader alone takes ~14 s on this file; the header walk must stay far below that.
    start = time.perf_counter()
    gguf_vocab.sentencepiece_proto(gguf_path)
    assert time.perf_counter() - start < 10


def write_gguf(path, add_fields, endianess=gguf.GGUFEndian.LITTLE):
    writer = gguf.GGUFWriter(path, "gemma3", endianess=endianess)
    add_fields(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gemma_vocabulary(writer):
    """A Gemma-shaped vocabulary typed the way llama.cpp writes it."""
    control, user, byte, normal = (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED,
                                   gguf.TokenType.BYTE, gguf.TokenType.NORMAL)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "  "]
    types = [control] * 5 + [user]
    tokens += [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "▁a"]
    types += [byte] * 256 + [normal] * 3
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * 6 + [0.0] * 256 + [-10.0, -11.0, -1.0])
    writer.add_token_types(types)
    for add_id, token_id in ((writer.add_pad_token_id, 0), (writer.add_eos_token_id, 1),
                             (writer.add_bos_token_id, 2), (writer.add_unk_token_id, 3)):
        add_id(token_id)


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_vocabulary_fields_read_as_gguf_reader_reads_them(tmp_path, endianess):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_gemma_vocabulary, endianess)
    ours = read_header(path).fields
    theirs = gguf.GGUFReader(path).fields
    assert set(ours) == {key for key in theirs if not key.startswith("GGUF.")}
    for key, value in ours.items():
        expected = theirs[key].contents()
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, np.asarray(expected), err_msg=key)
        else:  # the pieces come as a tuple: the header is shared, so read-only
            assert (list(value) if isinstance(value, tuple) else value) == expected, key


def test_llama_cpp_typing_is_undone(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_gemma_vocabulary)
    tiny = spm.SentencePieceProcessor()
    tiny.LoadFromSerializedProto(gguf_vocab.sentencepiece_proto(path))  # <unk> is UNKNOWN now
    assert tiny.encode("<start_of_turn>  a") == [4, 5, 263]  # user-defined, '▁▁' matched
    assert tiny.encode(" a") == [264]
    assert tiny.encode("<bos>")[0] != 2  # <bos> stays CONTROL: never matched in text
    assert tiny.encode("b") == [6 + ord("b")]  # byte fallback


def gpt2_vocabulary(writer):
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])


def no_vocabulary(writer):
    pass


def model_name_only(writer):
    writer.add_tokenizer_model("llama")


@pytest.mark.parametrize("add_fields, problem", [
    (gpt2_vocabulary, "'gpt2'"),
    (no_vocabulary, "no tokenizer"),
    (model_name_only, "lacks the tokenizer fields"),
])
def test_a_gguf_without_sentencepiece_vocabulary_is_a_one_line_config_error(
        tmp_path, add_fields, problem):
    path = write_gguf(tmp_path / "other.gguf", add_fields)
    with pytest.raises(ConfigError) as raised:
        gguf_vocab.sentencepiece_proto(path)
    assert raised.value.parameter == "checkpoint"
    assert problem in str(raised.value) and "\n" not in str(raised.value)


def test_a_file_that_is_not_gguf_is_a_one_line_config_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match="^checkpoint: .*not a readable GGUF") as raised:
        gguf_vocab.sentencepiece_proto(path)
    assert "\n" not in str(raised.value)


def test_the_export_writes_the_embedded_vocabulary_back_bit_for_bit(gguf_path, proto):
    """The SentencePiece model rebuilt from the embedded GGUF, written as a GGUF's vocabulary
    (the export's ``gguf_vocabulary``): llama.cpp's converter's pieces, scores and types."""
    fields = read_header(gguf_path).fields
    vocabulary = gguf_vocab.gguf_vocabulary(proto)
    assert vocabulary.tokens == list(fields[gguf.Keys.Tokenizer.LIST])
    np.testing.assert_array_equal(vocabulary.scores, fields[gguf.Keys.Tokenizer.SCORES])
    np.testing.assert_array_equal(vocabulary.token_types, fields[gguf.Keys.Tokenizer.TOKEN_TYPE])
    assert vocabulary.special_ids == {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
    assert vocabulary.add_space_prefix is fields[gguf.Keys.Tokenizer.ADD_PREFIX] is False
    assert vocabulary.end_of_turn == 106

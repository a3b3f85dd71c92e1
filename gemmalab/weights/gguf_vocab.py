"""A llama.cpp GGUF's vocabulary rebuilt as the SentencePiece model it was converted from.

A GGUF of Gemma carries Google's SentencePiece vocabulary (pieces, BPE scores, piece types) but
not the ``tokenizer.model`` file, and ``gm.text.Tokenizer`` needs that file. llama.cpp's
converter changed three things on the way, and they are undone here:

- it spells the spaces of user-defined pieces (the space runs, ids 138-167) as ' ', while
  SentencePiece matches pieces after turning every space into U+2581 '▁';
- it types ``<unk>`` CONTROL, and SentencePiece refuses a model whose unk piece is not UNKNOWN;
- it types every ``<...>`` piece it finds special (``<mask>``, ``<start_of_turn>``,
  ``<unusedN>``...) CONTROL, while Google's model has only ``<pad>``, ``<eos>`` and ``<bos>``
  CONTROL and the rest USER_DEFINED: SentencePiece never matches a CONTROL piece in text, so
  "<start_of_turn>user" would not encode to id 105 and chat prompts would break.

The vocabulary comes from the header ``gguf.read_header`` parses (once per file, shared with
the weights' ``gguf.inspect``): a fraction of a second, where ``gguf.GGUFReader`` takes 14 s on
gemma-3-270m's 262,144 pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys, TokenType
from sentencepiece import sentencepiece_model_pb2 as sp_model

from gemmalab.errors import ConfigError
from gemmalab.weights.gguf import read_header

Piece = sp_model.ModelProto.SentencePiece
META_SPACE = "\u2581"  # how SentencePiece spells a space inside pieces

# Gemma's reserved ids, used when a GGUF leaves one of its special-id fields out.
GEMMA_SPECIAL_IDS = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
SPECIAL_ID_KEYS = {
    "pad": Keys.Tokenizer.PAD_ID,
    "eos": Keys.Tokenizer.EOS_ID,
    "bos": Keys.Tokenizer.BOS_ID,
    "unk": Keys.Tokenizer.UNK_ID,
}

# GGUF token types and SentencePiece piece types share their numbers; the table says so once.
SENTENCEPIECE_TYPE = {
    TokenType.NORMAL: Piece.NORMAL,
    TokenType.UNKNOWN: Piece.UNKNOWN,
    TokenType.CONTROL: Piece.CONTROL,
    TokenType.USER_DEFINED: Piece.USER_DEFINED,
    TokenType.UNUSED: Piece.UNUSED,
    TokenType.BYTE: Piece.BYTE,
}

FIX = "use a GGUF converted from a Gemma checkpoint (llama.cpp tokenizer model 'llama')"


def sentencepiece_proto(path: str | Path) -> bytes:
    """The serialized SentencePiece ``ModelProto`` of the GGUF at ``path``.

    Loaded with ``SentencePieceProcessor().LoadFromSerializedProto``, it encodes text as Google's
    Gemma tokenizer does, so a GGUF base needs no separate tokenizer download.
    """
    metadata = read_header(path).fields
    require_sentencepiece_vocabulary(metadata, path)
    return model_proto(metadata, path).SerializeToString()


def require_sentencepiece_vocabulary(metadata: Mapping[str, Any], path: str | Path) -> None:
    """One-line ``ConfigError`` unless the GGUF carries a SentencePiece ("llama") vocabulary."""
    model = metadata.get(Keys.Tokenizer.MODEL)
    if model is None:
        raise ConfigError("checkpoint", f"{path} carries no tokenizer", FIX)
    if model != "llama":
        raise ConfigError("checkpoint", f"{path} has a {model!r} tokenizer, not a SentencePiece "
                          "one, so it cannot be rebuilt as Gemma's tokenizer", FIX)
    arrays = (Keys.Tokenizer.LIST, Keys.Tokenizer.SCORES, Keys.Tokenizer.TOKEN_TYPE)
    missing = [key for key in arrays if key not in metadata]
    if missing:
        raise ConfigError("checkpoint", f"{path} lacks the tokenizer fields {missing}", FIX)
    sizes = {len(metadata[key]) for key in arrays}
    if len(sizes) != 1:
        raise ConfigError("checkpoint", f"{path} has tokenizer arrays of different lengths "
                          f"{sorted(sizes)}", FIX)


def special_ids(metadata: Mapping[str, Any], tokens: Sequence[str],
                path: str | Path) -> dict[str, int]:
    """pad/eos/bos/unk ids, checked to name Gemma's pieces: the rebuilt settings are Gemma's."""
    ids = {name: int(metadata.get(key, GEMMA_SPECIAL_IDS[name]))
           for name, key in SPECIAL_ID_KEYS.items()}
    for name, token_id in ids.items():
        found = tokens[token_id] if 0 <= token_id < len(tokens) else None
        if found != f"<{name}>":
            raise ConfigError("checkpoint", f"{path}'s {name} id {token_id} is {found!r}, not "
                              f"'<{name}>': not a Gemma vocabulary", FIX)
    return ids


def piece_types(gguf_types: np.ndarray, ids: dict[str, int]) -> np.ndarray:
    """SentencePiece types of the pieces, with llama.cpp's re-typing undone (see module doc)."""
    lookup = np.full(max(SENTENCEPIECE_TYPE) + 1, -1, dtype=np.int32)
    for gguf_type, sentencepiece_type in SENTENCEPIECE_TYPE.items():
        lookup[gguf_type] = sentencepiece_type
    valid = (gguf_types >= 0) & (gguf_types < len(lookup))
    types = np.where(valid, lookup[np.where(valid, gguf_types, 0)], -1)
    if (types < 0).any():
        raise ValueError(f"unknown GGUF token types {sorted(set(gguf_types[types < 0]))}")
    types[types == Piece.CONTROL] = Piece.USER_DEFINED
    types[[ids["pad"], ids["eos"], ids["bos"]]] = Piece.CONTROL
    types[ids["unk"]] = Piece.UNKNOWN
    return types


def piece_scores(gguf_scores: np.ndarray, types: np.ndarray) -> np.ndarray:
    """Only NORMAL pieces' scores rank BPE merges; the others score 0 as in Google's file."""
    return np.where(types == Piece.NORMAL, gguf_scores, 0.0).astype(np.float32)


def piece_texts(tokens: Sequence[str]) -> list[str]:
    """Pieces as SentencePiece spells them: a raw ' ' could never match, text has '▁' there."""
    return [token.replace(" ", META_SPACE) for token in tokens]


def model_proto(metadata: Mapping[str, Any], path: str | Path) -> sp_model.ModelProto:
    """Gemma's ``ModelProto``: the GGUF's pieces plus the trainer/normalizer settings Gemma has."""
    tokens = metadata[Keys.Tokenizer.LIST]
    ids = special_ids(metadata, tokens, path)
    try:
        types = piece_types(np.asarray(metadata[Keys.Tokenizer.TOKEN_TYPE]), ids)
    except ValueError as exc:
        raise ConfigError("checkpoint", f"{path}: {exc}", FIX) from None
    scores = piece_scores(np.asarray(metadata[Keys.Tokenizer.SCORES]), types)
    proto = sp_model.ModelProto()
    add_piece = proto.pieces.add
    for text, score, kind in zip(piece_texts(tokens), scores.tolist(), types.tolist(),
                                 strict=True):
        add_piece(piece=text, score=score, type=kind)
    set_trainer_spec(proto.trainer_spec, len(tokens), ids, tokens)
    set_normalizer_spec(proto.normalizer_spec)
    return proto


def set_trainer_spec(spec: sp_model.TrainerSpec, vocab_size: int, ids: dict[str, int],
                     tokens: Sequence[str]) -> None:
    """The trainer settings encoding reads: BPE, byte fallback, and where the specials are."""
    spec.model_type = sp_model.TrainerSpec.BPE
    spec.vocab_size = vocab_size
    spec.byte_fallback = True  # characters without a piece become <0xNN> byte pieces
    spec.split_digits = True
    for name, token_id in ids.items():
        setattr(spec, f"{name}_id", token_id)
        setattr(spec, f"{name}_piece", tokens[token_id])


def set_normalizer_spec(spec: sp_model.NormalizerSpec) -> None:
    """Gemma normalizes nothing: no NFKC table, no dummy prefix, whitespace kept as written."""
    spec.name = "identity"
    spec.add_dummy_prefix = False
    spec.remove_extra_whitespaces = False
    spec.escape_whitespaces = True


# ---------------------------------------------------------------------------------------------
# The other way: a SentencePiece model as a GGUF's vocabulary (the export, gguf_export).
#
# llama.cpp's converter (convert_hf_to_gguf.py, _create_vocab_sentencepiece) types Gemma's added
# pieces (Google's CONTROL and USER_DEFINED ones, and <unk>) from the Hugging Face tokenizer
# files: those marked special there (<pad>, <eos>, <bos>, <unk>, <mask> and the chat turns'
# pieces) or that look special to it (<unusedN>, <|...|>) CONTROL; the rest (the whitespace
# runs, HTML tags, <start_of_image>, ...) USER_DEFINED with their '▁' written as ' ' (llama.cpp
# matches them in the raw text, before its own space escaping); all scored -1000. Its tokenizer
# never splits a CONTROL piece out of plain text, and matches USER_DEFINED ones before
# SentencePiece's merges, as Google's tokenizer does. The rules below give the embedded Gemma 3
# GGUF's vocabulary back bit for bit from the model ``model_proto`` rebuilt from it (a test).

ADDED_PIECE_SCORE = -1000.0  # what the converter scores an added piece (never a merge)
GGUF_TYPE = {sentencepiece: gguf for gguf, sentencepiece in SENTENCEPIECE_TYPE.items()}
_ADDED = (Piece.CONTROL, Piece.USER_DEFINED, Piece.UNKNOWN)


@dataclasses.dataclass(frozen=True)
class GGUFVocabulary:
    """A SentencePiece model as llama.cpp's ``tokenizer.ggml.*`` fields hold it."""

    tokens: list[str]
    scores: np.ndarray  # float32
    token_types: np.ndarray  # int32, GGUF's TokenType
    special_ids: dict[str, int]  # pad/eos/bos/unk, those the model has
    add_space_prefix: bool
    end_of_turn: int | None  # <end_of_turn>'s id, a chat's second stop token, when present


# Marked special in Gemma's tokenizer_config.json besides pad/eos/bos/unk (Gemma 3's turn pieces,
# as gemmalab.data.chat.GEMMA3_TURNS spells them; weights may not import data).
SPECIAL_PIECES = ("<mask>", "<start_of_turn>", "<end_of_turn>")


def looks_special(piece: str) -> bool:
    """An added piece llama.cpp types CONTROL (the rest of them are USER_DEFINED)."""
    return (piece in SPECIAL_PIECES or (piece.startswith("<unused") and piece.endswith(">"))
            or (piece.startswith("<|") and piece.endswith("|>")))


def gguf_vocabulary(proto: bytes) -> GGUFVocabulary:
    """The serialized SentencePiece ``ModelProto`` ``proto`` as llama.cpp's converter writes it
    (see above); ``model_proto`` reads it back as the same SentencePiece model."""
    model = sp_model.ModelProto()
    model.ParseFromString(proto)
    tokens, scores, types = [], [], []
    for piece in model.pieces:
        if piece.type in _ADDED:
            special = looks_special(piece.piece)
            tokens.append(piece.piece if special else piece.piece.replace(META_SPACE, " "))
            scores.append(ADDED_PIECE_SCORE)
            types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        else:
            tokens.append(piece.piece)
            scores.append(piece.score)
            types.append(GGUF_TYPE[piece.type])
    spec = model.trainer_spec
    ids = {name: getattr(spec, f"{name}_id") for name in SPECIAL_ID_KEYS}
    ids = {name: i for name, i in ids.items() if 0 <= i < len(tokens)}
    for name in ("pad", "eos", "bos", "unk"):  # llama.cpp never matches them in text
        if name in ids:
            types[ids[name]] = TokenType.CONTROL
    end_of_turn = tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else None
    return GGUFVocabulary(tokens, np.asarray(scores, np.float32), np.asarray(types, np.int32),
                          ids, bool(model.normalizer_spec.add_dummy_prefix), end_of_turn)

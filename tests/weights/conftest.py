"""Fixtures the weight sinks' and sources' tests share: a local SentencePiece model at the tiny
presets' 600 pieces, and the tiny Gemma 3 with random float32 params."""

import numpy as np
import pytest

from gemmalab.model import presets

TINY_VOCAB = 600  # what transformers saved tests/fixtures/hf_gemma3_tiny.json at


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, stories_file):
    """A local SentencePiece model of ``TINY_VOCAB`` pieces trained on the test stories."""
    from gemmalab.data import documents, tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "tiny.model"
    return tokenizer.train_local_tokenizer(documents.iter_stories(str(stories_file)), path,
                                           vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset's config and random float32 params. Norm scales start at zero: they are
    given values, so that a swapped or un-shifted norm cannot pass."""
    import jax

    config = presets.model_config("gemma3-tiny", TINY_VOCAB)
    model = presets.build_model(config, param_dtype=jax.numpy.float32)
    params = presets.init_params(model, seed=0, sample_length=8)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, w: (rng.normal(size=w.shape).astype(np.float32) if path[-1].key == "scale"
                         else np.asarray(w, np.float32)), params)
    return config, params

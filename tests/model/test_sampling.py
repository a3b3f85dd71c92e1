"""Continuations and their decided part: the part another CPU's rounding cannot change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmalab.data import documents
from gemmalab.data.tokenizer import load_tokenizer
from gemmalab.inspect import reports
from gemmalab.model import presets, sampling
from tests.helpers import PROMPT
from tests.notebook_regression import compare_samples


@pytest.fixture(scope="module")
def tokenizer(stories_file, tmp_path_factory):
    tok, _ = load_tokenizer("local", cache_dir=tmp_path_factory.mktemp("tok"),
                            training_stories=documents.training_stories(
                                str(stories_file), documents.SplitRule(0.1, 100), None),
                            vocab_size=600, corpus_fingerprint="sampling")
    return tok


@pytest.fixture(scope="module")
def model_and_params():
    model = presets.build_model(presets.model_config("gemma3-tiny", 600), param_dtype=jnp.float32)
    return model, presets.init_params(model, seed=0, sample_length=32)


PROMPTS = [PROMPT, "Tom had a"]


def continuations(model, params, tokenizer, **kwargs):
    return sampling.continue_prompts(model, params, tokenizer, PROMPTS, max_new_tokens=12,
                                     compute_dtype=jnp.float32, **kwargs)


@pytest.mark.slow
def test_margins_score_the_sampler_own_choices(model_and_params, tokenizer):
    """Teacher-forced, each greedy token is the argmax: margins are >= 0 (up to float noise)
    and line up with the generated positions (an off-by-one would make many negative)."""
    model, params = model_and_params
    gm = __import__("gemma").gm
    sampler = gm.text.Sampler(model=model, params=params, tokenizer=tokenizer,
                              sampling=gm.text.Greedy(), cache_length=256, max_out_length=12)
    output = sampler.sample(PROMPT, max_new_tokens=12, return_state=True)
    generated = [int(t) for t in np.asarray(output.state.predicted_tokens)[0]]
    margins = sampling.greedy_margins(model, params, tokenizer.encode(PROMPT, add_bos=True),
                                      generated)
    assert margins.shape == (12,)
    assert (margins > -1e-4).all(), margins
    assert (margins > 1e-3).mean() > 0.5  # a random model still prefers its choices clearly


def test_greedy_continuations_say_what_is_decided(model_and_params, tokenizer):
    model, params = model_and_params
    for c, prompt in zip(continuations(model, params, tokenizer), PROMPTS, strict=True):
        assert c.prompt == prompt and c.text
        assert c.text.startswith(c.decided)
        assert c.complete == (c.decided == c.text)
    texts = sampling.sample(model, params, tokenizer, PROMPTS, max_new_tokens=12,
                            compute_dtype=jnp.float32)
    assert texts == [c.text for c in continuations(model, params, tokenizer)]


def test_sampled_continuations_claim_nothing(model_and_params, tokenizer):
    model, params = model_and_params
    for c in continuations(model, params, tokenizer, temperature=0.8, top_p=0.9, seed=1):
        assert c.decided == "" and not c.complete


def test_decided_parts_survive_float_noise_and_catch_real_changes(model_and_params, tokenizer):
    """Weights perturbed far beyond cross-CPU rounding (1e-4 relative) agree on the decided
    parts; weights of another seed (a real change) do not."""
    model, params = model_and_params
    stored = [c.record() for c in continuations(model, params, tokenizer)]
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(params))))
    noisy = jax.tree.map(
        lambda p: p * (1 + 1e-4 * jax.random.normal(next(keys), p.shape, p.dtype)), params)
    assert compare_samples(stored, [c.record() for c in continuations(model, noisy, tokenizer)]) \
        == []
    other = presets.init_params(model, seed=1, sample_length=32)
    assert compare_samples(stored, [c.record() for c in continuations(model, other, tokenizer)])


class PieceTokenizer:
    """Decodes ids by joining pieces, like SentencePiece without its leading-space rule."""

    tokens = ["<pad>", "<eos>", "<bos>", " Once", " upon", " a", " time", "."]

    def decode(self, ids):
        return "".join(self.tokens[i] for i in ids).lstrip(" ")


@pytest.mark.parametrize(("margins", "stopped", "decided", "complete"), [
    ([2.0, 2.0, 2.0, 2.0], False, " Once upon a time", True),
    ([2.0, 2.0, 0.001, 2.0], False, " Once upon", False),
    ([0.001, 2.0, 2.0, 2.0], False, "", False),
    ([2.0, 2.0, 2.0, 0.001], True, " Once upon a", False),  # unsure where to stop
    ([2.0, 2.0, 2.0, 2.0], True, " Once upon a", True),
])
def test_decided_prefix_stops_at_the_first_close_call(margins, stopped, decided, complete):
    ids = [3, 4, 5, 6] if not stopped else [3, 4, 5, 1]
    text = " Once upon a time" if not stopped else " Once upon a"
    c = sampling._decided(PieceTokenizer(), "p", text, ids, np.asarray(margins), stopped=stopped,
                          threshold=0.01)
    assert (c.decided, c.complete) == (decided, complete)


def test_decision_margin_follows_the_compute_dtype():
    assert sampling.decision_margin(jnp.float32) == 0.01
    assert sampling.decision_margin(jnp.bfloat16) == 0.5


def test_samples_view_renders_text_and_carries_records():
    before = sampling.Continuation("Amy.", " a a", decided=" a", complete=False)
    after = sampling.Continuation("Amy.", " She ran.", decided=" She ran.", complete=True)
    data, metadata = reports.continuation_view(after)._repr_mimebundle_()
    assert data == {"text/plain": "Amy. She ran."}
    assert metadata[reports.SAMPLES_METADATA_KEY] == [after.record()]
    data, metadata = reports.samples_table(before, after)._repr_mimebundle_()
    assert "before training" in data["text/plain"] and " She ran." in data["text/plain"]
    assert "<table" in data["text/html"] and "pre-wrap" in data["text/html"]
    assert [r["label"] for r in metadata[reports.SAMPLES_METADATA_KEY]] == [
        "before training", "after training"]


def test_prompts_and_sampling_settings_are_checked_by_name():
    from gemmalab.errors import ConfigError

    assert sampling.checked_prompts("Once upon", max_new_tokens=8) == ["Once upon"]
    assert sampling.checked_prompts(("a", "b"), max_new_tokens=8, temperature=0.8,
                                    top_p=1) == ["a", "b"]
    assert sampling.checked_prompts(["a"], max_new_tokens=np.int64(8), temperature=np.float32(0.8),
                                    top_p=np.float64(0.9)) == ["a"]  # numbers as numpy gives them
    for values, message in [
            (dict(prompts=[]), r"prompts: \[\] is not a list of prompts"),
            (dict(prompts=["a", ""]), r"prompts: \['a', ''\] is not a list of prompts"),
            (dict(max_new_tokens=0), "max_new_tokens: 0 is not a positive whole number"),
            (dict(max_new_tokens=4.0), "max_new_tokens: 4.0 is not a positive whole number"),
            (dict(temperature=-1), "temperature: -1 is not a number >= 0"),
            (dict(top_p=5), r"top_p: 5 is outside \(0, 1\]"),
            (dict(top_p=0), r"top_p: 0 is outside \(0, 1\]")]:
        arguments = {"prompts": ["a"], "max_new_tokens": 8, **values}
        with pytest.raises(ConfigError, match="^" + message + r"\. Fix: "):
            sampling.checked_prompts(arguments.pop("prompts"), **arguments)

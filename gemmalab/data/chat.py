"""Gemma's chat template: a conversation as text, and as token ids with a loss mask.

The template is Gemma 3's (gemma's ``gm.text`` PROMPT/ANSWER, and its Hugging Face chat
template)::

    <bos><start_of_turn>user
    Write a story about ...<end_of_turn>
    <start_of_turn>model
    Once upon a time ...<end_of_turn>

Gemma 4's is the same with its own turn pieces, ``<|turn>`` and ``<turn|>`` (gemma's
``dialog`` GEMMA4 format), at the same ids (105, 106) of its vocabulary: a tokenizer's pieces
decide which (``markers_of``).

Gemma has no system role: a system text is folded into the first user turn (``system + "\\n\\n"
+ user``, as Gemma 3's own template does). Like gemma's ``Seq2SeqTask``, a training document
ends with the last model turn's ``<end_of_turn>`` (no EOS): that is where a chat sampler stops.

The loss mask marks the targets that bear loss: each model turn's content and its closing
``<end_of_turn>`` (so the model learns to stop), never the user's text or the turn headers.

Only the standard library and numpy are imported: encoding runs in tokenizer worker processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from gemmalab.errors import ConfigError

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"


@dataclasses.dataclass(frozen=True)
class TurnMarkers:
    """The pieces that open and close a turn."""

    start: str
    end: str


GEMMA3_TURNS = TurnMarkers(START_OF_TURN, END_OF_TURN)  # also gemmalab's local tokenizer's
GEMMA4_TURNS = TurnMarkers("<|turn>", "<turn|>")
USER, MODEL = "user", "model"
BOS_ID = 2  # Gemma's (gemmalab.data.tokenizer.BOS_ID; not imported: that module pulls more in)

Turn = tuple[str, str]  # (role, content)


@dataclasses.dataclass(frozen=True)
class Conversation:
    """Turns alternating user/model, starting with a user turn and ending with a model turn.

    ``facts`` (optional, from the record's ``"facts"``) are what a reply should contain: the
    task metric (gemmalab.inspect.task_metric) checks them on held-out conversations.
    """

    turns: tuple[Turn, ...]
    facts: dict[str, str] | None = None

    @property
    def prompt_turns(self) -> tuple[Turn, ...]:
        """Everything before the last model turn: what a sampler is given."""
        return self.turns[:-1]

    @property
    def response(self) -> str:
        return self.turns[-1][1]


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One prompt with a preferred (``chosen``) and a dispreferred (``rejected``) reply: two
    conversations with the same prompt turns, differing in their last model turns."""

    chosen: Conversation
    rejected: Conversation

    @property
    def prompt_turns(self) -> tuple[Turn, ...]:
        return self.chosen.prompt_turns


def turn_text(role: str, content: str, markers: TurnMarkers = GEMMA3_TURNS) -> str:
    return f"{markers.start}{role}\n{content}{markers.end}"


def format_text(conversation: Conversation, markers: TurnMarkers = GEMMA3_TURNS) -> str:
    """The conversation as one training document (BOS excluded)."""
    return "\n".join(turn_text(role, content, markers) for role, content in conversation.turns)


def prompt_text(turns: Sequence[Turn], markers: TurnMarkers = GEMMA3_TURNS) -> str:
    """Turns ending with a user turn, then the header that asks the model to answer."""
    history = "".join(turn_text(role, content, markers) + "\n" for role, content in turns)
    return f"{history}{markers.start}{MODEL}\n"


def user_prompt(text: str, markers: TurnMarkers = GEMMA3_TURNS) -> str:
    """A single-turn prompt in the chat template (what a chat-trained model is sampled from)."""
    return prompt_text([(USER, text)], markers)


# ---------------------------------------------------------------------------------------------
# Tokens and loss mask.


def markers_of(processor: Any) -> TurnMarkers:
    """The turn pieces a SentencePiece model has: Gemma 3's (and gemmalab's local ones) or
    Gemma 4's; a one-line error naming ``tokenizer`` when it has neither."""
    for markers in (GEMMA3_TURNS, GEMMA4_TURNS):
        if processor.unk_id() not in (processor.PieceToId(markers.start),
                                      processor.PieceToId(markers.end)):
            return markers
    raise ConfigError("tokenizer", f"it has no {START_OF_TURN}/{END_OF_TURN} (nor Gemma 4's "
                      f"{GEMMA4_TURNS.start}/{GEMMA4_TURNS.end}) pieces, which chat data needs",
                      "use 'local', 'gemma3', 'gemma4' or another Gemma tokenizer")


def turn_token_ids(processor: Any) -> tuple[int, int]:
    """The real ids of the turn pieces in a SentencePiece model (105/106 in Gemma 3's and
    Gemma 4's vocabularies, 10/11 in gemmalab's local one)."""
    markers = markers_of(processor)
    return processor.PieceToId(markers.start), processor.PieceToId(markers.end)


def encode(processor: Any, conversation: Conversation, *, last_reply_only: bool = False
           ) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, loss_mask)``: int32 ids of BOS + the template, and a uint8 mask of the same
    length, 1 where that token, as a target, bears loss (model content and its end of turn;
    ``last_reply_only``: only the last model turn's, as a preference pair's reply).

    Special tokens are inserted as their ids; only the text between them is encoded, each piece
    on its own, so a reply is tokenized exactly as a sampler produces it after the prompt.
    """
    start, end = turn_token_ids(processor)
    pieces: list[tuple[list[int], int]] = [([BOS_ID], 0)]
    last = len(conversation.turns) - 1
    for i, (role, content) in enumerate(conversation.turns):
        target = int(role == MODEL and (i == last or not last_reply_only))
        header, body, gap = processor.EncodeAsIds([f"{role}\n", content, "\n"])
        pieces += [([start, *header], 0), (body, target), ([end], target)]
        if i < last:
            pieces.append((gap, 0))
    ids = np.concatenate([np.asarray(p, np.int32) for p, _ in pieces])
    mask = np.concatenate([np.full(len(p), m, np.uint8) for p, m in pieces])
    return ids, mask

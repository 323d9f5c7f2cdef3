"""Drafts from what a request already knows: its predicted output (OpenAI's Predicted Outputs).

A request may carry a *prediction*, text it expects most of the answer to repeat (a file it
asks to edit, a document to revise). Its rows draft from the prediction instead of the drafter,
in the same verify pass as everyone else's drafts; the target verifies them like any
deterministic draft, so the output is the target's own (greedy: identical; sampled: exact) and a
wrong prediction costs only its rejected drafts.

Following the prediction: a cursor points at the predicted token expected next. While the
output follows the prediction the cursor moves with it and each round drafts the next tokens
after it. After a mismatch (the output inserted, deleted or changed something) the cursor is
lost, and the row re-anchors where the prediction repeats the output's last tokens (at least
:data:`MIN_ANCHOR` of them): forward of the old cursor if it can, else anywhere, and there at the
longest run (up to :data:`MAX_ANCHOR` tokens; the first of equally long ones); until it finds
one, the row drafts with the configured drafter. A predicted draft may be up to
:data:`MAX_PREDICTED` tokens long, beyond ``--spec-length``: its length is chosen per request by
an :class:`~specdraft.engine.policy.AdaptiveDraftLength` that learns the prediction's acceptance
and the cost of each pass width, so a wide pass is drafted only where its expected tokens pay
for it.
"""

from __future__ import annotations

from ..errors import ConfigError

#: The longest draft a prediction proposes in one round: with the row's last token a 32-token pass,
#: the widest that runs the decode kernels (DECODE_WIDTH; wider passes, prefill, run SDPA, whose
#: rounding is not a one-token step's: at 32 a well-predicted row's 33-token passes changed greedy
#: bfloat16 output)
MAX_PREDICTED = 31
#: Output tokens that must match the prediction to re-anchor the cursor after a mismatch.
MIN_ANCHOR = 2
#: The longest run of output tokens an anchor is looked up by.
MAX_ANCHOR = 16


class Prediction:
    """A request's predicted output ``tokens`` and where the output stands in it; usage counts.

    >>> p = Prediction([5, 6, 7, 8, 9])
    >>> p.draft([], 3), p.draft([5, 6], 3), p.draft([5, 6, 1, 7, 8], 3)
    ([5, 6, 7], [7, 8, 9], [9])
    """

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.cursor: int | None = 0  # the index of the predicted token expected next; None: lost
        self.last = 0  # the last cursor it had (re-anchoring looks forward of it first)
        self.seen = 0  # output tokens followed so far
        self._bigrams: dict[tuple[int, int], list[int]] = {}  # bigram -> end positions (exclusive) in ``tokens``
        for i in range(len(self.tokens) - 1):
            self._bigrams.setdefault((self.tokens[i], self.tokens[i + 1]), []).append(i + 2)

    def draft(self, output: list[int], n: int) -> list[int]:
        """Up to ``n`` predicted tokens after ``output`` (the request's new tokens so far)."""
        self._follow(output)
        return [] if self.cursor is None else self.tokens[self.cursor : self.cursor + n]

    def _follow(self, output: list[int]) -> None:
        for token in output[self.seen :]:
            if self.cursor is not None and self.cursor < len(self.tokens) and self.tokens[self.cursor] == token:
                self.cursor += 1
                self.last = self.cursor
            else:
                self.cursor = None
        self.seen = len(output)
        if self.cursor is None:
            self.cursor = self._anchor(output)

    def _anchor(self, output: list[int]) -> int | None:
        """Where the prediction continues the output's last tokens (see the module docstring)."""
        if len(output) < MIN_ANCHOR:
            return None
        best, best_key = None, None
        for end in self._bigrams.get((output[-2], output[-1]), ()):  # ascending: the first of equals wins
            length = 2
            while (length < min(MAX_ANCHOR, len(output), end)
                   and self.tokens[end - length - 1] == output[-length - 1]):
                length += 1
            key = (end >= self.last, length)  # forward of the old cursor first, then the longest run
            if best_key is None or key > best_key:
                best, best_key = end, key
        if best is not None:
            self.last = best
        return best


def check_prediction(prediction, field: str = "prediction") -> str | None:
    """A prediction's text (None or empty: none), or ConfigError naming ``field``. OpenAI's form
    ``{"type": "content", "content": str | [{"type": "text", "text": str}, ...]}`` is the server's
    to unpack; here it is a string."""
    if prediction is None:
        return None
    if not isinstance(prediction, str):
        raise ConfigError(f"{field} must be text (a string), got {type(prediction).__name__}")
    return prediction or None


__all__ = ["MAX_ANCHOR", "MAX_PREDICTED", "MIN_ANCHOR", "Prediction", "check_prediction"]

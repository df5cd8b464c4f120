"""Templated prompts tokenized piece by piece, each distinct piece once.

A chat-templated prompt is mostly what every row shares: the template's special tokens and the
job's system prompt (the seeds' industry prompt: 250 of its 270 tokens). Hugging Face tokenizers
split a text at its added tokens (``<|im_start|>`` ...) before anything else and encode the
pieces between them one by one, so a prompt's ids are the ids of its pieces in order. Here the
pieces are cut at those tokens, each distinct piece is encoded once (and kept, within a bound),
and a row costs the encoding of what is its own.

Trusted only where it is exact: an added token that strips the whitespace beside it, or one the
normalizer sees, is left inside its piece, and every batch compares a few of its prompts with
their whole-prompt encoding; one difference and this tokenizer is encoded whole from then on.
"""

from __future__ import annotations

import collections
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

#: distinct pieces kept (a piece is a row's own text at most once per row)
MAX_PIECES = 50_000
#: prompts of each batch checked against their whole-prompt encoding
CHECKED_PER_BATCH = 2


class PieceEncoder:
    """``encode(prompts)``: token ids without special tokens added, as ``tokenizer(prompts,
    add_special_tokens=False)`` gives them."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self.special: dict[str, int] = {}
        self.exact = True
        try:
            for token_id, token in tokenizer.added_tokens_decoder.items():
                if not (token.lstrip or token.rstrip or token.single_word or token.normalized):
                    self.special[token.content] = int(token_id)
        except AttributeError:  # not a Hugging Face tokenizer as expected: whole prompts
            self.exact = False
        tokens = sorted(self.special, key=len, reverse=True)  # the longest where two start alike
        self.split = re.compile("(" + "|".join(re.escape(t) for t in tokens) + ")") if tokens else None

    def encode(self, prompts: list[str]) -> list[list[int]]:
        if not self.exact or self.split is None:
            return self._whole(prompts)
        cut = [[p for p in self.split.split(prompt) if p] for prompt in prompts]
        new = list(dict.fromkeys(p for pieces in cut for p in pieces if p not in self.special and p not in self.ids))
        if new:
            for piece, ids in zip(new, self._whole(new)):
                self.ids[piece] = ids
        out = []
        for pieces in cut:
            ids: list[int] = []
            for piece in pieces:
                token = self.special.get(piece)
                if token is not None:
                    ids.append(token)
                else:
                    ids.extend(self.ids[piece])
                    self.ids.move_to_end(piece)
            out.append(ids)
        while len(self.ids) > MAX_PIECES:
            self.ids.popitem(last=False)
        checked = prompts[:CHECKED_PER_BATCH]
        if self._whole(checked) != out[:len(checked)]:
            logger.warning("tokenizing prompts piece by piece differs from whole prompts for this tokenizer; "
                           "encoding whole prompts from now on")
            self.exact = False
            self.ids.clear()
            return self._whole(prompts)
        return out

    def _whole(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

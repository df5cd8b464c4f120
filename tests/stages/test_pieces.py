"""Prompts tokenized piece by piece give the ids the whole prompt gives, or are not used."""

from __future__ import annotations

import random

from llmbatch.models import load_tokenizer
from llmbatch.stages.pieces import PieceEncoder


def chat_prompts(tokenizer, n: int) -> list[str]:
    rng = random.Random(0)
    words = ["Acme", "  spaced  ", "naïve café", "日本語", "tab\there", "new\nline", "<|im_start|>", "x" * 40, "",
             "Smith & Jones LLC", "🙂", "end.", " lead", "trail "]
    system = "You classify companies by industry.\n\nUser: Rosie's Pizzeria\nAssistant: food and beverage"
    out = []
    for i in range(n):
        user = " ".join(rng.choice(words) for _ in range(rng.randint(0, 5)))
        messages = ([{"role": "system", "content": system}] if i % 2 else []) + [{"role": "user", "content": user}]
        if i % 5 == 0:
            messages.append({"role": "assistant", "content": rng.choice(words)})
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=i % 5 != 0,
                                                 continue_final_message=i % 5 == 0))
    return out


def test_piece_by_piece_equals_whole_prompts_for_smollm2(smollm2):
    tokenizer = load_tokenizer("smollm2-135m-instruct", False)
    prompts = chat_prompts(tokenizer, 300)
    encoder = PieceEncoder(tokenizer)
    got = encoder.encode(prompts[:150]) + encoder.encode(prompts[150:])  # the second batch reuses pieces
    assert encoder.exact and len(encoder.ids) > 0
    assert got == [list(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]


class _Shifting:
    """A tokenizer whose whole-text ids differ from its pieces' (as a first-piece-only prefix
    space would make them): the encoder must notice and encode whole prompts."""

    class _Token:
        def __init__(self, content):
            self.content, self.lstrip, self.rstrip, self.single_word, self.normalized = content, False, False, False, False

    added_tokens_decoder = {0: _Token("<s>")}

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[len(t)] + [ord(c) for c in t] for t in texts]}


def test_a_tokenizer_whose_pieces_differ_is_encoded_whole():
    encoder = PieceEncoder(_Shifting())
    prompts = ["ab<s>cd", "ab<s>ef"]
    assert encoder.encode(prompts) == _Shifting()(prompts)["input_ids"]
    assert not encoder.exact
    assert encoder.encode(["x<s>y"]) == [[5, ord("x"), ord("<"), ord("s"), ord(">"), ord("y")]]

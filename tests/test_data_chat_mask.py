"""Which tokens of a templated chat are supervised: those whose characters overlap an assistant span
(``csbp.data.packing.supervised_tokens``), checked against the definition and for its cost."""

from __future__ import annotations

import random
import time

from csbp.data.packing import supervised_tokens


def by_definition(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    return [int(any(a < e and s < max(b, a + 1) for s, e in spans)) for a, b in offsets]


def test_supervised_tokens_match_the_definition() -> None:
    """Tokens straddling a span's edge, empty tokens (special tokens can have empty offsets), tokens
    inside, between and past the spans, and a tokenizer whose offsets repeat (one character split
    into several byte tokens)."""
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, 200), rng.randrange(0, 12)))
        spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
        offsets, position = [], 0
        while position < 200:
            width = rng.choice([0, 1, 1, 2, 3, 7])
            offsets.append((position, position + width))
            if rng.random() < 0.8:  # sometimes the next token starts where this one did
                position += max(width, 1)
        assert supervised_tokens(offsets, spans) == by_definition(offsets, spans)
    assert supervised_tokens([], [(0, 1)]) == [] and supervised_tokens([(0, 1)], []) == [0]


def test_supervised_tokens_of_a_long_chat_take_one_pass() -> None:
    """200k tokens and 20k assistant spans (a chat of that many turns): testing every span for every
    token took minutes."""
    offsets = [(4 * i, 4 * i + 4) for i in range(200_000)]
    spans = [(40 * i + 10, 40 * i + 30) for i in range(20_000)]
    started = time.process_time()
    mask = supervised_tokens(offsets, spans)
    assert time.process_time() - started < 2.0
    assert sum(mask) == 20_000 * 6 and mask[:10] == [0, 0, 1, 1, 1, 1, 1, 1, 0, 0]  # [8, 12) to [28, 32)

"""Random walks of a CPU runner's forwards, each row checked against a fresh transformers forward."""
from __future__ import annotations

import random

import torch

from flashspec_core.backends import ragged


@torch.no_grad()
def fresh(model, seq, keep):
    """The logits [keep, V] after the last `keep` tokens of seq, from transformers' own forward."""
    return model(input_ids=torch.tensor([seq])).logits[0, -keep:]


def ragged_walk(model, runner, rows: int, seed: int, steps: int = 12) -> None:
    """Random `score_rows` calls whose rows feed different amounts (a prompt from empty, a prompt
    piece after a reused prefix, a draft, one token, nothing), each in one forward (counted) and
    each row's logits checked against a fresh transformers forward of its sequence."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    runner.reset(rows)
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(2, 40))] for _ in range(rows)]
    calls = []
    real = ragged.hidden
    ragged.hidden = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for step in range(steps):
            seqs = [s[:max(1, len(s) - rng.randint(0, 3))]
                    + [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 4, 30]))]
                    for s in seqs]
            needs = [min(len(s), rng.choice([0, 1, 1, 3, 6])) for s in seqs]
            needs[step % rows] = max(needs[step % rows], 1)  # at least one row feeds
            given = [s if n or rng.random() < 0.5 else None for s, n in zip(seqs, needs)]
            before = len(calls)
            out = runner.score_rows(given, needs)
            assert len(calls) == before + 1, "every row of a step in one forward"
            for b, (s, n) in enumerate(zip(given, needs)):
                if not n or s is None:
                    assert out[b] is None
                    continue
                torch.testing.assert_close(out[b], fresh(model, s, n), atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"step {step}, row {b}: {m}")
    finally:
        ragged.hidden = real


"""Inside a step the Triton verify takes the sampled rows of one setting in one launch, each row
drawing from a seed taken from its own generator (`verify(seed=[B])`): a seeded row must sample
the same tokens alone, beside rows of its own setting (at any index of the launch) and beside
rows of others. On the CPU the kernel runs under TRITON_INTERPRET=1 (conftest.py)."""
from __future__ import annotations

import pytest
import torch
from helpers import hold_prefills_until, tiny_loaded

from flashspec_core.arms import Arm
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.fixed import FixedRouter
from flashspec_core.verify import rows, triton_usable

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 2, 8, 1, 8, 2, 8, 1, 8, 2], [6, 6, 6, 6, 1, 6, 6, 6]]


def _engine(loaded) -> SpecEngine:
    return SpecEngine(loaded, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 3)),
                      verify_backend="triton")


@pytest.mark.timeout(300)
def test_a_seeded_row_samples_alike_alone_and_at_any_index_of_a_shared_launch(monkeypatch):
    loaded = tiny_loaded(16, seed=0)
    if not triton_usable(torch.zeros(1, 2, 16)):
        pytest.skip("the tiny model runs on the CPU; the Triton verify there needs TRITON_INTERPRET=1")
    mine = SamplingParams(temperature=1.0, seed=7)
    alone = _engine(loaded)
    expected = alone.generate(PROMPTS[1], max_new_tokens=16, sampling=mine).token_ids

    crowded = _engine(loaded)
    launches: list[int] = []  # rows per launch with a seed per row
    real = rows.verify

    def counting(logits, *args, seed=None, **kwargs):
        if seed is not None:
            launches.append(logits.shape[0])
        return real(logits, *args, seed=seed, **kwargs)

    monkeypatch.setattr(rows, "verify", counting)
    # Held until all four are in: 16 tokens each end in a few milliseconds.
    hold_prefills_until(monkeypatch, crowded, lambda: crowded.running + crowded.queued == 4)
    # Same setting, other seeds, submitted first (lower slots: ahead of the row in the launch), and
    # a setting of its own beside them.
    handles = [crowded.submit([p], max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=40 + i))
               for i, p in enumerate([PROMPTS[0], PROMPTS[2]])]
    handles.append(crowded.submit([PROMPTS[0]], max_new_tokens=16, sampling=SamplingParams(temperature=0.6, seed=3)))
    got = crowded.submit([PROMPTS[1]], max_new_tokens=16, sampling=mine).wait()[0].token_ids
    others = [h.wait()[0].token_ids for h in handles]
    assert got == expected
    assert max(launches) >= 3, "the rows of one setting shared a launch"
    assert others[0] != got and all(others)
    # A request of two rows with one seed: row 0 draws as the request of one row, row 1 anew.
    batch = crowded.generate([PROMPTS[1], PROMPTS[1]], max_new_tokens=16, sampling=mine)
    assert batch[0].token_ids == expected and batch[1].token_ids != expected


def test_on_the_cpu_auto_verifies_sampled_rows_on_torch_even_where_the_interpreter_could():
    """"auto" picks the kernel on CUDA only: with the interpreter on (as here), a CPU engine's
    sampled rows still verify on torch ops, with each row's own uniforms."""
    loaded = tiny_loaded(16, seed=0)
    sampling = SamplingParams(temperature=1.0, seed=5)
    runs = []
    for backend in ("auto", "torch"):
        engine = SpecEngine(loaded, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 3)),
                            verify_backend=backend)
        runs.append([r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=12, sampling=sampling)])
    assert runs[0] == runs[1]

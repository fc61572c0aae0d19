"""Garbage in never becomes plausible output: the engine refuses it with a ValueError naming the
argument, in greedy and sampling mode alike, whatever the draft (issue 15).

Before: `temperature=1e-45` overflowed logits / T, and with no draft the engine emitted token
V-1 and finished "stop"; a model with NaN logits did the same; `seed=2**64` failed inside torch
without naming `seed`; a draft id outside the vocabulary was silently rejected in greedy mode and
crashed in `gather` when sampling (in the engine the target's embedding meets it first: an
IndexError in both modes, until the engine checks proposals).
"""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama, tiny_loaded

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts import DraftSource, ModelDraft, PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import Proposal
from flashspec_core.routing.fixed import FixedRouter

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, seed=0)]
ARMS = [Arm(NO_DRAFT, 0), Arm("prompt_lookup", 3), Arm("model", 3), Arm("out_of_vocab", 2)]


class OutOfVocabDraft(DraftSource):
    """A deterministic draft that proposes token id V (one past the vocabulary): a draft built for
    another tokenizer."""

    name = "out_of_vocab"
    deterministic = True

    def __init__(self, vocab: int):
        self.vocab = vocab

    def propose(self, contexts, gamma, sampling, generator=None) -> Proposal:
        return Proposal([[self.vocab] * gamma for _ in contexts])

    def begin(self, prompts) -> None:
        """Stateless."""

    def end(self, prompts, outputs) -> None:
        """Stateless."""


def _engine(loaded, arm: Arm) -> SpecEngine:
    pad = loaded.tokenizer.pad_token_id
    drafts = [PromptLookupDraft(), ModelDraft(tiny_llama(16, seed=1), name="model", pad_token_id=pad),
              OutOfVocabDraft(16)]
    return SpecEngine(loaded, drafts, router=FixedRouter(arm), verify_backend="torch")


@pytest.fixture(scope="module")
def nan_target():
    """The tiny target with one output row of NaN weights: every logit of token 7 is NaN."""
    loaded = tiny_loaded(16, seed=0)
    with torch.no_grad():
        loaded.model.lm_head.weight[7] = float("nan")
    return loaded


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "T1"])
@pytest.mark.parametrize("arm", ARMS[:3], ids=str)
def test_nan_logits_raise_instead_of_emitting_a_token(nan_target, arm, sampling):
    with pytest.raises(ValueError, match="target_logits hold NaN"):
        _engine(nan_target, arm).generate(PROMPT, max_new_tokens=6, sampling=sampling)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "T1"])
def test_an_out_of_vocabulary_draft_is_refused_in_greedy_and_sampling_alike(tiny_target, sampling):
    engine = _engine(tiny_target, ARMS[3])
    with pytest.raises(ValueError, match=r"outside the target's vocabulary"):
        engine.generate(PROMPT, max_new_tokens=6, sampling=sampling)
    engine.router = FixedRouter(ARMS[0])
    assert len(engine.generate(PROMPT, max_new_tokens=3, sampling=sampling).token_ids) == 3, "still usable"


@pytest.mark.parametrize("sampling, name", [
    ({"temperature": 1e-45}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 1.0, "seed": 2**64}, "seed"), ({"temperature": 1.0, "repetition_penalty": float("nan")},
                                                      "repetition_penalty"),
])
def test_absurd_sampling_settings_are_refused_by_name(tiny_target, sampling, name):
    with pytest.raises(ValueError, match=name):
        _engine(tiny_target, ARMS[0]).generate(PROMPT, max_new_tokens=4, sampling=sampling)


def test_the_largest_seed_works_and_reproduces(tiny_target):
    engine = _engine(tiny_target, ARMS[2])
    sampling = SamplingParams(temperature=1.0, seed=2**64 - 1)
    runs = [engine.generate(PROMPT, max_new_tokens=8, sampling=sampling).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) >= 1


def test_a_blank_domain_names_domain(tiny_target):
    with pytest.raises(ValueError, match="domain must not be empty or blank"):
        _engine(tiny_target, ARMS[0]).generate(PROMPT, max_new_tokens=2, domain="  ")

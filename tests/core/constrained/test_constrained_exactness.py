"""Constrained sampling is exact under speculation: the engine's output has exactly the law of
constrained autoregressive sampling (mask the target's logits by the grammar, then sample).

A tiny random target (vocab 16) decodes under a small grammar over a raw vocabulary whose tokens
overlap ("{", "k", "{k", "k:", "ab", "b}"), so the forced prefix "{k:" has several tokenizations and
the grammar-forced draft is not always right. The exact law of the first five tokens is computed by
enumeration, with the grammar checked by a hand-written prefix test (independent of xgrammar) and
the sampling warpers taken from transformers (independent of flashspec_core.processors.sampling). Drafts: the
grammar-forced draft, a tiny random model draft whose q is NOT masked (it proposes tokens the grammar
forbids) and prompt lookup, under a router switching arm at random. G-tests at α = 0.01 (a rejection
must replicate on a fresh sample); the power check removes the target's mask and requires rejection.
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch
from helpers import BACKENDS, RandomRouter, check_exact, check_rejects, count_outcomes, g_test, next_logits, on_backend
from laws import marginal, prefix_law

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.constrained import Constraint, Grammar, GrammarForcedDraft
from flashspec_core.drafts import ModelDraft, PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.fixed import FixedRouter

pytestmark = pytest.mark.usefixtures("torch_one_thread")

EOS = 15
VOCAB = ["{", "}", "k", ":", "a", "b", "ab", "{k", "k:", ",", "b}", "x", "y", "z", " ", "</s>"]
EBNF = 'root ::= "{k:" item ("," item)* "}"\nitem ::= "a" | "b" | "ab"'
# Chosen so that the constrained law is spread (entropy > 1.6 nats over up to 47 outcomes, the
# most likely one <= 0.33) for every sampling below: a law concentrated on one outcome would test
# little. It ends in a token seen before, so prompt lookup proposes ("{" then a forbidden ":").
PROMPT = [13, 11, 13, 0, 3, 0, 13]
LENGTH = 5  # tokens per row: "{k" ":" "a" "}" EOS fits, so rows finish both by EOS and by length
N_ROWS = 4_000
CALLS = 20  # calls of 200 rows, each decoded together (each row's arm drawn at random every step)
SAMPLINGS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7-topk3": SamplingParams(temperature=0.7, top_k=3),
    "T1.3-topp0.8": SamplingParams(temperature=1.3, top_p=0.8),
}


# The grammar as a hand-written automaton: state -> {character: next state}; "done" accepts.
_DFA = {
    "start": {"{": "brace"}, "brace": {"k": "key"}, "key": {":": "item"},
    "item": {"a": "after_a", "b": "after_item"},
    "after_a": {"b": "after_item", ",": "item", "}": "done"},
    "after_item": {",": "item", "}": "done"},
    "done": {},
}


def _state(text: str) -> str | None:
    state: str | None = "start"
    for ch in text:
        state = _DFA[state].get(ch) if state else None
    return state


def allowed_next(text: str) -> list[int]:
    """Tokens the grammar allows after `text` (EOS only when `text` is complete)."""
    ok = [t for t, s in enumerate(VOCAB[:EOS]) if _state(text + s) is not None]
    return ok + [EOS] if _state(text) == "done" else ok


def decode(tokens) -> str:
    return "".join(VOCAB[t] for t in tokens if t != EOS)


@pytest.fixture(scope="module")
def grammar() -> Grammar:
    return Grammar.from_ebnf(EBNF, VOCAB, stop_ids=[EOS])


def constrained_law(model, sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact law of the first LENGTH tokens of constrained sampling (cut after EOS)."""
    return prefix_law(model, PROMPT, sampling, frozenset({EOS}), LENGTH, allowed=lambda out: allowed_next(decode(out)))


def _engine(tiny_target, tiny_draft_model, router_seed: int, backend: str = "torch") -> SpecEngine:
    pad = tiny_target.tokenizer.pad_token_id
    drafts = [GrammarForcedDraft(), ModelDraft(on_backend(tiny_draft_model, backend), name="model", pad_token_id=pad),
              PromptLookupDraft()]
    arms = [Arm(NO_DRAFT, 0)] + [Arm(d.name, g) for d in drafts for g in (1, 3, 8)]
    return SpecEngine(on_backend(tiny_target, backend), drafts, router=RandomRouter(arms, router_seed),
                      verify_backend=backend, max_batch=N_ROWS // CALLS)


def _pvalues(tiny_target, tiny_draft_model, grammar, sampling_name: str, replicate: int,
             backend: str = "torch") -> tuple[float, float]:
    seed = zlib.crc32(f"{sampling_name}/{replicate}".encode())
    engine = _engine(tiny_target, tiny_draft_model, seed, backend)
    outputs, records = [], []
    for call in range(CALLS):
        sampling = SAMPLINGS[sampling_name].model_copy(update={"seed": seed + call})
        results = engine.generate([PROMPT] * (N_ROWS // CALLS), max_new_tokens=LENGTH, sampling=sampling,
                                  json_schema=grammar)
        outputs += [r.token_ids for r in results]
        records += results[0].stats.records
    law = constrained_law(tiny_target.model, SAMPLINGS[sampling_name])
    drafted = {r.arm.draft for r in records if r.drafted > 0}
    assert drafted == {"grammar", "model", "prompt_lookup"}, f"every draft should have proposed; got {drafted}"
    return (g_test(count_outcomes(outputs, 2, engine.eos_ids), marginal(law, 2)),
            g_test(count_outcomes(outputs, LENGTH, engine.eos_ids), law))


def test_reference_grammar_agrees_with_xgrammar(grammar):
    """The hand-written prefix test and the compiled grammar allow the same tokens on random paths."""
    constraint = Constraint(grammar, [PROMPT])
    rng = random.Random(0)
    for _ in range(30):
        out: list[int] = []
        with constraint.cursor(PROMPT) as cursor:
            while not cursor.terminated and len(out) < 12:
                allowed = allowed_next(decode(out))
                assert cursor.allowed().nonzero().flatten().tolist() == allowed, decode(out)
                tok = rng.choice(allowed)
                assert cursor.accept(tok)
                out.append(tok)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_constrained_speculative_sampling_matches_constrained_autoregressive(
    tiny_target, tiny_draft_model, grammar, sampling_name, backend
):
    check_exact(lambda rep: _pvalues(tiny_target, tiny_draft_model, grammar, sampling_name, rep, backend),
                f"constrained {sampling_name} {backend}")


def test_the_g_test_rejects_when_the_target_is_not_masked(tiny_target, tiny_draft_model, grammar, monkeypatch):
    """Without the mask on the target, the same test must fail (the commit check is relaxed too)."""

    def lenient_commit(self, row, tokens):
        for tok in tokens:
            if not self._matchers[row].is_terminated():
                self._matchers[row].accept_token(int(tok))
            self._outputs[row].append(int(tok))

    monkeypatch.setattr(Constraint, "mask_logits", lambda self, logits, draft, active: logits)
    monkeypatch.setattr(Constraint, "commit", lenient_commit)
    check_rejects(lambda rep: _pvalues(tiny_target, tiny_draft_model, grammar, "T1", rep), "unmasked target")


@torch.no_grad()
def _constrained_greedy(model, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n and (not out or out[-1] != EOS):
        logits = next_logits(model, [prompt + out])[0]
        allowed = allowed_next(decode(out))
        out.append(allowed[int(logits[allowed].argmax())])
    return out


@pytest.mark.parametrize("arm", [Arm(NO_DRAFT, 0), Arm("grammar", 4), Arm("model", 3), Arm("prompt_lookup", 8), None],
                         ids=["none", "grammar@4", "model@3", "prompt_lookup@8", "random"])
def test_greedy_equals_constrained_greedy_decoding(tiny_target, tiny_draft_model, grammar, arm):
    engine = _engine(tiny_target, tiny_draft_model, router_seed=3)
    if arm is not None:
        engine.router = FixedRouter(arm)
    prompts = [PROMPT, [0, 2, 3, 6, 9], [5, 5, 10, 7], [12, 13, 14, 11]]
    results = engine.generate(prompts, max_new_tokens=24, json_schema=grammar)
    for prompt, result in zip(prompts, results):
        expected = _constrained_greedy(tiny_target.model, prompt, 24)
        assert result.token_ids == expected, (prompt, decode(result.token_ids), decode(expected))
        if result.finish_reason == "stop":
            assert _state(decode(result.token_ids)) == "done"


@torch.no_grad()
def _constrained_greedy_without_repeats(model, prompt: list[int], n: int, size: int) -> list[int]:
    """Constrained greedy decoding with the n-gram ban over the output, written out by hand: the
    tokens that would complete an n-gram the output holds are dropped from what the grammar allows,
    unless that leaves nothing (the ban yields to the grammar, ngram_ban.py)."""
    out: list[int] = []
    while len(out) < n and (not out or out[-1] != EOS):
        logits = next_logits(model, [prompt + out])[0]
        allowed = allowed_next(decode(out))
        tail = out[len(out) - size + 1:] if size > 1 else []
        repeats = {out[i + size - 1] for i in range(len(out) - size + 1) if out[i:i + size - 1] == tail}
        allowed = [t for t in allowed if t not in repeats] or allowed
        out.append(allowed[int(logits[allowed].argmax())])
    return out


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("arm", [Arm(NO_DRAFT, 0), Arm("grammar", 4), Arm("model", 3)], ids=str)
def test_greedy_with_the_ban_under_a_grammar_equals_it_written_out(tiny_target, tiny_draft_model, grammar, arm, size):
    """The engine's ban under a grammar, in a batch of rows (the tiny tokenizer's words hold no JSON
    punctuation, so nothing is exempt; the yield rule is held to HF's in test_ngram_ban.py)."""
    engine = _engine(tiny_target, tiny_draft_model, router_seed=3)
    engine.router = FixedRouter(arm)
    prompts = [PROMPT, [0, 2, 3, 6, 9], [5, 5, 10, 7], [12, 13, 14, 11]]
    results = engine.generate(prompts, max_new_tokens=24, json_schema=grammar,
                              sampling=SamplingParams(no_repeat_ngram_size=size))
    changed = 0
    for prompt, result in zip(prompts, results):
        expected = _constrained_greedy_without_repeats(tiny_target.model, prompt, 24, size)
        assert result.token_ids == expected, (prompt, decode(result.token_ids), decode(expected))
        changed += expected != _constrained_greedy(tiny_target.model, prompt, 24)
    assert changed, "the ban should change some row's output"

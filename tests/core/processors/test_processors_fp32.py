"""Every logits processor computes in float32 whatever the model's dtype, as HF `generate` does
(it casts the logits to float32 before any processor).

The case from issue 15: bf16 logits [24.0, 24.125], both tokens already seen, repetition penalty
1.3. In bf16 both become 18.5 (a tie, greedy takes token 0); in float32 they are 18.46 and 18.56
and HF picks token 1. bf16 is the CUDA default dtype, so this is what a GPU user would hit.
"""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from flashspec_core.constrained import Constraint, Grammar
from flashspec_core.processors.ngram_ban import OutputTokens, ban_repeated_ngrams
from flashspec_core.processors.penalty import SeenTokens, penalize_paths
from flashspec_core.processors.sampling import SamplingParams, probs_from_logits
from flashspec_core.verify import verify

TIE = torch.tensor([[[24.0, 24.125]]], dtype=torch.bfloat16)  # [B=1, P=1, V=2]


def test_the_penalty_on_bf16_logits_breaks_no_tie_that_hf_does_not():
    assert torch.where(TIE < 0, TIE * 1.3, TIE / 1.3).unique().numel() == 1, "bf16 arithmetic ties them"
    got = penalize_paths(TIE, SeenTokens([[0, 1]], 2), torch.zeros(1, 0, dtype=torch.long), 1.3)
    assert got.dtype == torch.float32
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[0, 1]]), TIE[0].float())  # HF: fp32 first
    torch.testing.assert_close(got[0], hf, rtol=0, atol=0)
    n_acc, tokens = verify(got, torch.empty(1, 0, dtype=torch.long), None, SamplingParams(), backend="torch")
    assert tokens.tolist() == [[1]], "greedy must pick HF's token 1, not the bf16 tie's token 0"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_processor_returns_float32_and_equals_its_float32_run(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 6, generator=gen) * 20).to(dtype)  # [B, P, V]
    contexts, drafts = [[1, 2, 1], [4]], torch.tensor([[2, 1], [4, 5]])
    runs = [
        lambda x: penalize_paths(x, SeenTokens(contexts, 6), drafts, 1.7),
        lambda x: ban_repeated_ngrams(x, OutputTokens([c[1:] for c in contexts]), drafts, 1),
    ]
    for run in runs:
        got = run(logits)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, run(logits.float()), rtol=0, atol=0)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, top_k=3, top_p=0.9)):
        torch.testing.assert_close(probs_from_logits(logits, sampling), probs_from_logits(logits.float(), sampling),
                                   rtol=0, atol=0)


def test_the_grammar_mask_returns_float32():
    pytest.importorskip("xgrammar")
    vocab = ["a", "b", "</s>"]
    grammar = Grammar.from_ebnf('root ::= "a" "b"', vocab, stop_ids=[2])
    masked = Constraint(grammar, [[0]]).mask_logits(torch.zeros(1, 2, 3, dtype=torch.bfloat16), [[0]], [True])
    assert masked.dtype == torch.float32
    assert torch.isinf(masked).tolist() == [[[False, True, True], [True, False, True]]]

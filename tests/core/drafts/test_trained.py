"""The trained-draft source: honest q over the full vocabulary, exact engine output, shipped weights.

A trained draft scores only a token subset (its head). Its q must be exactly what it sampled from,
expressed over the target's whole vocabulary with zeros outside the subset; the engine's output
must then still follow the target's law, including tokens the draft can never propose.
"""
from __future__ import annotations

import zlib

import pytest
import torch
from helpers import ENGINE_ROWS, break_residual, check_exact, check_rejects, count_outcomes, g_test, tiny_loaded
from laws import marginal, prefix_law
from safetensors.torch import save_file

from flashspec_core.arms import Arm
from flashspec_core.distill.model import DraftNetwork, IncompatibleDraft, save_draft
from flashspec_core.drafts import DraftSource
from flashspec_core.drafts.trained import TrainedDraft, shipped_drafts
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams, probs_from_logits
from flashspec_core.routing.fixed import FixedRouter

pytestmark = pytest.mark.usefixtures("torch_one_thread")

HEAD = [0, 2, 3, 5, 7, 8, 11, 15]  # tiny vocab 16, eos 15: half the tokens are outside the head
PROMPT = [5, 7, 7, 8, 9, 10, 11, 12, 13, 5]
N_ENGINE = 4_000
SAMPLINGS = {"T1": SamplingParams(temperature=1.0),
             "T1.5-topk3-topp0.9": SamplingParams(temperature=1.5, top_k=3, top_p=0.9)}


def make_draft(target, head=HEAD, prompt_vocab=False, name="distill_tiny") -> TrainedDraft:
    network = DraftNetwork(target.model, 1, head, init_layers=[0])
    return TrainedDraft(network, name, target.tokenizer.pad_token_id, prompt_vocab=prompt_vocab)


@pytest.mark.parametrize("sampling", [SamplingParams(), *SAMPLINGS.values()], ids=["greedy", *SAMPLINGS])
def test_q_is_the_shared_sampling_function_on_the_head_and_zero_elsewhere(tiny_target, sampling):
    draft = make_draft(tiny_target)
    assert isinstance(draft, DraftSource)
    draft.begin([PROMPT, PROMPT[:4]])
    gen = torch.Generator().manual_seed(0)
    proposal = draft.propose([PROMPT, PROMPT[:4]], 3, sampling, gen)
    q = proposal.probs  # [B, γ, V]
    assert q.shape == (2, 3, 16)
    outside = [t for t in range(16) if t not in HEAD]
    assert torch.all(q[..., outside] == 0)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    # Reference for row 0, step 0: the network's logits over the whole vocabulary, -inf off the head,
    # through the shared sampling function.
    with torch.no_grad():
        hidden = draft.network.lm.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0, -1]
    full = torch.full((16,), float("-inf"))
    full[HEAD] = hidden @ tiny_target.model.lm_head.weight[HEAD].T
    torch.testing.assert_close(q[0, 0], probs_from_logits(full, sampling), atol=1e-5, rtol=1e-4)
    for b, row in enumerate(proposal.tokens):
        assert all(t in HEAD and q[b, i, t] > 0 for i, t in enumerate(row))


def test_the_first_proposal_of_a_request_widens_the_head_with_its_prompts_tokens(tiny_target):
    """begin only notes the prompts' tokens: a request whose router never runs the draft pays
    nothing for its head; the request's first proposal sets it."""
    draft = make_draft(tiny_target, prompt_vocab=True)
    draft.begin([[1, 4], [9]])
    assert draft.network.head_ids.tolist() == HEAD
    draft.propose([[1, 4], [9]], 2, SamplingParams())
    assert draft.network.head_ids.tolist() == sorted(set(HEAD) | {1, 4, 9})
    draft.begin([[0]])
    draft.propose([[0]], 1, SamplingParams())
    assert draft.network.head_ids.tolist() == HEAD


def _engine_pvalues(target, sampling_name: str, replicate: int) -> tuple[float, float]:
    draft = make_draft(target)
    engine = SpecEngine(target, [draft], router=FixedRouter(Arm(draft.name, 3)), verify_backend="torch",
                        max_batch=ENGINE_ROWS)
    seed = zlib.crc32(f"distill/{sampling_name}/{replicate}".encode())
    sampling = SAMPLINGS[sampling_name].model_copy(update={"seed": seed})
    results = engine.generate([PROMPT] * N_ENGINE, max_new_tokens=4, sampling=sampling, stop=" t")
    outputs = [r.token_ids for r in results]
    law = prefix_law(target.model, PROMPT, SAMPLINGS[sampling_name], engine.eos_ids, 2)
    assert any(key[0] not in HEAD and prob > 0.01 for key, prob in law.items()), "the head must miss likely tokens"
    return (g_test(count_outcomes(outputs, 1, engine.eos_ids), marginal(law, 1)),
            g_test(count_outcomes(outputs, 2, engine.eos_ids), law))


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_engine_with_a_subset_draft_follows_the_target(tiny_target, sampling_name):
    check_exact(lambda rep: _engine_pvalues(tiny_target, sampling_name, rep), f"trained draft {sampling_name}")


def test_engine_tests_reject_a_broken_residual_with_a_subset_draft(tiny_target, monkeypatch):
    broken = break_residual(monkeypatch)
    check_rejects(lambda rep: _engine_pvalues(tiny_target, "T1", rep), "trained draft T1")
    assert broken.calls > 0


def test_greedy_engine_output_equals_the_targets(tiny_target):
    draft = make_draft(tiny_target, prompt_vocab=True)
    engine = SpecEngine(tiny_target, [draft], router=FixedRouter(Arm(draft.name, 4)), verify_backend="torch")
    res = engine.generate([PROMPT, PROMPT[:3]], max_new_tokens=12)
    for prompt, r in zip([PROMPT, PROMPT[:3]], res):
        x = torch.tensor([prompt])
        ref = tiny_target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                                         pad_token_id=15)[0, len(prompt):].tolist()
        assert r.token_ids == ref[: len(r.token_ids)] and len(r.token_ids) > 0


def test_weights_load_only_for_their_target(tiny_target, tmp_path):
    draft = make_draft(tiny_target)
    path = save_draft(draft.network, tiny_target.model, tmp_path / "distill_tiny.safetensors", {"name": "distill_tiny"})
    loaded = TrainedDraft.from_file(path, tiny_target.model, 15)
    assert loaded.name == "distill_tiny" and loaded.network.vocab_ids.tolist() == HEAD
    for key, value in draft.network.trainable_state().items():
        torch.testing.assert_close(loaded.network.trainable_state()[key], value.to(torch.bfloat16).float())
    other = tiny_loaded(16, seed=3)  # same shape, other embeddings
    with pytest.raises(IncompatibleDraft, match="embeddings differ"):
        TrainedDraft.from_file(path, other.model)
    assert [d.name for d in shipped_drafts(tiny_target, tmp_path)] == ["distill_tiny"]
    assert shipped_drafts(other, tmp_path) == []
    save_file({"x": torch.zeros(1)}, str(tmp_path / "junk.safetensors"))
    with pytest.raises(ValueError, match="not a flashspec distilled draft"):
        shipped_drafts(tiny_target, tmp_path)
    with pytest.raises(ValueError, match="do not exist"):
        TrainedDraft.from_file(tmp_path / "missing.safetensors", tiny_target.model)


def test_shipped_weights_are_small_and_have_cards():
    from flashspec_core.drafts.trained import WEIGHTS_DIR

    files = sorted(WEIGHTS_DIR.glob("*.safetensors"))
    assert {f.stem for f in files} >= {"distill_chat", "distill_code"}
    for f in files:
        assert f.stat().st_size <= 15_000_000
        card = f.with_suffix(".md").read_text()
        assert "## Acceptance on held-back dev prompts" in card and "## Training" in card


@pytest.mark.slow
def test_default_engine_loads_the_shipped_drafts_and_stays_exact(default_target, default_engine):
    assert {"distill_chat", "distill_code"} <= set(default_engine.drafts)
    drafts = {d.name: d for d in shipped_drafts(default_target)}
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    engine = SpecEngine(default_target, [drafts["distill_code"]], router=FixedRouter(Arm("distill_code", 3)),
                       backend="hf")  # compared with transformers: its own forward
    res = engine.generate(messages, max_new_tokens=16)
    ids = engine.encode([messages], 16)[0]
    x = torch.tensor([ids])
    ref = default_target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                                        pad_token_id=default_target.tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert res.token_ids == ref
    assert res.stats.accepted > 0

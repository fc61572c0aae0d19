"""`flashspec-agents distill` on a tiny in-memory target: data files, training, resume, offline acceptance, CLI.

Everything runs on CPU in a few seconds: a 3-layer random Llama (vocab 64) stands in for the target,
and prompts are random token ids, so no dataset or model hub is touched.
"""
from __future__ import annotations

import random

import pytest
import torch
from helpers import tiny_loaded

from flashspec_core.arms import Arm
from flashspec_core.distill import train as train_module
from flashspec_core.distill.card import update_card_section
from flashspec_core.distill.command import run_distill
from flashspec_core.distill.data import TokenSet, encode_within, frequent_tokens
from flashspec_core.distill.evaluate import evaluate_draft, simulate_steps
from flashspec_core.distill.generate import continue_prompts
from flashspec_core.distill.model import DraftNetwork, load_draft
from flashspec_core.distill.options import DistillOptions
from flashspec_core.distill.train import TrainConfig, train_draft
from flashspec_core.drafts.trained import TrainedDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.routing.fixed import FixedRouter
from flashspec_integrations.cli import main

VOCAB = 64
EOS = VOCAB - 1


@pytest.fixture(autouse=True)
def _one_thread(torch_one_thread):
    """Tiny models: per-op overhead dominates, and two loaded cores are shared."""


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(VOCAB, seed=0, layers=3, hidden=32)


def random_prompts(n: int = 48, seed: int = 0) -> TokenSet:
    rng = random.Random(seed)
    out = TokenSet()
    for i in range(n):
        seq = [rng.randrange(0, EOS) for _ in range(rng.randint(3, 10))]
        out.append(seq, "code" if i % 3 == 0 else "chat", "dev" if i % 5 == 0 else "train")
    return out


@pytest.fixture(scope="module")
def continuations(target):
    """Greedy target continuations (20 tokens at most) of the random prompts."""
    return continue_prompts(target.model, random_prompts(), 20, [EOS], EOS, batch_size=16, sample_fraction=0.0,
                            progress=False)


def test_token_set_round_trips_and_selects(tmp_path):
    data = TokenSet()
    data.append([1, 2, 3, 4], "code", "train", 2)
    data.append([5], "chat", "dev")
    path = data.save(tmp_path / "set.npz")
    back = TokenSet.load(path)
    assert back.seqs == [[1, 2, 3, 4], [5]] and back.prompt_lens == [2, 1]
    assert back.select("code").seqs == [[1, 2, 3, 4]]
    assert back.select(split="dev").domains == ["chat"]
    assert back.select("all").seqs == back.seqs
    assert list(back.continuation_tokens()) == [3, 4]
    with pytest.raises(ValueError, match="export-prompts"):
        TokenSet.load(tmp_path / "missing.npz")


def test_frequent_tokens_keeps_the_most_common_and_the_forced_ids():
    assert frequent_tokens([5, 5, 5, 7, 7, 9], 2, always=[63]) == [5, 7, 63]
    with pytest.raises(ValueError, match="positive"):
        frequent_tokens([1], 0)


def test_encode_within_drops_earlier_exchanges_until_the_prompt_fits(target):
    tok = target.tokenizer
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    messages = [{"role": "user", "content": "t1 t2 t3 t4"}, {"role": "assistant", "content": "t5 t6 t7"},
                {"role": "user", "content": "t8 t9"}]
    assert encode_within(tok, messages, VOCAB, 20) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert encode_within(tok, messages, VOCAB, 3) == [8, 9]
    assert encode_within(tok, messages, VOCAB, 1) is None


def test_continuations_are_the_targets_greedy_output_cut_at_eos(target, continuations):
    row = continuations.seqs[0]
    p = continuations.prompt_lens[0]
    ids = torch.tensor([row[:p]])
    ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                pad_token_id=EOS, eos_token_id=EOS)[0, p:].tolist()
    if EOS in ref:
        ref = ref[: ref.index(EOS) + 1]
    assert row[p:] == ref
    assert len(continuations) == 48 and sorted(continuations.domains) == sorted(random_prompts().domains)


def test_draft_network_shares_the_targets_embeddings_and_stores_only_layers(target):
    net = DraftNetwork(target.model, 2, [3, 1, 2, 3], init_layers=[0, 2])
    assert net.vocab_ids.tolist() == [1, 2, 3]
    assert net.lm.model.embed_tokens.weight.data_ptr() == target.model.get_input_embeddings().weight.data_ptr()
    assert torch.equal(net.lm.lm_head.weight, target.model.lm_head.weight[[1, 2, 3]])
    assert all(k.startswith(("model.layers.", "model.norm.")) for k in net.trainable_state())
    assert torch.equal(net.lm.model.layers[1].mlp.up_proj.weight, target.model.model.layers[2].mlp.up_proj.weight)
    assert net.head_with([9, 2]).tolist() == [1, 2, 3, 9]
    with pytest.raises(ValueError, match="vocab_ids"):
        DraftNetwork(target.model, 1, [VOCAB])
    with pytest.raises(ValueError, match="init_layers"):
        DraftNetwork(target.model, 2, [1], init_layers=[0])


def test_training_lowers_the_kl_to_the_target(target, continuations):
    torch.manual_seed(0)
    train = continuations.select(split="train")
    net = DraftNetwork(target.model, 1, list(range(VOCAB)), dtype=torch.float32)
    before = evaluate_draft(net, target.model, train, EOS)["all"]
    result = train_draft(net, target.model, train, TrainConfig(steps=24, batch_size=8, lr=5e-3, warmup=2, log_every=8),
                         EOS, progress=False)
    after = evaluate_draft(net, target.model, train, EOS)["all"]
    assert result.steps == 24 and result.history[-1]["kl"] < result.history[0]["kl"]
    assert after["alpha_t1"] > before["alpha_t1"]


def test_resume_continues_exactly_where_the_interrupted_run_stopped(target, continuations, tmp_path, monkeypatch):
    train = continuations.select(split="train")
    cfg = TrainConfig(steps=6, batch_size=8, lr=1e-3, warmup=2, checkpoint_every=3, log_every=3)

    def fresh() -> DraftNetwork:
        return DraftNetwork(target.model, 1, list(range(0, VOCAB, 2)), init_layers=[1], dtype=torch.float32)

    straight = fresh()
    train_draft(straight, target.model, train, cfg, EOS, progress=False)

    real_loss, calls = train_module.distill_loss, []

    def crash_on_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train_module, "distill_loss", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        train_draft(fresh(), target.model, train, cfg, EOS, checkpoint=tmp_path / "c.pt", progress=False)
    monkeypatch.setattr(train_module, "distill_loss", real_loss)
    resumed = fresh()
    result = train_draft(resumed, target.model, train, cfg, EOS, checkpoint=tmp_path / "c.pt", resume=True,
                         progress=False)
    assert result.steps == 6 and [h["step"] for h in result.history] == [3, 6]
    for key, value in straight.trainable_state().items():
        torch.testing.assert_close(resumed.trainable_state()[key], value)


def test_simulated_greedy_steps_count_runs_capped_at_gamma():
    # positions: match, match, miss | match, match, match, (match) ...
    matches = [True, True, False, True, True, True, True, False]
    # γ=2: step at 0 accepts 2 (then target token at 2); step at 3 accepts 2; step at 6 drafts 1 (n-t-1), accepts 1.
    assert simulate_steps(matches, 2) == (3, 5, 5)
    assert simulate_steps(matches, 8) == (2, 7 + 4, 2 + 4)
    assert simulate_steps([], 4) == (0, 0, 0)


def test_offline_acceptance_equals_the_engines_greedy_acceptance(target, continuations):
    """The teacher-forced replay predicts exactly what the engine's greedy speculation accepts."""
    train = continuations.select(split="train")
    net = DraftNetwork(target.model, 1, frequent_tokens(train.continuation_tokens(), 24, [EOS]), dtype=torch.float32)
    train_draft(net, target.model, train, TrainConfig(steps=10, batch_size=8, lr=3e-3, warmup=1), EOS, progress=False)
    dev = continuations.select(split="dev").take(5)
    draft = TrainedDraft(net, "distill_test", EOS)
    engine = SpecEngine(target, [draft], router=FixedRouter(Arm("distill_test", 4)), verify_backend="torch")
    drafted = accepted = steps = 0
    for seq, p in zip(dev.seqs, dev.prompt_lens):
        res = engine.generate(seq[:p], max_new_tokens=len(seq) - p)
        assert res.token_ids == seq[p:]
        drafted, accepted, steps = drafted + res.stats.drafted, accepted + res.stats.accepted, steps + res.stats.steps
    offline = evaluate_draft(net, target.model, dev, EOS)["all"]
    assert accepted > 0
    assert offline["accept_len@4"] == pytest.approx(accepted / steps, abs=1e-4)
    assert offline["alpha@4"] == pytest.approx(accepted / drafted, abs=1e-4)


def test_run_distill_writes_weights_card_and_data_cache(target, tmp_path):
    random_prompts().save(tmp_path / "prompts.npz")
    opts = DistillOptions(smoke=True, prompts=str(tmp_path / "prompts.npz"), out=str(tmp_path / "out"),
                          data=str(tmp_path / "data.npz"), device="cpu", progress=False)
    summary = run_distill(opts, loaded=target)
    assert summary["steps"] == 3 and (tmp_path / "data.npz").is_file()
    assert set(summary["evaluation"]) == {"chat", "code", "all"}
    card = (tmp_path / "out" / "distill_general.md").read_text()
    assert "## Acceptance on held-back dev prompts" in card and "| chat |" in card
    net, meta = load_draft(summary["weights"], target.model)
    assert meta["name"] == "distill_general" and net.num_layers == 1
    # A specialist starts from the generalist's layers and reuses the cached continuations.
    spec = DistillOptions(name="distill_code", domain="code", smoke=True, data=str(tmp_path / "data.npz"),
                          out=str(tmp_path / "out"), init_from=summary["weights"], device="cpu", progress=False)
    assert run_distill(spec, loaded=target)["steps"] == 3
    update_card_section(tmp_path / "out" / "distill_code.md", "Measured in the engine", "| a | b |")
    update_card_section(tmp_path / "out" / "distill_code.md", "Measured in the engine", "| c | d |")
    text = (tmp_path / "out" / "distill_code.md").read_text()
    assert text.count("## Measured in the engine") == 1 and "| c | d |" in text and "| a | b |" not in text


def test_distill_options_reject_bad_values():
    with pytest.raises(ValueError, match="name"):
        DistillOptions(name="Bad Name")
    with pytest.raises(ValueError, match="domain"):
        DistillOptions(domain="poetry")


def test_cli_distill_smoke_on_a_saved_tiny_target(target, tmp_path, capsys):
    folder = tmp_path / "tiny"
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    random_prompts().save(tmp_path / "prompts.npz")
    rc = main(["distill", "--target", str(folder), "--prompts", str(tmp_path / "prompts.npz"), "--smoke",
               "--out", str(tmp_path / "out"), "--device", "cpu", "--no-progress", "--name", "distill_cli"])
    assert rc == 0
    assert (tmp_path / "out" / "distill_cli.safetensors").is_file()
    assert '"steps": 3' in capsys.readouterr().out
    assert main(["distill", "--name", "BAD", "--smoke"]) == 2

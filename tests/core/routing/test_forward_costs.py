"""The router's price of a verify pass by width and context: calibrated line x measured ratio."""
from __future__ import annotations

import pytest
from helpers import CopyDraft

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.records import StepRecord
from flashspec_core.routing import BanditRouter
from flashspec_core.routing.bandits import ThompsonSampling
from flashspec_core.routing.domain_state import ArmTally, DomainState
from flashspec_core.routing.forward_costs import ForwardCosts

SECONDS = {1: 0.010, 3: 0.012, 5: 0.016}
SLOPES = {1: 5e-6, 3: 12e-6, 5: 14e-6}


def costs():
    c = ForwardCosts()
    c.set(SECONDS, SLOPES, context=256)
    return c


def test_a_pass_costs_the_line_through_the_calibrated_contexts():
    c = costs()
    assert c(3) == c(3, 256) == c.at_width(3) == 0.012
    assert c(3, 1300) == pytest.approx(0.012 + 12e-6 * 1044)
    assert c(2, 256) == pytest.approx(0.011)  # between calibrated widths: on the line between them
    assert c(9, 256) == 0.016 and c(1, 0) == 0.010  # flat past the widest; context unknown: the calibration's
    assert c(1, 1) >= 0.25 * 0.010  # never priced at nothing however short the context
    assert not ForwardCosts() and ForwardCosts()(1, 100) is None


@pytest.mark.parametrize("bad, name", [(dict(seconds={0: 0.01}), "seconds"),
                                       (dict(seconds={1: 0.01}, slopes={3: 1e-6}), "slopes"),
                                       (dict(seconds={1: 0.01}, slopes={1: -1.0}), "slopes"),
                                       (dict(seconds={1: 0.01}, context=-1), "context")])
def test_bad_costs_name_the_argument(bad, name):
    with pytest.raises(ValueError, match=name):
        ForwardCosts().set(**bad)


def state(c):
    return DomainState(ThompsonSampling(2), [ArmTally(), ArmTally()], costs=c)


def test_measured_passes_scale_the_line_and_unmeasured_sizes_take_their_ratio():
    s = state(costs())
    for _ in range(5):  # one-token passes at 1300 cached tokens, measured 20% over the line
        s.add_pass(1, 1.2 * (0.010 + 5e-6 * 1044), context=1300)
    assert s.verify_seconds(1, 1300) == pytest.approx(1.2 * (0.010 + 5e-6 * 1044))
    assert s.verify_seconds(1, 256) == pytest.approx(1.2 * 0.010)  # the same ratio at another context
    # A 3-token pass never ran here: the line at its own context, times the measured ratio.
    assert s.verify_seconds(3, 1300) == pytest.approx(1.2 * (0.012 + 12e-6 * 1044))


def test_without_a_calibration_the_medians_of_raw_seconds_price_each_size():
    s = state(ForwardCosts())
    assert s.verify_seconds(1) is None
    s.add_pass(5, 0.02, context=900)
    assert s.verify_seconds(5, 100) == 0.02 and s.verify_seconds(3) is None
    assert s.verify_estimate(3, 100) == 0.02  # the nearest size measured


@pytest.mark.parametrize("slopes, expected", [(SLOPES, 0.012 + 12e-6 * 1044), ({}, 0.012)])
def test_a_copy_draft_is_priced_at_its_own_context(slopes, expected):
    """At 1300 cached tokens a 3-token pass costs 24.5 ms on the line, 12 ms at the calibration's
    context: priced without the slope, a copy draft never run at long contexts looked twice as
    fast as it was (the planted bug is the second case: the reward doubles)."""
    script = list(range(3000))
    router = BanditRouter([Arm("ngram", 2)], free_drafts={"ngram": CopyDraft(script)})
    router.set_forward_costs(SECONDS, slopes, context=256)
    seq = script[:1300]
    for ctx in range(1300, 1303):  # plain steps, each priced on the line (ratio 1)
        seq.append(script[ctx])
        plain = SECONDS[1] + slopes.get(1, 0.0) * (ctx - 256)
        router.update(StepRecord(domain="rag", arm=Arm(NO_DRAFT, 0), drafted=0, accepted=0, emitted=1,
                                 draft_seconds=0.0, verify_seconds=plain, context_len=ctx, sequence=seq))
    s = router.summary()["rag"]
    assert s["ngram@2"]["scored"] == 1  # its one step from 1300 over the 3 tokens
    scale = 3 / SECONDS[1]  # reward 1: γ + 1 tokens per calibrated one-token pass (context unknown)
    assert s["ngram@2"]["mean_reward"] == pytest.approx(3 / expected / scale, rel=0.02)

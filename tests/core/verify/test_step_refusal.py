"""Inside a step the Triton verify skips its own host check of the logits (one sync less per
group of rows); the step's one read of the result must then refuse a row with NaN logits, as the
torch backend does (tests/core/test_engine_guards.py). On the CPU the kernel runs under
TRITON_INTERPRET=1 (conftest.py)."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_loaded

from flashspec_core.arms import Arm
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.fixed import FixedRouter
from flashspec_core.verify import triton as triton_verify

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.timeout(60)  # a row left unrefused would decode nothing, forever
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=0)],
                         ids=["greedy", "T1"])
def test_nan_logits_are_refused_when_the_step_reads_the_triton_verify(sampling):
    loaded = tiny_loaded(16, seed=0)
    if not triton_verify.supports(torch.zeros(1, 2, 16)):
        pytest.skip("the tiny model runs on the CPU; the Triton verify there needs TRITON_INTERPRET=1")
    with torch.no_grad():
        loaded.model.lm_head.weight[7] = float("nan")  # every logit of token 7 is NaN
    engine = SpecEngine(loaded, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 3)),
                        verify_backend="triton")
    with pytest.raises(ValueError, match="target_logits hold NaN"):
        engine.generate([3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=6, sampling=sampling)

"""Without a GPU, run the fused Triton ops (fused_ops.py) under Triton's CPU interpreter.

The same set-up as tests/core/verify/conftest.py, for the same reason: `triton.jit` picks the
interpreter when it decorates a function, so TRITON_INTERPRET=1 must be set before Triton is
first imported, and transformers (imported by the session's conftest) has already loaded it
through torch._dynamo; the loaded Triton modules are dropped so the next import decorates for
the interpreter. Whichever of the two runs first does it; the other then finds it done.
"""
import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        if name != "triton._C" and not name.startswith("triton._C."):
            del sys.modules[name]

"""Without a GPU, run the Triton verify kernel under Triton's CPU interpreter.

`triton.jit` picks the interpreter when it decorates a function, Triton's own standard library
included, so TRITON_INTERPRET=1 must be set before Triton is first imported. Other test set-up
imports transformers, whose torch._dynamo import loads Triton first; in that case the already
loaded Triton modules are dropped so that the next import decorates everything for the interpreter.
"""
import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        if name != "triton._C" and not name.startswith("triton._C."):
            del sys.modules[name]

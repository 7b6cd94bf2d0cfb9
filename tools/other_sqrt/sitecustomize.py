"""A stand-in for another CPU maker's float32 square root, for the checked notebooks (``make notebooks-other-sqrt``).

PyTorch's float32 ``torch.sqrt`` calls MKL's vector sqrt, which starts from the RSQRTPS instruction, whose last bits
each CPU maker defines, and refines it with a Newton step: about one result in seven then differs in the last bit
between makers (tools/nbval_lanes.py). No Intel CPU is at hand, so this stands in for one: with
``GROUNDUP_OTHER_SQRT=1`` and this folder on ``PYTHONPATH``, every Python process (the notebooks' kernels, chapter
11's torchrun workers) computes float32 square roots correctly rounded (through float64) instead, which differ from
MKL's in the last bit as often. A notebook whose stored outputs survive this does not depend on the square root's
last bit. Python loads this file at start-up (``site``); without the variable it does nothing.
"""

import os

if os.environ.get("GROUNDUP_OTHER_SQRT") == "1":
    import torch

    _sqrt, _sqrt_ = torch.sqrt, torch.Tensor.sqrt_

    def _other(x):
        return _sqrt(x.double()).float() if x.dtype == torch.float32 else _sqrt(x)

    def sqrt(x, *, out=None):
        y = _other(x)
        return y if out is None else out.copy_(y)

    def sqrt_(x):
        if x.dtype != torch.float32:
            return _sqrt_(x)
        with torch.no_grad():
            return x.copy_(_sqrt(x.double()))

    def foreach_sqrt_(xs):
        for x in xs:
            sqrt_(x)

    torch.sqrt = sqrt
    torch.Tensor.sqrt = _other
    torch.Tensor.sqrt_ = sqrt_
    torch._foreach_sqrt = lambda xs: [_other(x) for x in xs]
    torch._foreach_sqrt_ = foreach_sqrt_

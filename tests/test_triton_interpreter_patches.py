"""plait.triton_utils.patch_interpreter_nested_calls (installed by tests/conftest.py): a kernel calling
@triton.jit helpers computes what it computes without the fix, triton.language is patched once per
launch rather than once per helper call, and every patched member is restored when the launch ends."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    from triton.runtime import interpreter
import triton.language as tl  # noqa: E402


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _sum_of_squares_kernel(X, Out, N: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, N)
    x = tl.load(X + pid * N + offs)
    tl.store(Out + pid, tl.sum(_square(x) + _square(x + 1.0), axis=0))


@triton.jit
def _sum_kernel(X, Out, N: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(Out + pid, tl.sum(tl.load(X + pid * N + tl.arange(0, N)), axis=0))


pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on the CPU only")


def _run() -> torch.Tensor:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out = torch.empty(3)
    _sum_of_squares_kernel[(3,)](x, out, N=4)
    return out


def test_a_kernel_calling_jit_helpers_computes_the_eager_result():
    assert getattr(interpreter._patch_lang, "_plait_nested_fix", False)
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.testing.assert_close(_run(), (x * x + (x + 1) * (x + 1)).sum(dim=1))


def test_language_is_patched_once_per_launch_not_per_helper_call(monkeypatch):
    calls: list[int] = []
    builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: calls.append(1) or builtin(*a))
    # One program and no helper of its own (tl.sum's combine function is one, from tl.core's module):
    # what one launch patches.
    _sum_kernel[(1,)](torch.zeros(4), torch.empty(1), N=4)
    once = len(calls)
    assert once > 0
    calls.clear()
    _run()  # three programs, each calling two helpers and tl.sum
    assert len(calls) == once


def test_every_patched_member_is_restored_after_the_launch():
    before = {name: getattr(tl, name) for name in ("load", "store", "sum", "arange", "program_id")}
    before_tensor_add = tl.tensor.__add__
    _run()
    assert {name: getattr(tl, name) for name in before} == before
    assert tl.tensor.__add__ is before_tensor_add

"""The AST ratchet (docs/architecture.md): decision modules read the (prefill, decode) pair, never the
base ``attention_backend`` field, plus the failing twin that proves the ratchet can fail; and
``serving_attention_backend``, which answers the leaf that serves a batch, through hybrids and
wrappers."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from plait.attention.decisions import DECISION_MODULES, reads_of_base_field
from plait.attention.hybrid import HybridAttnBackend, serving_attention_backend, serving_backend_name
from plait.attention.plan_check import PlanCheckingBackend
from plait.attention.torch_native import TorchNativeAttnBackend
from plait.forward_batch import ForwardMode
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool
from tests.test_forward_batch_plan import make_batch


@pytest.mark.parametrize("module", sorted(DECISION_MODULES))
def test_decision_module_never_reads_the_base_backend_field(module):
    source = inspect.getsource(importlib.import_module(module))
    assert reads_of_base_field(source) == [], f"{module} reads config.attention_backend; use attention_backends()"


def test_ratchet_fails_on_a_module_that_reads_the_base_field():
    offending = "def pick(config):\n    return config.attention_backend or 'triton'\n"
    assert reads_of_base_field(offending) == [2]


def test_ratchet_ignores_the_pair_accessor_and_assignments():
    fine = "def pick(config, o):\n    o.attention_backend = 1\n    return config.attention_backends()[0]\n"
    assert reads_of_base_field(fine) == []


def _two_leaves() -> tuple[TorchNativeAttnBackend, TorchNativeAttnBackend]:
    pool = ReqToTokenPool(2, 8, "cpu")
    kv = MHATokenToKVPool(8, torch.float32, 1, 1, 8, "cpu")
    prefill, decode = TorchNativeAttnBackend(pool, kv), TorchNativeAttnBackend(pool, kv)
    prefill.name, decode.name = "prefill_kernel", "decode_kernel"
    return prefill, decode


def test_serving_backend_answers_from_the_hybrid_table():
    prefill, decode = _two_leaves()
    hybrid = HybridAttnBackend(prefill, decode)
    fb = make_batch()
    assert serving_attention_backend(hybrid, fb) is decode
    fb.forward_mode = ForwardMode.EXTEND
    assert serving_attention_backend(hybrid, fb) is prefill
    assert serving_attention_backend(prefill, fb) is prefill


def test_serving_backend_sees_through_the_plan_checker():
    """PLAIT_CHECK_PLANS=1 wraps the hybrid: the answer is still the half that serves the batch."""
    prefill, decode = _two_leaves()
    checked = PlanCheckingBackend(HybridAttnBackend(prefill, decode))
    fb = make_batch()
    assert fb.forward_mode == ForwardMode.DECODE
    assert serving_attention_backend(checked, fb) is decode
    fb.forward_mode = ForwardMode.EXTEND
    assert serving_attention_backend(checked, fb) is prefill


def test_serving_backend_of_a_checked_leaf_is_the_leaf():
    prefill, _ = _two_leaves()
    assert serving_attention_backend(PlanCheckingBackend(prefill), make_batch()) is prefill


def test_reported_name_names_the_halves_serving_backend_answers():
    prefill, decode = _two_leaves()
    checked = PlanCheckingBackend(HybridAttnBackend(prefill, decode))
    assert serving_backend_name(checked) == "hybrid(prefill=prefill_kernel,decode=decode_kernel)"
    assert serving_backend_name(PlanCheckingBackend(prefill)) == "prefill_kernel"

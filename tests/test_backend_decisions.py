"""The AST ratchet of DESIGN 3.5: decision modules read the (prefill, decode) pair, never the base
``attention_backend`` field; plus the failing twin that proves the ratchet can fail."""

from __future__ import annotations

import importlib
import inspect

import pytest

from plait.attention.decisions import DECISION_MODULES, reads_of_base_field
from plait.attention.hybrid import HybridAttnBackend, serving_attention_backend
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


def test_serving_backend_answers_from_the_hybrid_table():
    pool = ReqToTokenPool(2, 8, "cpu")
    kv = MHATokenToKVPool(8, __import__("torch").float32, 1, 1, 8, "cpu")
    prefill, decode = TorchNativeAttnBackend(pool, kv), TorchNativeAttnBackend(pool, kv)
    hybrid = HybridAttnBackend(prefill, decode)
    fb = make_batch()
    assert serving_attention_backend(hybrid, fb) is decode
    fb.forward_mode = ForwardMode.EXTEND
    assert serving_attention_backend(hybrid, fb) is prefill
    assert serving_attention_backend(prefill, fb) is prefill

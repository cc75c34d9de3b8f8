"""The draft model's attention backend is chosen in one place, the draft backend factory: the
``--speculative-draft-attention-backend`` override if given, else the half
``--speculative-attention-mode`` names (prefill by default), for the draft's decode steps and its
extends alike."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from plait.config import EngineConfig  # noqa: E402
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from plait.speculative.draft_backend import DraftBackendFactory  # noqa: E402

# The two halves differ: prefill triton, decode torch_native.
SPLIT = {"prefill_attention_backend": "triton", "decode_attention_backend": "torch_native"}


def _built_names(**options) -> tuple[str, str, list[str]]:
    """(extend backend, multi-step container, per-step children): the names of what the factory built."""
    config = EngineConfig.from_kwargs(model="x", device="cpu", speculative_algorithm="NGRAM", **options)
    pool = ReqToTokenPool(2, 8, "cpu")
    kv = MHATokenToKVPool(8, torch.float32, 1, 1, 8, "cpu")
    factory = DraftBackendFactory(config, pool, kv, num_q_heads=1)
    multi = factory.create_decode_backend(2)
    return factory.create_extend_backend().name, multi.name, [c.name for c in multi.children]


def test_the_draft_runs_on_the_prefill_half_by_default():
    assert _built_names(**SPLIT) == ("triton", "triton", ["triton", "triton"])


def test_decode_mode_puts_the_draft_on_the_decode_half():
    names = _built_names(**SPLIT, speculative_attention_mode="decode")
    assert names == ("torch_native", "torch_native", ["torch_native", "torch_native"])


@pytest.mark.parametrize(("mode", "override"), [("prefill", "torch_native"), ("decode", "triton")])
def test_the_draft_backend_override_wins_over_the_half_the_mode_names(mode, override):
    names = _built_names(**SPLIT, speculative_attention_mode=mode, speculative_draft_attention_backend=override)
    assert names == (override, override, [override, override])

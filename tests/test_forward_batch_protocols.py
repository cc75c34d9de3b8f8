"""ForwardBatch types what higher floors wire onto it by Protocols declared beside it; the real
attention backend, hidden capture and sampling state provide every member those Protocols name."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from plait.attention.base import AttentionBackend
from plait.forward_batch import BatchAttentionBackend, BatchHiddenCapture, BatchSamplingInfo
from plait.layers.hidden_capture import HiddenCapture
from plait.sampling import SamplingBatchInfo


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_an_attention_backend_has_every_member_of_the_batch_protocol():
    assert all(hasattr(AttentionBackend, name) for name in _members(BatchAttentionBackend))


def test_a_hidden_capture_has_every_member_of_the_batch_protocol():
    capture = HiddenCapture([-1], hidden_size=4, static_rows=2, dtype=torch.float32, device="cpu")
    assert all(hasattr(capture, name) for name in _members(BatchHiddenCapture))


def test_the_sampling_state_has_every_member_of_the_batch_protocol():
    fields = {f.name for f in dataclasses.fields(SamplingBatchInfo)}
    assert _members(BatchSamplingInfo) <= fields


def test_the_backend_methods_take_the_protocol_parameters():
    for name in ("forward", "rope_kv_store_target"):
        wanted = list(inspect.signature(getattr(BatchAttentionBackend, name)).parameters)
        assert list(inspect.signature(getattr(AttentionBackend, name)).parameters) == wanted

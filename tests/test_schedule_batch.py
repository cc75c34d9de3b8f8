"""ScheduleBatch's host lists: the decode-only builder gives exactly what the general one gives, on the
batches a real scheduler launches (overlap on, so inputs still on the device are among them)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from plait.engine.engine import Engine
from plait.scheduler.schedule_batch import HostLists, ScheduleBatch


def _launched_batches(model: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[HostLists, HostLists]]:
    """Both builders' lists of every decode-only batch a short overlapped run converts for its forward."""
    seen: list[tuple[HostLists, HostLists]] = []
    convert = ScheduleBatch.to_forward_batch

    def recording(batch: ScheduleBatch, device: torch.device | str):
        if all(e.is_decode for e in batch.entries):
            seen.append((batch.decode_lists(), batch.host_lists()))
        return convert(batch, device)

    monkeypatch.setattr(ScheduleBatch, "to_forward_batch", recording)
    with Engine(model=str(model), device="cpu", max_running_requests=8) as engine:
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15]]
        engine.generate(prompts, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    return seen


def test_decode_lists_equal_the_general_lists_on_every_decode_batch(one_layer: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    batches = _launched_batches(one_layer, monkeypatch)
    assert len(batches) >= 4
    for fast, general in batches:
        assert fast.future_tensor is general.future_tensor
        for field in ("input_ids", "positions", "token_rows", "logits_rows", "future_rows", "future_src",
                      "scored_at", "scored_next", "sample_at", "scored_counts", "top_k"):
            assert getattr(fast, field) == getattr(general, field), field


def test_overlapped_decode_batches_take_their_inputs_from_the_batch_in_flight(one_layer: pathlib.Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    batches = _launched_batches(one_layer, monkeypatch)
    with_futures = [fast for fast, _ in batches if fast.future_rows]
    assert with_futures, "overlap scheduling launched no batch with inputs still on the device"
    for fast in with_futures:
        assert isinstance(fast.future_tensor, torch.Tensor)
        assert all(fast.input_ids[i] == 0 for i in fast.future_rows)


def test_requests_are_identities_two_with_equal_fields_are_different_requests() -> None:
    from plait.sampling.params import SamplingParams
    from plait.scheduler.req import Req

    sp = SamplingParams()
    a, b = (Req("r", [1, 2, 3], sp, seed=0, detokenizer=None) for _ in range(2))  # type: ignore[arg-type]
    batch = [a, b]
    batch.remove(b)
    assert a != b and batch == [a] and batch[0] is a
    assert len({a, b}) == 2  # hashable by identity

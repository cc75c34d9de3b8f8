"""The MLP-sync contract of DP attention, as unit behaviours on the CPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from plait.executor.cuda_graph_runner import CudaGraphRunner
from plait.forward_batch import DPPaddingMode, ForwardBatch, ForwardMode
from plait.parallel.dp_attention import MLPCountSync


@dataclass
class SyncedBatch:
    """What a scheduler (or a custom worker) hands to init_mlp_sync_metadata."""

    global_num_tokens: list[int] | None
    global_num_tokens_for_logprob: list[int] | None
    can_run_dp_cuda_graph: bool = True


@dataclass
class DraftInput:
    num_tokens_per_req: int | list[int]


def _batch(mode: ForwardMode, bs: int, tokens_per_req: int = 1, spec_info=None) -> ForwardBatch:
    t = bs * tokens_per_req
    return ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=torch.arange(t),
                        req_pool_indices=torch.arange(bs) + 1, seq_lens=torch.full((bs,), 5),
                        out_cache_loc=torch.arange(t) + 10, positions=torch.arange(t), seq_lens_cpu=[5] * bs,
                        seq_lens_sum=5 * bs, spec_info=spec_info)


def test_init_mlp_sync_metadata_scales_speculative_request_width():
    fb = _batch(ForwardMode.TARGET_VERIFY, 3, 4, spec_info=DraftInput(num_tokens_per_req=4))
    fb.init_mlp_sync_metadata(SyncedBatch([3, 1], [3, 1], can_run_dp_cuda_graph=True), "cpu")
    assert fb.mlp_sync.original_global_num_tokens_cpu == [3, 1]  # raw: requests per rank
    assert fb.mlp_sync.global_num_tokens_cpu == [12, 4]  # what the MLP sync moves: tokens per rank
    assert fb.mlp_sync.global_num_tokens_for_logprob_cpu == [12, 4]
    assert fb.mlp_sync.global_num_tokens_gpu.tolist() == [12, 4]
    assert fb.mlp_sync.global_num_tokens_for_logprob_gpu.tolist() == [12, 4]
    assert fb.mlp_sync.can_run_dp_cuda_graph


def test_init_mlp_sync_metadata_without_spec_keeps_counts_and_without_counts_does_nothing():
    fb = _batch(ForwardMode.DECODE, 2)
    fb.init_mlp_sync_metadata(SyncedBatch([2, 5], [2, 5], can_run_dp_cuda_graph=False), "cpu")
    assert fb.mlp_sync.global_num_tokens_cpu == fb.mlp_sync.original_global_num_tokens_cpu == [2, 5]
    assert not fb.mlp_sync.can_run_dp_cuda_graph
    plain = _batch(ForwardMode.DECODE, 2)
    plain.init_mlp_sync_metadata(SyncedBatch(None, None), "cpu")
    assert plain.mlp_sync.global_num_tokens_cpu is None and plain.mlp_sync.original_global_num_tokens_cpu is None


def test_non_uniform_request_widths_cannot_scale_other_ranks_counts():
    fb = _batch(ForwardMode.TARGET_VERIFY, 2, 3, spec_info=DraftInput(num_tokens_per_req=[2, 4]))
    with pytest.raises(ValueError, match="differ"):
        fb.init_mlp_sync_metadata(SyncedBatch([2, 2], [2, 2]), "cpu")


def test_dp_cuda_graph_batch_size_uses_raw_request_counts():
    fb = _batch(ForwardMode.TARGET_VERIFY, 3, 4, spec_info=DraftInput(num_tokens_per_req=4))
    fb.init_mlp_sync_metadata(SyncedBatch([3, 7], [3, 7]), "cpu")
    # Requests, not the scaled token counts (28): the graph's batch dimension counts requests.
    assert CudaGraphRunner.max_dp_batch_size(fb) == 7
    with pytest.raises(RuntimeError, match="original_global_num_tokens_cpu"):
        CudaGraphRunner.max_dp_batch_size(_batch(ForwardMode.DECODE, 1))


def test_graph_runner_can_run_and_replay_share_the_dp_batch_size():
    # Only the sizing logic is under test: a runner with buckets and no captured graphs.
    runner = CudaGraphRunner.__new__(CudaGraphRunner)
    runner.max_bs, runner.batch_sizes, runner.pad = 8, [1, 2, 4, 8], True
    fb = _batch(ForwardMode.DECODE, 2)
    fb.init_mlp_sync_metadata(SyncedBatch([2, 5], [2, 5]), "cpu")
    assert runner.graph_batch_size(fb) == 5  # every rank replays the bucket of the largest rank
    assert runner.bucket(runner.graph_batch_size(fb)) == 8
    assert runner.can_run(fb)
    fb.mlp_sync.original_global_num_tokens_cpu = [2, 9]  # another rank is past the largest graph
    assert not runner.can_run(fb)
    fb.mlp_sync.original_global_num_tokens_cpu, fb.mlp_sync.can_run_dp_cuda_graph = [2, 5], False  # a SUM_LEN step
    assert not runner.can_run(fb)


@pytest.mark.parametrize(("counts", "any_extend", "mode"), [
    ([3, 100], True, DPPaddingMode.SUM_LEN),  # any extend: summed buffer
    ([4, 4], False, DPPaddingMode.MAX_LEN),  # balanced decode: pad to the max
    ([3, 4], False, DPPaddingMode.MAX_LEN),  # sum*2 = 14 >= max*dp = 8
    ([1, 0, 0, 0], False, DPPaddingMode.SUM_LEN),  # sum*2 = 2 < max*dp = 4: padding would waste
    ([2, 2, 0, 0], False, DPPaddingMode.MAX_LEN),  # 8 >= 8: the boundary counts as MAX_LEN
])
def test_padding_mode_per_step(counts, any_extend, mode):
    assert DPPaddingMode.choose(counts, any_extend) == mode


class OneRankControl:
    """A control group of one rank: the all-gather returns this rank's tensor."""

    rank, size = 0, 1

    def all_gather(self, t: torch.Tensor, timeout=None) -> list[torch.Tensor]:
        return [t.clone()]


def _one_rank_sync() -> MLPCountSync:
    return MLPCountSync(OneRankControl(), "cpu", None)


def test_dp_attention_count_sync_reports_requests_for_a_verify_batch():
    """init_mlp_sync_metadata scales request counts by the verify width: the DP-attention runner
    must hand it requests, so the graph batch size counts requests and the MLP buffers tokens."""
    fb = _batch(ForwardMode.TARGET_VERIFY, 3, 4, spec_info=DraftInput(num_tokens_per_req=4))
    _one_rank_sync().sync(fb)
    assert fb.mlp_sync.original_global_num_tokens_cpu == [3]  # requests
    assert fb.mlp_sync.global_num_tokens_cpu == [12]  # tokens: 3 requests x 4


def test_dp_attention_count_sync_reports_tokens_for_an_extend_and_requests_for_a_decode():
    sync = _one_rank_sync()
    extend = _batch(ForwardMode.EXTEND, 2, 5)
    sync.sync(extend)
    assert extend.mlp_sync.global_num_tokens_cpu == extend.mlp_sync.original_global_num_tokens_cpu == [10]
    decode = _batch(ForwardMode.DECODE, 3)
    sync.sync(decode)
    assert decode.mlp_sync.global_num_tokens_cpu == decode.mlp_sync.original_global_num_tokens_cpu == [3]



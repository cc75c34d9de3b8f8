"""Expert parallelism's all-to-all dispatch over NCCL on two GPUs (nvidia-h200-x2): the exchange and
the dispatch/combine with the fused Triton kernels on the received pairs, as the gloo tests check on
the CPU, and whole engines whose greedy tokens equal the gather path's (fp32 tiny models; on CUDA
prefill steps dispatch by all-to-all and decode steps keep the gather path, replayed from graphs or
eager)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")]

from tests.distributed.test_moe_all_to_all import _check_dispatch, _check_rows  # noqa: E402
from tests.helpers import prompt_ids, run_two_ranks  # noqa: E402


def test_nccl_rows_reach_their_destination_with_uneven_and_empty_splits():
    run_two_ranks(partial(_check_rows, nccl=True), spawn_both=True)


def test_nccl_dispatch_combine_with_the_fused_kernels_equals_the_reference():
    run_two_ranks(partial(_check_dispatch, nccl=True), spawn_both=True)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("layout", [{"dp_size": 2, "enable_dp_attention": True}, {}], ids=["dp-attention", "tp"])
def test_all_to_all_tokens_equal_the_gather_path_on_two_gpus(tiny_model_dir, graphs, layout):
    import plait

    path = tiny_model_dir("qwen3-moe")
    prompts = prompt_ids(8)
    params = {"temperature": 0.0, "max_new_tokens": 16}
    outs = {}
    for backend in ("none", "all_to_all"):
        with plait.Engine(model=str(path), device="cuda", dtype="float32", tp_size=2, ep_size=2,
                          moe_a2a_backend=backend, disable_cuda_graph=not graphs, max_total_tokens=4096,
                          **layout) as engine:
            outs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs["all_to_all"] == outs["none"]

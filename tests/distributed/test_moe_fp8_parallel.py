"""Block-FP8 experts under tensor and expert parallelism (gloo, two real processes): each rank's
intermediate slice of the experts and its scale blocks (tp), or whole experts with their scales
(ep), decode what one rank decodes."""

from __future__ import annotations

import pytest

from plait.testing import make_tiny_model
from tests.helpers import assert_no_leaks, make_engine, prompt_ids
from tests.quant_helpers import write_fp8_checkpoint

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = prompt_ids(2)
# Every shard of two ranks on the 128-row grid: experts of intermediate 256 (128 per rank), 16 heads
# of 16 for q, k and v (128 rows per rank each), a dense layer of intermediate 256.
SHAPE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_attention_heads=16,
             num_key_value_heads=16, num_hidden_layers=2)


def _greedy(path, **options) -> list[list[int]]:
    with make_engine(path, max_total_tokens=128, **options) as engine:
        out = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        assert_no_leaks(engine)
        return out


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-fp8-tp")
    src = make_tiny_model(root / "src", "qwen3-moe", seed=0, **SHAPE)
    return write_fp8_checkpoint(src, root / "fp8", "fp8-block")


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "ep2"])
def test_fp8_experts_at_two_ranks_decode_what_one_rank_decodes(fp8_checkpoint, ep_size):
    assert _greedy(fp8_checkpoint, tp_size=2, ep_size=ep_size, dist_timeout=60) == _greedy(fp8_checkpoint)

"""FP8 under tensor parallelism (gloo, two real processes): FP8 checkpoints in the published layouts
and online FP8 shard their weights and scales like the dense layers, and a tp_size=2 engine decodes
what one rank decodes."""

from __future__ import annotations

import pytest

from plait.testing import make_tiny_model
from tests.helpers import assert_no_leaks, make_engine, prompt_ids
from tests.quant_helpers import write_fp8_checkpoint

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = prompt_ids(4)


def _greedy(path, **options) -> list[list[int]]:
    with make_engine(path, chunked_prefill_size=16, **options) as engine:
        out = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        assert_no_leaks(engine)
        return out


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel", "ct-tensor"])
def test_fp8_checkpoint_at_tp2_decodes_what_one_rank_decodes(layout, tmp_path):
    # Scales shard with their weights: row blocks of 128 (and per-row scales) with the output rows of
    # column-parallel layers, column blocks with the input columns of row-parallel ones. Four KV heads
    # of 64: each rank's k and v shards are 128 rows, whole scale blocks.
    src = make_tiny_model(tmp_path / "src", "llama", seed=0, num_key_value_heads=4)
    path = write_fp8_checkpoint(src, tmp_path / layout, layout)
    assert _greedy(path, tp_size=2, dist_timeout=60) == _greedy(path)


def test_online_fp8_at_tp2_decodes_what_one_rank_decodes(tiny_model_dir):
    # Online quantization runs on each rank's shard; a row-parallel layer's per-row scales come from
    # the absmax over every rank's columns (a MAX all-reduce), so both layouts store the same FP8.
    path = tiny_model_dir("llama")
    assert _greedy(path, quantization="fp8", tp_size=2, dist_timeout=60) == _greedy(path, quantization="fp8")

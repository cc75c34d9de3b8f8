"""The structured-overhead workload runs end to end on the CPU at toy sizes (the H200 numbers come
from `plait bench structured`): the shape directory carries the real tokenizer and vocab 49152,
both runs time steady decode, and the 30 schemas compile."""

from __future__ import annotations

import json

from plait.bench.grammars import JSON_SCHEMAS
from plait.bench.structured import compile_times, structured_overhead, write_structured_shape_dir


def test_shape_dir_has_the_real_tokenizer_and_vocab_49152(real_model_dir, tmp_path):
    path = write_structured_shape_dir(tmp_path, real_model_dir)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["hidden_size"] == 4096
    assert (path / "tokenizer.json").exists()


def test_compile_times_cover_the_30_schemas(real_model_dir):
    out = compile_times(real_model_dir)
    assert len(out["per_schema_s"]) == len(JSON_SCHEMAS) == 30
    assert 0 < out["median_s"] <= out["max_s"]


def test_structured_overhead_measures_both_runs(tiny_model_dir):
    out = structured_overhead(str(tiny_model_dir("llama")), (1, 2), steps=2, device="cpu", dtype="float32",
                              load_format="auto", max_total_tokens=4096, context_length=1024)
    for bs in (1, 2):
        run = out[f"bs{bs}"]
        assert run["unconstrained"]["generated_tokens"] == 2 * bs
        assert run["json_schema"]["generated_tokens"] == 2 * bs
        assert run["cost_ratio"] > 0

"""The small-M GEMV (plait.layers.quantization.gemv) against the dequantized-weight product (FP8: the
weight-only form; the W8A8 form is tests/test_gemv_w8a8.py), in the Triton interpreter at tiny shapes,
and its launch-config tables (file, PLAIT_GEMV_CONFIG_DIR, fallback)."""

from __future__ import annotations

import json

import pytest
import torch

from plait.layers.quantization import gemv_config
from plait.layers.quantization.fp8_kernels import (
    dequantize_weight,
    reference_w8a8_gemv,
)
from plait.layers.quantization.gemv import MAX_COUNTERS, gemv, plan_launch, split_counters
from plait.layers.quantization.gemv_config import GemvConfig, default_config, get_config
from tests.quant_helpers import random_fp8_weight

# N 40 is not a multiple of BLOCK_N 16, K 200 not a multiple of BLOCK_K 64.
N, K = 40, 200


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))




@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("m", [1, 3])
def test_fp8_channel_gemv_equals_the_dequantized_weight_product(m, split_k):
    q, s, _ = random_fp8_weight("channel", N, K)
    x = _rand(m, K, seed=1)
    out = gemv(x, q, s, None, GemvConfig(block_n=16, block_k=64, split_k=split_k), w8a8=False)
    torch.testing.assert_close(out, x @ dequantize_weight(q, s, None).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3])
def test_fp8_block_gemv_equals_the_dequantized_weight_product(m):
    # N 136 and K 320 end inside a 128 x 128 scale block; BLOCK_K 256 is narrowed to the block width.
    q, s, block = random_fp8_weight("block", 136, 320)
    x = _rand(m, 320, seed=2)
    out = gemv(x, q, s, block, GemvConfig(block_n=16, block_k=256, split_k=2), w8a8=False)
    torch.testing.assert_close(out, x @ dequantize_weight(q, s, block).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3])
def test_bf16_gemv_equals_the_bf16_weight_product(m):
    w = (_rand(N, K, seed=3) * 0.05).to(torch.bfloat16)
    x = _rand(m, K, seed=4)
    out = gemv(x, w, config=GemvConfig(block_n=16, block_k=64, split_k=2))
    torch.testing.assert_close(out, x @ w.float().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3])
def test_bf16_activations_give_a_bf16_result_within_its_rounding(m):
    q, s, _ = random_fp8_weight("channel", N, K)
    x = _rand(m, K, seed=5).to(torch.bfloat16)
    out = gemv(x, q, s, None, GemvConfig(block_n=8, block_k=64), w8a8=False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ dequantize_weight(q, s, None).t(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize(("kind", "split_k"), [("bf16", 2), ("channel", 1), ("block", 2)])
def test_swapped_operands_equal_the_weight_product(kind, split_k):
    # One warp: the swapped form's 16 weight rows per warp are the 16-row tile.
    config = GemvConfig(block_n=16, block_k=64, split_k=split_k, num_warps=1, swap_ab=True)
    x = _rand(3, K, seed=10)
    if kind == "bf16":
        w = (_rand(N, K, seed=11) * 0.05).to(torch.bfloat16)
        out, ref = gemv(x, w, config=config), x @ w.float().t()
    else:
        q, s, block = random_fp8_weight(kind, N, K)
        out, ref = gemv(x, q, s, block, config, w8a8=False), x @ dequantize_weight(q, s, block).t()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_swapped_operands_plan_whole_warpgroup_rows_past_one_token():
    swapped = GemvConfig(block_n=16, block_k=128, num_warps=4, swap_ab=True)
    plan = plan_launch(4, 4096, 4096, None, swapped)
    assert plan.swap_ab and plan.block_n == 64 and plan.block_m == 16  # 16 weight rows per warp
    assert not plan_launch(1, 4096, 4096, None, swapped).swap_ab  # one token: the elementwise form
    assert not plan_launch(4, 4096, 4096, None, swapped, True).swap_ab  # W8A8's dot is swapped already


def test_config_json_holds_a_flag_only_where_set():
    assert "swap_ab" not in SMALL.to_json()
    swapped = GemvConfig(block_n=64, block_k=128, swap_ab=True)
    assert swapped.to_json()["swap_ab"] == 1 and GemvConfig.from_json(swapped.to_json()) == swapped


def test_split_k_leaves_its_counters_zero():
    q, s, _ = random_fp8_weight("channel", N, K)
    gemv(_rand(2, K, seed=6), q, s, None, GemvConfig(block_n=16, block_k=64, split_k=3))
    counters = split_counters(torch.device("cpu"))
    assert counters.numel() == MAX_COUNTERS and int(counters.abs().sum()) == 0


def test_bad_calls_fail_naming_the_limit():
    q, s, _ = random_fp8_weight("channel", N, K)
    with pytest.raises(ValueError, match=r"M must be in 1\.\.16, got 17"):
        gemv(torch.zeros(17, K), q, s)
    with pytest.raises(ValueError, match="bf16 weights take no scale"):
        gemv(torch.zeros(1, K), q.to(torch.bfloat16), s)
    with pytest.raises(ValueError, match="fp8_channel weights need scale"):
        gemv(torch.zeros(1, K), q)
    with pytest.raises(ValueError, match="x has K=100 columns, the weight 200"):
        gemv(torch.zeros(1, 100), q, s)
    with pytest.raises(ValueError, match="torch.float16 weights multiply torch.float16 or float32 activations"):
        gemv(torch.zeros(1, K, dtype=torch.bfloat16), q.to(torch.float16))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        GemvConfig(block_n=12, block_k=64)


# --- config tables -------------------------------------------------------------------------------
SMALL = GemvConfig(block_n=4, block_k=1024, split_k=1, num_warps=4, num_stages=4)
WIDE = GemvConfig(block_n=32, block_k=256, split_k=2, num_warps=8, num_stages=3)


def _write(directory, table) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / gemv_config.config_file_name("Fake GPU")).write_text(json.dumps(table))


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A package config dir and an override dir under tmp_path; the parsed tables forgotten around."""
    monkeypatch.setattr(gemv_config, "CONFIG_DIR", tmp_path / "package")
    monkeypatch.delenv("PLAIT_GEMV_CONFIG_DIR", raising=False)
    gemv_config.clear_cache()
    yield tmp_path
    gemv_config.clear_cache()


def test_tuned_file_gives_the_smallest_bucket_covering_m(tables):
    _write(tables / "package", {"fp8_channel": {"N6144_K4096": {"1": SMALL.to_json(), "8": WIDE.to_json()}}})
    assert get_config("fp8_channel", 1, 6144, 4096, "Fake GPU", 132) == SMALL
    assert get_config("fp8_channel", 5, 6144, 4096, "Fake GPU", 132) == WIDE
    assert get_config("fp8_channel", 16, 6144, 4096, "Fake GPU", 132) == WIDE  # past the last: the largest


def test_one_token_never_takes_tiles_tuned_for_several_rows(tables):
    _write(tables / "package", {"bf16": {"N6144_K4096": {"2": WIDE.to_json(), "8": WIDE.to_json()}}})
    assert get_config("bf16", 1, 6144, 4096, "Fake GPU", 132) == default_config("bf16", 1, 6144, 4096, 132)
    assert get_config("bf16", 2, 6144, 4096, "Fake GPU", 132) == WIDE


def test_env_dir_is_read_before_the_package_dir(tables, monkeypatch):
    _write(tables / "package", {"bf16": {"N4096_K4096": {"1": SMALL.to_json()}}})
    _write(tables / "fresh", {"bf16": {"N4096_K4096": {"1": WIDE.to_json()}}})
    monkeypatch.setenv("PLAIT_GEMV_CONFIG_DIR", str(tables / "fresh"))
    assert get_config("bf16", 1, 4096, 4096, "Fake GPU", 132) == WIDE
    monkeypatch.delenv("PLAIT_GEMV_CONFIG_DIR")
    assert get_config("bf16", 1, 4096, 4096, "Fake GPU", 132) == SMALL


def test_missing_entries_fall_back_to_the_default(tables):
    _write(tables / "package", {"bf16": {"N4096_K4096": {"1": SMALL.to_json()}}})
    assert get_config("bf16", 1, 2048, 4096, "Fake GPU", 132) == default_config("bf16", 1, 2048, 4096, 132)
    assert get_config("fp8_block", 1, 4096, 4096, "Fake GPU", 132) == default_config("fp8_block", 1, 4096, 4096, 132)
    assert get_config("bf16", 1, 4096, 4096, "Other GPU", 132) == default_config("bf16", 1, 4096, 4096, 132)


def test_dense_layers_take_the_gemv_past_one_token_only_where_the_table_says_it_wins(tables):
    fast_cublas = GemvConfig(**{**WIDE.to_json(), "prefer_cublas": True})
    _write(tables / "package", {"bf16": {"N4096_K4096": {"1": SMALL.to_json(), "4": WIDE.to_json(),
                                                         "16": fast_cublas.to_json()},
                                         "N6144_K4096": {"1": SMALL.to_json()}}})
    assert gemv_config.gemv_takes("bf16", 2, 4096, 4096, "Fake GPU")  # bucket 4 covers 2..4
    assert not gemv_config.gemv_takes("bf16", 8, 4096, 4096, "Fake GPU")  # bucket 16: cuBLAS measured faster
    assert not gemv_config.gemv_takes("bf16", 2, 6144, 4096, "Fake GPU")  # tuned for one token only
    assert not gemv_config.gemv_takes("bf16", 2, 2048, 4096, "Fake GPU")  # no entry
    assert not gemv_config.gemv_takes("bf16", 2, 4096, 4096, "Other GPU")  # no table


def test_dense_layers_take_the_gemv_for_one_token_always_and_never_past_its_limit(tables):
    assert gemv_config.gemv_takes("bf16", 1, 2048, 4096, "Other GPU")  # no table needed
    _write(tables / "package", {"bf16": {"N4096_K4096": {"16": WIDE.to_json()}}})
    assert gemv_config.gemv_takes("bf16", 16, 4096, 4096, "Fake GPU")
    assert not gemv_config.gemv_takes("bf16", 17, 4096, 4096, "Fake GPU")


def test_default_splits_k_only_when_row_tiles_leave_sms_idle():
    assert default_config("fp8_channel", 1, 28672, 4096, 132).split_k == 1  # 3584 row tiles
    narrow = default_config("fp8_channel", 16, 4096, 4096, 132)  # 128 row tiles of 32
    assert narrow.split_k > 1 and -(-4096 // narrow.block_n) * narrow.split_k >= 4 * 132
    assert default_config("fp8_block", 1, 4096, 4096, 132).block_k == 128  # one scale block per step


# --- the bf16 switch ------------------------------------------------------------------------------
def test_bf16_gemv_switch_is_read_when_a_layer_is_built(monkeypatch):
    from plait.layers.linear import ColumnParallelLinear, RowParallelLinear

    assert ColumnParallelLinear(8, 8).small_m_gemv  # on by default: one token measured faster than cuBLAS
    monkeypatch.setenv("PLAIT_BF16_GEMV", "0")
    assert not ColumnParallelLinear(8, 8).small_m_gemv
    monkeypatch.setenv("PLAIT_BF16_GEMV", "1")
    col, row = ColumnParallelLinear(64, 32, dtype=torch.bfloat16), RowParallelLinear(64, 32, dtype=torch.bfloat16)
    assert col.small_m_gemv and row.small_m_gemv
    # Off the GPU the layers keep F.linear, whatever the switch says.
    col.weight.data.copy_(_rand(32, 64, seed=7))
    x = _rand(2, 64, seed=8).to(torch.bfloat16)
    assert torch.equal(col(x), torch.nn.functional.linear(x, col.weight))


# --- the tuner (its GPU timer replaced; every candidate still runs, in the interpreter) -------------
def test_tuner_runs_every_candidate_and_keeps_the_fastest_per_case(monkeypatch):
    from plait.bench import gemv_tune

    tiny = [gemv_tune.Case("fp8_channel", 48, 256, 1, ["tiny/o_proj"]), gemv_tune.Case("bf16", 48, 256, 2, ["tiny/o"]),
            gemv_tune.Case("fp8_channel_mma", 48, 256, 1, ["tiny/o_proj"])]
    monkeypatch.setattr(gemv_tune, "cases", lambda shapes, kinds, ms: tiny)
    ran: list[GemvConfig] = []

    def fake_time(x, ws, scale, block, cfg, reps=2, w8a8=False):
        out = gemv(x, ws[0], scale, block, cfg, w8a8=w8a8)
        if w8a8:  # the W8A8 kinds run the activation-quantizing form
            ref = reference_w8a8_gemv(x.float(), ws[0], scale, block)
        else:
            ref = x.float() @ (dequantize_weight(ws[0], scale, block) if scale is not None else ws[0].float()).t()
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        ran.append(cfg)
        return 1.0 / (cfg.block_n * 1000 + cfg.block_k + cfg.split_k)  # the widest tile wins

    monkeypatch.setattr(gemv_tune, "time_config", fake_time)
    monkeypatch.setattr(gemv_tune, "graph_time", lambda fns, reps=10: 1.0)  # cuBLAS: slower than every tile
    saved = []
    table, rows = gemv_tune.tune(budget_s=600, save=lambda t, r: saved.append(len(r)), device="cpu")
    expected = {c.kind: max(gemv_tune.candidates(c.kind, c.m, c.n, c.k, 8),
                            key=lambda g: g.block_n * 1000 + g.block_k + g.split_k) for c in tiny}
    assert len(ran) == sum(len(gemv_tune.candidates(c.kind, c.m, c.n, c.k, 8)) for c in tiny)
    assert table["fp8_channel"]["N48_K256"]["1"] == expected["fp8_channel"].to_json()
    assert table["bf16"]["N48_K256"]["2"] == expected["bf16"].to_json()
    assert table["fp8_channel_mma"]["N48_K256"]["1"] == expected["fp8_channel_mma"].to_json()
    assert sorted(r["M"] for r in rows) == [1, 1, 2] and saved == [1, 2, 3]
    assert all(r["best_us"] <= r["default_us"] for r in rows)


def test_tuner_tries_swapped_operands_only_for_the_tensor_core_form():
    from plait.bench import gemv_tune

    assert any(c.swap_ab for c in gemv_tune.candidates("bf16", 2, 4096, 4096, 132))
    assert any(c.swap_ab for c in gemv_tune.candidates("fp8_block", 16, 4096, 4096, 132))
    assert not any(c.swap_ab for c in gemv_tune.candidates("bf16", 1, 4096, 4096, 132))
    assert not any(c.swap_ab for c in gemv_tune.candidates("fp8_channel_mma", 4, 4096, 4096, 132))


def test_tuner_marks_the_token_counts_where_cublas_measured_faster(monkeypatch):
    from plait.bench import gemv_tune

    monkeypatch.setattr(gemv_tune, "time_config", lambda x, ws, s, b, cfg, reps=2, w8a8=False: 2e-6)
    monkeypatch.setattr(gemv_tune, "graph_time", lambda fns, reps=10: [f() for f in fns] and 1e-6)
    ws, scale, block = gemv_tune.make_weights("bf16", 48, 256, rotate=False, device="cpu")
    several = gemv_tune.tune_case(gemv_tune.Case("bf16", 48, 256, 4, ["tiny/o"]), ws, scale, block, 8)
    one = gemv_tune.tune_case(gemv_tune.Case("bf16", 48, 256, 1, ["tiny/o"]), ws, scale, block, 8)
    assert several["best"]["prefer_cublas"] == 1 and several["cublas_us"] == pytest.approx(1.0)
    assert "prefer_cublas" not in one["best"] and "cublas_us" not in one  # one token always takes the GEMV


def test_tuner_never_keeps_a_config_off_the_reference(monkeypatch):
    from plait.bench import gemv_tune

    case = gemv_tune.Case("bf16", 48, 256, 1, ["tiny/o"])
    broken = gemv_tune.candidates("bf16", 1, 48, 256, 8)[0]
    monkeypatch.setattr(gemv_tune, "time_config", lambda x, ws, s, b, cfg, reps=2, w8a8=False: float(cfg != broken))
    real = gemv_tune.rel_error
    monkeypatch.setattr(gemv_tune, "rel_error",
                        lambda x, w, s, b, cfg, w8a8=False: 1.0 if cfg == broken else real(x, w, s, b, cfg))
    ws, scale, block = gemv_tune.make_weights("bf16", 48, 256, rotate=False, device="cpu")
    row = gemv_tune.tune_case(case, ws, scale, block, 8)
    assert row["best"] != broken.to_json() and row["best_us"] == 1e6


@pytest.mark.parametrize("kind, kept", [("fp8_channel_mma", True), ("bf16", False)])
def test_tuner_allows_w8a8_configs_the_fp8_rounding_of_their_activations(monkeypatch, kind, kept):
    """An error between 1e-2 and W8A8_TOLERANCE of the largest output: what one activation rounded a step
    off the reference's costs a small-K W8A8 product, a fault in any other form."""
    from plait.bench import gemv_tune

    case = gemv_tune.Case(kind, 48, 256, 1, ["tiny/o"])
    monkeypatch.setattr(gemv_tune, "time_config", lambda x, ws, s, b, cfg, reps=2, w8a8=False: 1.0)
    error = (1e-2 + gemv_tune.W8A8_TOLERANCE) / 2
    monkeypatch.setattr(gemv_tune, "rel_error", lambda x, w, s, b, cfg, w8a8=False: error)
    ws, scale, block = gemv_tune.make_weights(kind, 48, 256, rotate=False, device="cpu")
    if kept:
        assert gemv_tune.tune_case(case, ws, scale, block, 8)["best"]
    else:
        with pytest.raises(RuntimeError, match="matches the fp32 reference"):
            gemv_tune.tune_case(case, ws, scale, block, 8)


def test_compare_times_both_fp8_forms_per_shape_and_m(monkeypatch):
    from plait.bench import gemv_tune

    monkeypatch.setattr(gemv_tune, "cases", lambda shapes, kinds, ms: [gemv_tune.Case(kinds[0], 48, 256, 1, ["t/o"])])
    forms: list[tuple[bool, int]] = []

    def fake_time(x, ws, scale, block, cfg, reps=2, w8a8=False):
        gemv(x, ws[0], scale, block, cfg, w8a8=w8a8)  # runs on the tables in force (cfg None)
        forms.append((w8a8, x.shape[0]))
        return 2e-6 if not w8a8 else 1e-6

    monkeypatch.setattr(gemv_tune, "time_config", fake_time)
    rows = gemv_tune.compare_forms(("tiny",), (1, 16), device="cpu")
    assert [(r["kind"], r["M"]) for r in rows] == [("fp8_channel", 1), ("fp8_channel", 16), ("fp8_block", 1),
                                                     ("fp8_block", 16)]
    assert forms == [(False, 1), (True, 1), (False, 16), (True, 16)] * 2
    assert all(r["speedup"] == 2.0 and r["w8a8"]["tb_s"] == 2 * r["weight_only"]["tb_s"] for r in rows)


def test_compare_cublas_times_both_per_projection_and_m(monkeypatch):
    from plait.bench import gemv_tune

    monkeypatch.setattr(gemv_tune, "cases", lambda shapes, kinds, ms: [gemv_tune.Case("bf16", 48, 256, 1, ["t/o"])])
    timed: list[int] = []

    def fake_time(x, ws, scale, block, cfg, reps=2, w8a8=False):
        out = gemv(x, ws[0], scale, block, cfg)  # the config in force (cfg None)
        torch.testing.assert_close(out.float(), x.float() @ ws[0].float().t(), rtol=2e-2, atol=2e-2)
        timed.append(x.shape[0])
        return 3e-6

    monkeypatch.setattr(gemv_tune, "time_config", fake_time)
    monkeypatch.setattr(gemv_tune, "graph_time", lambda fns, reps=10: [f() for f in fns] and 2e-6)
    rows = gemv_tune.compare_cublas(("tiny",), (1, 4), {"t/lm_head": (40, 128)}, device="cpu")
    assert [(r["N"], r["M"]) for r in rows] == [(48, 1), (48, 4), (40, 1), (40, 4)] and timed == [1, 4, 1, 4]
    for r in rows:
        assert r["cublas_speedup"] == pytest.approx(1.5)
        assert r["cublas"]["tb_s"] == pytest.approx(1.5 * r["gemv"]["tb_s"])
    # The interpreter's stand-in device has no table: cuBLAS past one token.
    assert [r["dense_layers_take"] for r in rows] == ["gemv", "cublas", "gemv", "cublas"]


def test_preferences_mark_the_cases_where_w8a8_measured_faster():
    from plait.bench import gemv_tune

    rows = [{"kind": "fp8_channel", "N": 48, "K": 256, "M": 1, "speedup": 0.6},
            {"kind": "fp8_channel", "N": 48, "K": 256, "M": 16, "speedup": 1.3},
            {"kind": "fp8_block", "N": 48, "K": 256, "M": 16, "speedup": 1.01}]  # inside the margin
    in_force = {1: SMALL, 16: GemvConfig(**{**SMALL.to_json(), "prefer_w8a8": True})}  # 16: marked before
    table = gemv_tune.w8a8_preferences(rows, lambda kind, m, n, k: in_force[m])
    assert table["fp8_channel"]["N48_K256"] == {"1": SMALL.to_json(), "16": {**SMALL.to_json(), "prefer_w8a8": 1}}
    assert table["fp8_block"]["N48_K256"] == {"16": SMALL.to_json()}  # the old mark removed
    assert GemvConfig.from_json(table["fp8_channel"]["N48_K256"]["16"]).prefer_w8a8


# --- the GPU build, without a GPU ----------------------------------------------------------------
def test_pdl_launches_load_nothing_before_the_grid_dependency_wait():
    """The PDL contract (plait/layers/pdl.py) in the sm_90 build: no global load precedes the wait."""
    from tests.gemv_aot import compile_defaults_in_subprocess

    for r in compile_defaults_in_subprocess(("fp8_channel", "bf16"), ((6144, 4096),), ms=(1,)):
        assert r["loads_before_wait"] == 0, r


def test_default_configs_compile_for_sm90_without_spills_and_pipeline_their_loads():
    """The interpreter runs the kernel's Python; this compiles it for an H200 with the wheel's ptxas."""
    from tests.gemv_aot import compile_defaults_in_subprocess

    results = compile_defaults_in_subprocess(("fp8_channel", "fp8_block", "bf16"), ((6144, 4096), (4096, 4096)))
    for r in results:
        assert r["stack"] == 0 and r["regs"] <= 128, r  # no spills; >= 4 programs of 4 warps fit an SM
        assert r["pipelined_loads"] > 0, r  # num_stages turned the weight loads into async copies


def test_swapped_tiles_compile_for_sm90_to_warpgroup_mmas_without_spills():
    """The tuner's swapped-operand tiles at 4 tokens, built for an H200: no spills, pipelined weight
    loads, and Hopper's warpgroup MMA (the unswapped form's 16-row dot runs mma.sync)."""
    import tests.gemv_aot as aot
    from plait.bench.gemv_tune import SWAP_TILES, SWAP_TILES_BLOCK
    from tests.gemv_aot import run_aot_script

    work = [(kind, 4, 6144, 4096, GemvConfig(block_n=bn, block_k=k_bytes // (1 if kind.startswith("fp8") else 2),
                                             num_warps=warps, num_stages=stages, swap_ab=True).to_json())
            for kind, tiles in (("bf16", SWAP_TILES), ("fp8_channel", SWAP_TILES), ("fp8_block", SWAP_TILES_BLOCK))
            for bn, k_bytes, warps, stages in tiles]
    for r in run_aot_script(aot.__file__, work):
        assert r["stack"] == 0 and r["pipelined_loads"] > 0 and r["wgmma"] > 0, r


def test_wide_search_tiles_compile_for_sm90_without_spills():
    """``tune_gemv.py --wide``'s extra tensor-core tiles, built for an H200 as the GPU launches them."""
    import tests.gemv_aot as aot
    from plait.bench.gemv_tune import WIDE_DOT_TILES
    from tests.gemv_aot import run_aot_script

    work = [("bf16", 8, 6144, 4096, GemvConfig(block_n=bn, block_k=k_bytes // 2, num_warps=warps,
                                               num_stages=stages).to_json())
            for bn, k_bytes, warps, stages in WIDE_DOT_TILES]
    for r in run_aot_script(aot.__file__, work):
        assert r["stack"] == 0, r  # no spills
        assert r["pipelined_loads"] > 0, r

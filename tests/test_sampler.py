"""Batched sampler: greedy paths, seeded counter-based draws, filters, penalties, masks, logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import plait.sampling.sampler as sampler_mod
from plait.sampling import SampleOutput, Sampler, SamplingBatchInfo, SamplingParams, counter_uniforms
from plait.sampling.rng import (
    add_gumbel_noise_,
    gumbel_noise_from_keys,
    random_bits,
    row_key_host,
    row_keys,
    triton,
)

sampler = Sampler()
# Chi-square critical value, 7 degrees of freedom, p = 0.001 (draws are seeded, so the test is
# deterministic; the bound only says the fixed outcome is an unremarkable one).
CHI2_DF7_P001 = 24.32


def make_info(
    params: Sequence[SamplingParams],
    vocab: int,
    *,
    seeds: Sequence[int] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    eos: Sequence[int] = (),
) -> SamplingBatchInfo:
    bs = len(params)
    return SamplingBatchInfo.build(
        params,
        seeds=list(seeds) if seeds is not None else list(range(bs)),
        output_ids=output_ids if output_ids is not None else [[] for _ in range(bs)],
        prompt_ids=prompt_ids if prompt_ids is not None else [[] for _ in range(bs)],
        eos_token_ids=eos,
        vocab_size=vocab,
        device="cpu",
    )


def sample_steps(params: SamplingParams, seed: int, logits: torch.Tensor, steps: Sequence[int]) -> torch.Tensor:
    """Draw once per step for one request, all steps as rows of one batch (steps set via output_ids)."""
    n = len(steps)
    info = make_info([params] * n, logits.shape[-1], seeds=[seed] * n, output_ids=[[0] * s for s in steps])
    return sampler(logits.expand(n, -1).contiguous(), info).next_token_ids


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ---------------------------------------------------------------------------------------------------
# Counter-based random numbers
# ---------------------------------------------------------------------------------------------------

_M = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15


def _py_mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def _py_word(seed: int, step: int, stream: int, col: int) -> int:
    k = _py_mix((seed & _M) ^ 0x5851F42D4C957F2D)
    k = _py_mix((k + step * _G) & _M)
    k = _py_mix((k + stream * 0xD1B54A32D192ED03) & _M)
    return _py_mix((k + (col + 1) * _G) & _M)


def test_counter_hash_matches_pure_python_unsigned_reference() -> None:
    # Pins the int64 torch ops (wrapping multiply, masked right shifts) to exact 64-bit arithmetic,
    # the property that makes CPU and CUDA agree.
    seeds = [0, 1, -1, (1 << 63) - 1, -(1 << 63), 123456789]
    steps = [0, 1, 7, 1000, 3, 1 << 40]
    for stream in (0, 5):
        words = random_bits(torch.tensor(seeds), torch.tensor(steps), 6, stream=stream)
        for i, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
            for col in range(6):
                assert int(words[i, col]) & _M == _py_word(seed, step, stream, col)


def test_host_row_keys_equal_device_row_keys() -> None:
    seeds = [0, 1, -1, (1 << 63) - 1, -(1 << 63), 42]
    steps = [0, 1, 2, 1 << 33, 17, 99]
    for stream in (0, 3):
        device = row_keys(torch.tensor(seeds), torch.tensor(steps), stream=stream).tolist()
        host = [row_key_host(a, b, stream) for a, b in zip(seeds, steps, strict=True)]
        assert device == host


def test_batch_info_noise_keys_come_from_seed_and_generated_count() -> None:
    info = make_info([SamplingParams()] * 2, 10, seeds=[5, (1 << 64) - 3], output_ids=[[1, 2, 3], []])
    assert info.noise_keys.tolist() == [row_key_host(5, 3), row_key_host(-3, 0)]


def test_with_steps_equals_a_fresh_build_at_those_steps() -> None:
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0)]
    moved = make_info(params, 10, seeds=[5, 9], output_ids=[[1], [2, 3]]).with_steps([4, 7])
    fresh = make_info(params, 10, seeds=[5, 9], output_ids=[[0] * 4, [0] * 7])
    assert moved.steps.tolist() == fresh.steps.tolist() == [4, 7]
    assert moved.noise_keys.tolist() == fresh.noise_keys.tolist()
    assert torch.equal(moved.top_ks, fresh.top_ks) and moved.all_greedy == fresh.all_greedy


def test_with_steps_refuses_infos_that_read_output_tokens() -> None:
    penalised = make_info([SamplingParams(repetition_penalty=1.2)], 10, output_ids=[[1]])
    under_min = make_info([SamplingParams(min_new_tokens=3)], 10, output_ids=[[1]], eos=[2])
    for info in (penalised, under_min):
        assert not info.reusable_next_step
        with pytest.raises(ValueError, match="reusable"):
            info.with_steps([2])


def test_uniforms_are_strictly_inside_unit_interval_and_uniform() -> None:
    u = counter_uniforms(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert u.dtype == torch.float64
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u.float(), bins=10, min=0.0, max=1.0) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.005


def test_uniforms_depend_only_on_seed_step_and_column() -> None:
    seeds = torch.tensor([11, 22, 33])
    steps = torch.tensor([4, 5, 6])
    together = counter_uniforms(seeds, steps, 100)
    for i in range(3):
        alone = counter_uniforms(seeds[i : i + 1], steps[i : i + 1], 100)
        assert torch.equal(alone[0], together[i])
    assert torch.equal(counter_uniforms(seeds, steps, 10), together[:, :10])


def test_streams_give_different_uniforms() -> None:
    seeds, steps = torch.tensor([9]), torch.tensor([0])
    assert not torch.equal(counter_uniforms(seeds, steps, 32), counter_uniforms(seeds, steps, 32, stream=1))


def _under_interpreter(script: str, extra_env: dict[str, str] | None = None) -> str:
    """Run ``script`` in a fresh process under the Triton interpreter (TRITON_INTERPRET is read when kernels
    are decorated); its stdout, which must end with "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1", **(extra_env or {})}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ok"), done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(triton is None, reason="triton is not installed")
def test_triton_noise_kernel_matches_torch_under_the_interpreter() -> None:
    _under_interpreter("""
        import torch
        from plait.sampling.rng import add_gumbel_noise_, gumbel_noise_from_keys
        keys = torch.tensor([0, -1, 123456789, -(1 << 63)], dtype=torch.int64)
        x = torch.randn(4, 1500, generator=torch.Generator().manual_seed(0))
        fused = add_gumbel_noise_(x.clone(), keys, use_triton=True)
        eager = x + gumbel_noise_from_keys(keys, 1500)
        assert torch.equal(fused, eager), (fused - eager).abs().max()
        print("ok")
        """)


def test_eager_noise_path_adds_gumbel_in_place() -> None:
    keys = torch.tensor([3, 4], dtype=torch.int64)
    x = torch.zeros(2, 7)
    out = add_gumbel_noise_(x, keys, use_triton=False)
    assert out is x and torch.equal(x, gumbel_noise_from_keys(keys, 7))


@pytest.mark.skipif(triton is None, reason="triton is not installed")
def test_one_pass_gumbel_max_draws_the_tokens_of_the_separate_passes() -> None:
    """Over a padded-vocabulary view, several column blocks and a ragged last one, temperatures above and
    below 1: the fused draw equals argmax(x / t + g) bit for bit."""
    _under_interpreter("""
        import torch
        from plait.sampling.rng import add_gumbel_noise_, gumbel_max_sample
        gen = torch.Generator().manual_seed(1)
        buf = torch.randn(6, 9100, generator=gen) * 3
        logits = buf[:, :9000]  # the LM head's padded buffer, sliced to the vocabulary
        temps = torch.tensor([0.3, 0.6, 1.0, 1.7, 0.05, 2.5])
        keys = torch.tensor([0, -1, 123456789, -(1 << 63), 42, 7], dtype=torch.int64)
        fused = gumbel_max_sample(logits, temps, keys)
        separate = add_gumbel_noise_(logits / temps[:, None], keys, use_triton=True).argmax(dim=-1)
        assert torch.equal(fused, separate), (fused, separate)
        print("ok")
        """)


@pytest.mark.skipif(triton is None, reason="triton is not installed")
def test_sampler_with_the_one_pass_draw_gives_the_tokens_it_gives_without_it() -> None:
    """Greedy and temperature rows in one batch take the fused draw; a top-p row sends its batch through
    the separate passes. The sampler draws the same tokens with the switch on and off."""
    script = """
        import json
        import torch
        from plait.sampling import Sampler, SamplingBatchInfo, SamplingParams
        import plait.sampling.sampler as sampler_mod
        calls = []
        fused = sampler_mod.gumbel_max_sample
        sampler_mod.gumbel_max_sample = lambda *a: calls.append(1) or fused(*a)
        def draw(params, logits):
            info = SamplingBatchInfo.build(params, seeds=list(range(len(params))),
                                           output_ids=[[] for _ in params], prompt_ids=[[] for _ in params],
                                           eos_token_ids=(), vocab_size=logits.shape[1], device="cpu")
            return Sampler(use_triton=True)(logits, info).next_token_ids.tolist()
        logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(2)) * 4
        plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6),
                 SamplingParams(temperature=1.3), SamplingParams(temperature=0.6)]
        nucleus = plain[:3] + [SamplingParams(temperature=0.6, top_p=0.9)]
        tokens = draw(plain, logits)
        plain_calls = len(calls)
        print(json.dumps({"plain": tokens, "plain_calls": plain_calls, "nucleus": draw(nucleus, logits),
                          "nucleus_calls": len(calls) - plain_calls}))
        print("ok")
        """
    on, off = (json.loads(_under_interpreter(script, {"PLAIT_FUSED_GUMBEL_MAX": flag}).splitlines()[0])
               for flag in ("1", "0"))
    assert (on["plain_calls"], on["nucleus_calls"], off["plain_calls"]) == (1, 0, 0)
    assert (on["plain"], on["nucleus"]) == (off["plain"], off["nucleus"])


def test_temperature_only_draws_take_the_one_pass_path_by_default(monkeypatch: pytest.MonkeyPatch):
    from plait import envs

    monkeypatch.delenv("PLAIT_FUSED_GUMBEL_MAX", raising=False)
    assert envs.FUSED_GUMBEL_MAX.get() is True
    monkeypatch.setenv("PLAIT_FUSED_GUMBEL_MAX", "0")
    assert envs.FUSED_GUMBEL_MAX.get() is False


# ---------------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------------


def test_temperature_zero_equals_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 3
    out = sampler(logits, make_info(params, 100))
    greedy_rows = [0, 2, 4]
    assert torch.equal(out.next_token_ids[greedy_rows], logits[greedy_rows].argmax(-1))


def test_top_k_one_equals_argmax_at_any_temperature() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.3, top_k=1)] * 16 + [SamplingParams(temperature=0.5)] * 16
    out = sampler(logits, make_info(params, 100))
    assert torch.equal(out.next_token_ids[:16], logits[:16].argmax(-1))


def test_all_greedy_fast_path_skips_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_noise(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the all-greedy path must not draw noise")

    monkeypatch.setattr(sampler_mod, "add_gumbel_noise_", no_noise)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    info = make_info([SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 2, 50)
    assert info.all_greedy
    assert torch.equal(sampler(logits, info).next_token_ids, logits.argmax(-1))


def test_tiny_temperature_is_treated_as_greedy() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    info = make_info([SamplingParams(temperature=1e-9)] * 3, 50)
    assert info.all_greedy
    assert torch.equal(sampler(logits, info).next_token_ids, logits.argmax(-1))


# ---------------------------------------------------------------------------------------------------
# Seeded draws
# ---------------------------------------------------------------------------------------------------


def _coarse_logits(step: int, vocab: int, salt: int) -> torch.Tensor:
    # Rounded to quarters so that ties (as with bf16 logits) sit at the top-k boundary.
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * salt + step))
    return (x * 4).round() / 4


def test_seeded_request_draws_the_same_alone_and_in_any_batch() -> None:
    vocab, n_steps = 64, 8
    target = SamplingParams(temperature=0.8, top_k=5, seed=1234)
    others = {
        "top_p": SamplingParams(temperature=1.0, top_p=0.9),
        "greedy": SamplingParams(temperature=0.0),
        "penalised": SamplingParams(frequency_penalty=0.7, repetition_penalty=1.3, min_new_tokens=3),
        "min_p": SamplingParams(temperature=1.2, min_p=0.1, top_k=40),
    }
    # Batch layouts: the target's position and its neighbours change; "alone" is the reference.
    layouts = [
        ["target"],
        ["top_p", "target", "greedy"],
        ["penalised", "min_p", "top_p", "target"],
        ["target", "penalised"],
        ["greedy", "min_p", "target"],
    ]
    salts = {name: i for i, name in enumerate(["target", *others])}
    results = []
    for layout in layouts:
        histories: dict[str, list[int]] = {name: [] for name in layout}
        for step in range(n_steps):
            params = [target if name == "target" else others[name] for name in layout]
            logits = torch.stack([_coarse_logits(step, vocab, salt=salts[name]) for name in layout])
            info = make_info(
                params,
                vocab,
                seeds=[1234 if name == "target" else 99 + i for i, name in enumerate(layout)],
                output_ids=[histories[name] for name in layout],
                prompt_ids=[[1, 2, 3]] * len(layout),
                eos=[0],
            )
            tokens = sampler(logits, info).next_token_ids.tolist()
            for name, tok in zip(layout, tokens, strict=True):
                histories[name] = histories[name] + [tok]
        results.append(histories["target"])
    assert all(r == results[0] for r in results[1:]), results


def test_different_seeds_draw_different_sequences() -> None:
    logits = torch.zeros(1000)
    steps = list(range(20))
    a = sample_steps(SamplingParams(), 1, logits, steps)
    b = sample_steps(SamplingParams(), 2, logits, steps)
    assert int((a != b).sum()) >= 18  # uniform over 1000 tokens: a collision per step is 1/1000


def test_same_seed_and_step_repeat_exactly() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(4))
    steps = list(range(10))
    a = sample_steps(SamplingParams(temperature=0.9), 77, logits, steps)
    b = sample_steps(SamplingParams(temperature=0.9), 77, logits, steps)
    assert torch.equal(a, b)
    assert len(set(a.tolist())) > 1  # consecutive steps are not one repeated draw


def test_seed_wraps_to_64_bits() -> None:
    logits = torch.zeros(1000)
    steps = list(range(10))
    unsigned = sample_steps(SamplingParams(), (1 << 64) - 1, logits, steps)
    assert torch.equal(unsigned, sample_steps(SamplingParams(), -1, logits, steps))


def test_empirical_distribution_matches_softmax_over_steps() -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7])
    temperature = 0.7
    tokens = sample_steps(SamplingParams(temperature=temperature), 2024, logits, range(5000))
    probs = torch.softmax(logits / temperature, dim=-1)
    freq = torch.bincount(tokens, minlength=8).double() / tokens.numel()
    assert float((freq - probs.double()).abs().max()) < 0.02
    assert chi_square(tokens, probs) < CHI2_DF7_P001


def test_empirical_distribution_matches_softmax_over_seeds() -> None:
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0, 0.8, -1.5, 0.5, 0.1])
    n = 5000
    info = make_info([SamplingParams(temperature=1.3)] * n, 8, seeds=range(n))
    tokens = sampler(logits.expand(n, -1).contiguous(), info).next_token_ids
    assert chi_square(tokens, torch.softmax(logits / 1.3, dim=-1)) < CHI2_DF7_P001


def test_top_p_draws_follow_the_renormalised_nucleus() -> None:
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.06, 0.04, 0.03, 0.02])
    # mass before each token: 0, .35, .60, .75, .85, ...: top_p = 0.8 keeps the first four.
    tokens = sample_steps(SamplingParams(top_p=0.8), 5, probs.log(), range(5000))
    nucleus = torch.cat([probs[:4] / probs[:4].sum(), torch.zeros(4)])
    assert chi_square(tokens, nucleus) < CHI2_DF7_P001


# ---------------------------------------------------------------------------------------------------
# Filters never leave their allowed set
# ---------------------------------------------------------------------------------------------------


def _allowed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference allowed set in float64, following the documented order top_k -> top_p -> min_p."""
    x = logits.double() / p.temperature
    allowed = torch.ones_like(x, dtype=torch.bool)
    if p.top_k > 0:
        allowed &= x >= x.topk(p.top_k).values[-1]
    probs = torch.softmax(x.masked_fill(~allowed, float("-inf")), dim=-1)
    if p.top_p < 1:
        order = probs.argsort(descending=True, stable=True)
        before = probs[order].cumsum(0) - probs[order]
        keep = torch.zeros_like(allowed)
        keep[order] = before <= p.top_p
        allowed &= keep
    if p.min_p > 0:
        allowed &= probs >= p.min_p * probs.max()
    return allowed


def _check_filtered_draws(params: Sequence[SamplingParams], vocab: int = 40, seed: int = 6) -> None:
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * 2
    out = sampler(logits, make_info(params, vocab, seeds=range(len(params))))
    for i, (p, tok) in enumerate(zip(params, out.next_token_ids.tolist(), strict=True)):
        assert _allowed(logits[i], p)[tok], (i, p, tok)


def test_top_k_never_picks_outside_the_k_largest() -> None:
    params = [SamplingParams(top_k=k, temperature=2.0) for k in (2, 3, 5, 7)] * 500
    _check_filtered_draws(params)


def test_top_k_reaches_every_allowed_token() -> None:
    logits = torch.zeros(20)
    logits[[3, 7, 11]] = 1.0
    tokens = sample_steps(SamplingParams(top_k=3), 8, logits, range(300))
    assert set(tokens.tolist()) == {3, 7, 11}


def test_top_p_never_picks_outside_the_nucleus() -> None:
    params = [SamplingParams(top_p=tp) for tp in (0.3, 0.5, 0.8, 0.95)] * 500
    _check_filtered_draws(params)


def test_min_p_never_picks_below_the_relative_floor() -> None:
    params = [SamplingParams(min_p=mp, temperature=1.5) for mp in (0.05, 0.2, 0.5, 0.9)] * 500
    _check_filtered_draws(params)


def test_combined_filters_in_one_batch_stay_inside_each_rows_set() -> None:
    params = [
        SamplingParams(top_k=10, top_p=0.7),
        SamplingParams(top_k=4, min_p=0.3, temperature=0.8),
        SamplingParams(top_p=0.6, min_p=0.1),
        SamplingParams(temperature=0.0),
        SamplingParams(),
    ] * 400
    _check_filtered_draws(params)


def test_top_k_keeps_ties_identically_with_and_without_top_p_rows() -> None:
    # The top_k-only batch uses torch.topk, a batch with a top_p row uses a sort: both must keep
    # every token tied with the k-th.
    row = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.0])
    k_only = make_info([SamplingParams(top_k=2)], 6)
    with_top_p = make_info([SamplingParams(top_k=2), SamplingParams(top_p=0.5)], 6)
    masked_topk = Sampler.warp(row[None], k_only)[0]
    masked_sort = Sampler.warp(torch.stack([row, row]), with_top_p)[0]
    assert torch.equal(masked_topk, masked_sort)
    assert torch.isfinite(masked_topk).tolist() == [True, False, True, True, True, False]


def test_top_p_keeps_tied_values_together() -> None:
    # probabilities .4, .2, .2, .2: mass above the tied group is .4 <= top_p .5, so all three stay
    row = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()
    masked = Sampler.warp(row[None], make_info([SamplingParams(top_p=0.5)], 4))[0]
    assert torch.isfinite(masked).all()
    masked = Sampler.warp(row[None], make_info([SamplingParams(top_p=0.3)], 4))[0]
    assert torch.isfinite(masked).tolist() == [True, False, False, False]


def test_rows_without_top_p_keep_the_whole_vocabulary_in_a_top_p_batch() -> None:
    # float32 prefix sums over a large vocabulary must not trim the tail of a top_p == 1 row.
    logits = torch.randn(2, 150_000, generator=torch.Generator().manual_seed(12)) * 4
    info = make_info([SamplingParams(), SamplingParams(top_p=0.5)], 150_000)
    warped = Sampler.warp(logits, info)
    assert bool(torch.isfinite(warped[0]).all())
    assert not bool(torch.isfinite(warped[1]).all())


def test_top_p_with_top_k_is_the_same_from_a_top_k_prefix_or_a_full_sort() -> None:
    logits = _coarse_logits(0, 200, salt=3)[None]
    p = SamplingParams(top_k=30, top_p=0.6, temperature=0.9)
    prefix_info = make_info([p, SamplingParams(top_k=50)], 200)
    sort_info = make_info([p, SamplingParams(top_p=0.9)], 200)
    assert prefix_info.top_p_within_top_k and not sort_info.top_p_within_top_k
    by_prefix = Sampler.warp(logits.expand(2, -1), prefix_info)[0]
    by_sort = Sampler.warp(logits.expand(2, -1), sort_info)[0]
    assert torch.equal(by_prefix, by_sort)
    assert 1 < int(torch.isfinite(by_sort).sum()) < 30


# ---------------------------------------------------------------------------------------------------
# Penalties and min_new_tokens
# ---------------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5, 3.0], [0.1, 2.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams()]
    info = make_info(params, 5, prompt_ids=[[1], [1]], output_ids=[[2], [2]])
    penalised = Sampler.penalize(logits, info)
    assert penalised[0].tolist() == pytest.approx([0.1, 1.0, -2.0, 0.5, 3.0])
    assert torch.equal(penalised[1], logits[1])  # the row without a penalty is untouched


def test_repetition_penalty_lowers_the_probability_of_a_seen_token() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, -1.0]])
    plain = sampler(logits, make_info([SamplingParams(temperature=0, logprobs=True)], 4))
    params = SamplingParams(temperature=0, logprobs=True, repetition_penalty=1.5)
    penal = sampler(logits, make_info([params], 4, prompt_ids=[[1]]))
    assert plain.next_token_ids.item() == 1 and penal.next_token_ids.item() == 2
    assert plain.logprobs is not None and penal.logprobs is not None
    lp_plain = torch.log_softmax(logits, -1)[0, 1]
    lp_penal = torch.log_softmax(Sampler.penalize(logits, make_info([params], 4, prompt_ids=[[1]])), -1)[0, 1]
    assert lp_penal < lp_plain


def test_frequency_and_presence_penalties_lower_output_tokens_by_the_right_amount() -> None:
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    info = make_info([params], 10, prompt_ids=[[7]], output_ids=[[3, 3, 5]])
    delta = (logits - Sampler.penalize(logits, info))[0]
    expected = torch.zeros(10)
    expected[3] = 0.5 * 2 + 0.25
    expected[5] = 0.5 * 1 + 0.25
    assert torch.allclose(delta, expected, atol=1e-6)  # prompt token 7 is not penalised


def test_negative_presence_penalty_raises_output_tokens() -> None:
    logits = torch.zeros(1, 6)
    info = make_info([SamplingParams(presence_penalty=-1.0)], 6, output_ids=[[4]])
    assert Sampler.penalize(logits, info)[0, 4].item() == pytest.approx(1.0)


def test_sampler_does_not_modify_the_callers_logits() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(8))
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, min_new_tokens=2, top_p=0.5)] * 2
    sampler(logits, make_info(params, 10, output_ids=[[1], [2]], prompt_ids=[[3], [4]], eos=[0]))
    assert torch.equal(logits, before)


def test_min_new_tokens_blocks_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 5.0, 0.0, 0.0, 8.0]])  # eos 2 > stop id 7 > token 4
    params = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=(7,))
    picks = []
    for generated in range(5):
        info = make_info([params], 8, output_ids=[[4] * generated], eos=[2])
        picks.append(sampler(logits, info).next_token_ids.item())
    assert picks == [4, 4, 4, 2, 2]


def test_min_new_tokens_blocks_stop_ids_when_sampling() -> None:
    logits = torch.tensor([4.0, 0.0, 4.0, 0.0, 0.0, 0.0])  # eos 0 and stop id 2 dominate
    params = SamplingParams(min_new_tokens=10, stop_token_ids=(2,))
    n = 500
    info = make_info([params] * n, 6, seeds=range(n), output_ids=[[1] * 3] * n, eos=[0])
    tokens = sampler(logits.expand(n, -1).contiguous(), info).next_token_ids
    assert not bool(((tokens == 0) | (tokens == 2)).any())


def test_min_new_tokens_with_ignore_eos_only_blocks_stop_token_ids() -> None:
    logits = torch.tensor([[9.0, 0.0, 8.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(2,), ignore_eos=True)
    info = make_info([params], 4, eos=[0])
    penalised = Sampler.penalize(logits, info)
    assert penalised[0, 0].item() == 9.0 and penalised[0, 2].item() == float("-inf")


# ---------------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_penalised_logits_at_the_chosen_token() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(9))
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1.4, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, logprobs=True, top_logprobs=1),
    ] * 4
    info = make_info(params, 30, output_ids=[[1, 2, 2]] * 8, prompt_ids=[[5, 6]] * 8)
    out: SampleOutput = sampler(logits, info)
    ref = torch.log_softmax(Sampler.penalize(logits, info), dim=-1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, ref.gather(1, out.next_token_ids[:, None]).squeeze(1))
    # penalised differs from raw, so this checks the penalties were applied first
    assert not torch.allclose(ref, torch.log_softmax(logits, dim=-1))


def test_top_logprobs_are_sorted_and_match_the_best_tokens() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(10))
    params = [
        SamplingParams(logprobs=True, top_logprobs=5),
        SamplingParams(logprobs=True, top_logprobs=2),
    ] * 2
    out = sampler(logits, make_info(params, 30))
    assert out.top_logprobs_ids is not None and out.top_logprobs_vals is not None
    assert out.top_logprobs_ids.shape == (4, 5)
    vals = out.top_logprobs_vals
    assert bool((vals[:, :-1] >= vals[:, 1:]).all())
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(ref.gather(1, out.top_logprobs_ids), vals)
    assert torch.allclose(vals, ref.topk(5, dim=-1).values)


def test_no_logprobs_requested_returns_none() -> None:
    out = sampler(torch.randn(2, 10), make_info([SamplingParams()] * 2, 10))
    assert out.logprobs is None and out.top_logprobs_ids is None and out.top_logprobs_vals is None


# ---------------------------------------------------------------------------------------------------
# Batch construction
# ---------------------------------------------------------------------------------------------------


def test_build_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per request"):
        SamplingBatchInfo.build([SamplingParams()], [1, 2], [[]], [[]], [], 10, "cpu")


def test_build_drops_out_of_range_eos_ids() -> None:
    info = make_info([SamplingParams(min_new_tokens=1)], 10, eos=[3, 50])
    assert info.min_tokens_ids is not None and info.min_tokens_ids.tolist() == [3]


def test_build_records_steps_seeds_and_host_flags() -> None:
    params = [SamplingParams(top_k=5), SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=500)]
    info = make_info(params, 100, seeds=[7, 8, 9], output_ids=[[1, 2], [], [3]])
    assert info.steps.tolist() == [2, 0, 1] and info.seeds.tolist() == [7, 8, 9]
    assert info.top_ks.tolist() == [5, 100, 100]  # greedy rows and k >= vocab are "off"
    assert info.need_top_k and not info.need_top_p and info.max_top_k == 5
    assert info.is_greedy.tolist() == [False, True, False] and not info.all_greedy
    assert info.seen_token_mask is None and info.output_token_counts is None


def test_build_accepts_token_ids_as_arrays_and_tensors() -> None:
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)] * 2
    as_lists = make_info(params, 20, prompt_ids=[[1, 2], [3]], output_ids=[[4, 4], [19, 25]])
    as_arrays = make_info(
        params,
        20,
        prompt_ids=[np.array([1, 2]), torch.tensor([3])],
        output_ids=[torch.tensor([4, 4]), np.array([19, 25])],
    )
    assert as_lists.seen_token_mask is not None and as_arrays.seen_token_mask is not None
    assert torch.equal(as_lists.seen_token_mask, as_arrays.seen_token_mask)
    assert torch.equal(as_lists.output_token_counts, as_arrays.output_token_counts)
    assert as_lists.output_token_counts is not None and as_lists.output_token_counts[0, 4] == 2
    # id 25 is outside the vocabulary and dropped
    assert as_lists.seen_token_mask[1].nonzero().flatten().tolist() == [3, 19]


def test_sampler_rejects_logits_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="logits must have shape"):
        sampler(torch.randn(2, 11), make_info([SamplingParams()] * 2, 10))


# ---------------------------------------------------------------------------------------------------
# CUDA (run on the GPU machine: pytest -m gpu)
# ---------------------------------------------------------------------------------------------------


def _mixed_batch(vocab: int, device: str) -> SamplingBatchInfo:
    params = [
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.05, temperature=1.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(top_k=20, top_p=0.8, frequency_penalty=0.4, min_new_tokens=4),
        SamplingParams(logprobs=True, top_logprobs=3),
    ] * 20
    n = len(params)
    return SamplingBatchInfo.build(params, list(range(n)), [[1, 2, 2]] * n, [[3, 4]] * n, [0], vocab, device)


@pytest.mark.gpu
def test_cuda_noise_is_bit_identical_to_cpu_for_both_kernels() -> None:
    keys = torch.tensor([row_key_host(s, t) for s, t in [(0, 0), (1, 5), (-7, 100), (1 << 62, 3)]])
    cpu = gumbel_noise_from_keys(keys, 50_000)
    eager = gumbel_noise_from_keys(keys.cuda(), 50_000).cpu()
    fused = add_gumbel_noise_(torch.zeros(4, 50_000, device="cuda"), keys.cuda(), use_triton=True).cpu()
    assert torch.equal(cpu, eager)
    assert torch.equal(cpu, fused)


@pytest.mark.gpu
def test_cuda_sampler_draws_the_same_tokens_as_cpu() -> None:
    vocab = 32_000
    cpu_info, gpu_info = _mixed_batch(vocab, "cpu"), _mixed_batch(vocab, "cuda")
    logits = torch.randn(cpu_info.batch_size, vocab, generator=torch.Generator().manual_seed(11)) * 3
    cpu_out = sampler(logits, cpu_info)
    for use_triton in (False, True):
        gpu_out = Sampler(use_triton=use_triton)(logits.cuda(), gpu_info)
        assert torch.equal(cpu_out.next_token_ids, gpu_out.next_token_ids.cpu())
        assert gpu_out.logprobs is not None and cpu_out.logprobs is not None
        assert torch.allclose(cpu_out.logprobs, gpu_out.logprobs.cpu(), atol=1e-5)


@pytest.mark.gpu
def test_cuda_build_and_sample_never_synchronise() -> None:
    vocab = 32_000
    logits = torch.randn(120, vocab, device="cuda")
    _mixed_batch(vocab, "cuda")  # warm-up: first-use initialisation may synchronise
    Sampler()(logits, _mixed_batch(vocab, "cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, _mixed_batch(vocab, "cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.next_token_ids.shape == (120,)


def test_vectorised_row_keys_equal_the_exact_python_hash():
    import random

    from plait.sampling.rng import row_key_host, row_keys_host

    rng = random.Random(0)
    seeds = [rng.getrandbits(64) - (1 << 63) for _ in range(500)]
    steps = [rng.randrange(0, 10_000) for _ in range(500)]
    for stream in (0, 3):
        exact = [row_key_host(a, b, stream) for a, b in zip(seeds, steps, strict=True)]
        assert row_keys_host(seeds, steps, stream) == exact

"""Sampling: validated per-request parameters and the batched device sampler."""

from plait.sampling.params import MAX_TOP_LOGPROBS, SamplingParams, seed_to_int64
from plait.sampling.sampler import (
    GREEDY_TEMPERATURE_EPS,
    SampleOutput,
    Sampler,
    SamplingBatchInfo,
    add_gumbel_noise_,
    counter_uniforms,
    gumbel_noise,
    row_key_host,
)

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "MAX_TOP_LOGPROBS",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParams",
    "add_gumbel_noise_",
    "counter_uniforms",
    "gumbel_noise",
    "row_key_host",
    "seed_to_int64",
]

"""Sampling: validated per-request parameters, the per-batch device state, the counter-based
random numbers and the batched device sampler."""

from plait.sampling.batch_info import SamplingBatchInfo
from plait.sampling.params import GREEDY_TEMPERATURE_EPS, MAX_TOP_LOGPROBS, SamplingParams, seed_to_int64
from plait.sampling.rng import add_gumbel_noise_, counter_uniforms, gumbel_noise, row_key_host
from plait.sampling.sampler import SampleOutput, Sampler, greedy_ids

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "MAX_TOP_LOGPROBS",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParams",
    "add_gumbel_noise_",
    "counter_uniforms",
    "greedy_ids",
    "gumbel_noise",
    "row_key_host",
    "seed_to_int64",
]

"""Constrained decoding on CUDA: xgrammar's GPU mask kernel equals its CPU path, and constrained
requests (greedy and sampled, CUDA graphs on, overlap on) obey their grammar on a tiny model whose
vocabulary is padded past its tokenizer; graphs on and off give the same constrained greedy tokens."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import xgrammar as xgr  # noqa: E402

import plait  # noqa: E402
from plait.sampling import SamplingParams  # noqa: E402
from plait.sampling.grammar import apply_vocab_mask  # noqa: E402
from plait.testing import make_tiny_model  # noqa: E402

GRAMMARS = [
    {"json_schema": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                     "required": ["id", "ok"]}},
    {"regex": r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)"},
    {"ebnf": 'root ::= item (", " item)*\nitem ::= "x" [0-9]+ | "y"'},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0))


def test_gpu_mask_kernel_equals_the_cpu_path() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (64, 49152 // 32), dtype=torch.int32, generator=gen)
    cpu = logits.clone()
    apply_vocab_mask(cpu, mask)
    gpu = logits.cuda()
    apply_vocab_mask(gpu, mask.cuda())
    assert torch.equal(gpu.cpu(), cpu)


def _engine(model_dir: str, **options) -> plait.Engine:
    return plait.Engine(model=model_dir, device="cuda", dtype="float32", max_total_tokens=8192, **options)


def test_constrained_requests_on_cuda_obey_their_grammar_with_graphs(model_dir) -> None:
    prompts = [[5 + i, 17, 33 + i] for i in range(12)]
    params = [{"max_new_tokens": 24, **GRAMMARS[i % 3], **({"temperature": 0.0} if i % 2 else
                                                          {"temperature": 0.9, "seed": i})} for i in range(12)]
    with _engine(model_dir) as engine:
        assert engine.runner.graph_runner is not None
        outs = engine.generate(prompts, params)
        backend = engine.scheduler.grammar_backend
        for p, out in zip(params, outs, strict=True):
            compiled = backend.compile(SamplingParams.from_dict(p).grammar)
            m = xgr.GrammarMatcher(compiled)
            assert all(m.accept_token(t) for t in out.token_ids), (p, out.text)
        greedy_graphs = [o.token_ids for o, p in zip(outs, params, strict=True) if p["temperature"] == 0.0]
    with _engine(model_dir, disable_cuda_graph=True) as eager:
        outs = eager.generate(prompts, params)
        greedy_eager = [o.token_ids for o, p in zip(outs, params, strict=True) if p["temperature"] == 0.0]
    assert greedy_graphs == greedy_eager

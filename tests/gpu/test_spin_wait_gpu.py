"""``PLAIT_SPIN_WAIT`` changes how the host waits for a result copied back from the device, never the
result: host copies read behind queued work are complete, and n-gram speculative and plain greedy
decoding give the same tokens with it as without it (bf16, llama-3.2-1b shape with random weights)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.spec import NGRAM  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402
from plait.transfer import PendingHostCopy, host_tensor  # noqa: E402

VOCAB = SHAPES["llama-3.2-1b"]["vocab_size"]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40}


def test_a_spin_waited_copy_holds_what_the_queued_work_wrote(monkeypatch):
    monkeypatch.setenv("PLAIT_SPIN_WAIT", "1")
    t = torch.zeros(1024, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(2_000_000)  # about a millisecond of queued work before the write
    t.add_(7)
    assert host_tensor(t).eq(7).all()
    torch.cuda._sleep(2_000_000)
    t.add_(1)
    assert (PendingHostCopy.start(t).wait() == 8).all()


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_greedy_tokens_are_the_same_with_spin_waits(shape_dir, monkeypatch, spec):
    prompts = random_prompts(4, 48, VOCAB, seed=3)
    prompts = prompts + prompts  # repeats: the n-gram drafter finds matches
    tokens = {}
    for spin in ("0", "1"):
        monkeypatch.setenv("PLAIT_SPIN_WAIT", spin)
        engine = make_engine(shape_dir, max_running_requests=4, **(NGRAM if spec else {}))
        tokens[spin] = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        engine.shutdown()
    assert tokens["0"] == tokens["1"]

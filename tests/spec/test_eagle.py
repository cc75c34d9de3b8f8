"""EAGLE / EAGLE3 speculative decoding with random-weight heads (plait.models.eagle_heads).

Greedy output equals non-speculative greedy output. Random heads guess badly, so a second check pins
the draft bookkeeping: every chain the engine drafts equals the chain computed from scratch (the
head run over the whole context with the target hiddens from transformers), while the test makes
the verifier accept long prefixes by substituting the true continuation for the head's guesses.
That covers the pending hidden, the draft-extends after plain forwards and after acceptance, and
the multi-step draft loop."""

from __future__ import annotations

import pytest
import torch

from plait.attention.registry import build_backend
from plait.executor.cuda_graph_runner import CudaGraphRunner
from plait.executor.graph_utils import EagerGraph
from plait.executor.verify_graph_runner import VerifyGraphRunner
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.layers.hidden_capture import HiddenCapture
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool
from plait.speculative.tree import DraftTree
from plait.testing import make_eagle_head, make_tiny_model
from tests.conftest import hf_model
from tests.helpers import assert_no_leaks, make_engine, prompt_ids

PROMPTS = prompt_ids(4)
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # EAGLE3 captures layers [2, L//2, L-3]: six layers give [2, 3, 3].
    return make_tiny_model(tmp_path_factory.mktemp("six_layers"), "llama", seed=0, num_hidden_layers=6)


@pytest.fixture(scope="module")
def reference(target):
    return [o.token_ids for o in make_engine(target).generate(PROMPTS, GREEDY)]


def _target_hidden(target, context: list[int], worker) -> torch.Tensor:
    with torch.no_grad():
        hs = hf_model(target)(torch.tensor([context]), output_hidden_states=True).hidden_states
    if worker.is_eagle3:  # hs[i] is the residual-stream input of layer i
        return torch.cat([hs[i][0] for i in worker.capture_layers], dim=-1)
    return hs[-1][0]  # the final normed hidden state


def _chain_from_scratch(target, worker, context: list[int], k: int) -> list[int]:
    """The head over positions 0..L-1 (token p + 1, target hidden p), then k - 1 decode steps."""
    L = len(context) - 1
    hidden = _target_hidden(target, context, worker)[:L]
    n = L + k
    pool = ReqToTokenPool(1, n + 1, "cpu")
    kv = MHATokenToKVPool(n + 1, torch.float32, worker.kv_pool.num_layers, worker.kv_pool.num_kv_heads,
                          worker.kv_pool.head_dim, "cpu")
    backend = build_backend("torch_native", pool, kv, worker.head_num_q_heads)
    pool.write(1, 0, torch.arange(1, n + 1))
    fb = ForwardBatch(ForwardMode.DRAFT_EXTEND, 1, torch.tensor(context[1:]), torch.tensor([1]), torch.tensor([L]),
                      torch.arange(1, L + 1), torch.arange(L), seq_lens_cpu=[L], seq_lens_sum=L,
                      extend=ExtendInfo(num_tokens=L, seq_lens=torch.tensor([L]), prefix_lens=torch.tensor([0]),
                                        start_loc=torch.tensor([0]), seq_lens_cpu=[L], prefix_lens_cpu=[0]))
    ids, h = worker._head(fb, backend, hidden)
    out = [int(ids[-1])]
    h = h[-1:]
    for s in range(1, k):
        pos = L - 1 + s
        fb = ForwardBatch(ForwardMode.DECODE, 1, torch.tensor([out[-1]]), torch.tensor([1]), torch.tensor([pos + 1]),
                          torch.tensor([pos + 1]), torch.tensor([pos]), seq_lens_cpu=[pos + 1], seq_lens_sum=pos + 1)
        ids, h = worker._head(fb, backend, h)
        out.append(int(ids[0]))
    return out


@pytest.mark.parametrize("fmt", ["EAGLE", "EAGLE3"])
def test_random_heads_keep_greedy_output_exact(target, reference, tmp_path, fmt):
    head = make_eagle_head(tmp_path / fmt, target, fmt)
    engine = make_engine(target, speculative_algorithm=fmt, speculative_draft_model_path=str(head),
                         chunked_prefill_size=8)
    engine.generate(PROMPTS[:2], GREEDY)
    outs = engine.generate(PROMPTS, GREEDY)  # prefix-cache hits for the first two
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert engine.scheduler.spec_worker.decode_backend.name == "torch_native"
    assert_no_leaks(engine)


@pytest.mark.parametrize("fmt", ["EAGLE", "EAGLE3"])
def test_drafts_equal_the_head_run_from_scratch_while_long_prefixes_are_accepted(target, reference, tmp_path,
                                                                                fmt):
    head = make_eagle_head(tmp_path / fmt, target, fmt)
    engine = make_engine(target, speculative_algorithm=fmt, speculative_draft_model_path=str(head))
    worker = engine.scheduler.spec_worker
    truth = {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    drafted: list[tuple[list[int], list[int]]] = []
    real_propose = worker.propose

    def propose(sched, reqs, depths):
        trees = real_propose(sched, reqs, depths)
        forced = []
        for req, tree in zip(reqs, trees, strict=True):
            if tree is None:
                forced.append(None)
                continue
            drafted.append((list(req.fill_ids), tree.tokens[1:]))
            # The true continuation, wrong from a varying place on: accept lengths vary.
            n = len(req.output_ids)
            guess = truth[tuple(req.origin_input_ids)][n : n + len(tree.tokens) - 1]
            cut = len(drafted) % (len(guess) + 1)
            guess = guess[:cut] + [(t + 1) % 400 + 4 for t in guess[cut:]]
            forced.append(DraftTree.chain(tree.tokens[0], guess))
        return forced

    worker.propose = propose
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    hist = worker.stats.accept_histogram
    assert hist[0] > 0 and hist[2] + hist[3] > 0
    assert len(drafted) > 10
    for context, chain in drafted:
        assert _chain_from_scratch(target, worker, context, len(chain)) == chain
    assert_no_leaks(engine)


@pytest.mark.parametrize("fmt", ["EAGLE", "EAGLE3"])
def test_tree_expansion_with_one_branch_drafts_the_chain_loops_chain(target, reference, tmp_path, fmt):
    """The device tree expansion (every node recomputed under the ancestor mask, each node reading its
    parent's head output) and the chain loop (one decode per step on the KV) are two computations of
    the same draft: with topk 1 they propose the same chain."""
    head = make_eagle_head(tmp_path / fmt, target, fmt)
    engine = make_engine(target, speculative_algorithm=fmt, speculative_draft_model_path=str(head))
    worker = engine.scheduler.spec_worker
    pairs: list[tuple[list[int], list[int]]] = []
    chain_propose = worker.propose

    def propose(sched, reqs, depths):
        chains = chain_propose(sched, reqs, depths)
        trees = worker._propose_trees(reqs, depths)
        pairs.extend((c.tokens, t.tokens) for c, t in zip(chains, trees, strict=True) if c is not None)
        return chains

    worker.propose = propose
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert len(pairs) > 10 and all(chain == tree for chain, tree in pairs)
    assert_no_leaks(engine)


@pytest.mark.parametrize("fmt", ["EAGLE", "EAGLE3"])
def test_top_k_trees_keep_greedy_output_exact(target, reference, tmp_path, fmt):
    head = make_eagle_head(tmp_path / fmt, target, fmt)
    engine = make_engine(target, speculative_algorithm=fmt, speculative_draft_model_path=str(head),
                         speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert_no_leaks(engine)


def test_target_graphs_write_the_hidden_states_the_head_reads(tmp_path):
    """EAGLE engines replay decode and TARGET_VERIFY graphs (EagerGraph stand-in: replay re-runs the
    recorded function over the static buffers): the target model writes the head's hidden states into
    the capture's static buffer, which a replay writes too. Greedy output stays exact. (EAGLE3 only, one
    short request on the shortest target EAGLE3 accepts, three layers, captured at [2, 1, 0]: the Triton
    interpreter runs every layer; EAGLE's final-norm slot is the same store.)"""
    fmt = "EAGLE3"
    target = make_tiny_model(tmp_path / "three_layers", "llama", seed=0, num_hidden_layers=3)
    reference = [o.token_ids for o in make_engine(target).generate(PROMPTS[:1], {**GREEDY, "max_new_tokens": 8})]
    head = make_eagle_head(tmp_path / fmt, target, fmt)
    engine = make_engine(target, attention_backend="triton", speculative_algorithm=fmt,
                         speculative_draft_model_path=str(head), max_total_tokens=1024)
    runner, worker = engine.runner, engine.scheduler.spec_worker
    cap = runner.hidden_capture
    # What the runner builds on a GPU: a static buffer for the largest graph, then the graphs.
    # (One bucket, two widths: every capture runs the model three times under the interpreter.)
    runner.hidden_capture = worker.capture = HiddenCapture(cap.layers, cap.hidden_size, 4, cap.static.dtype, "cpu")
    runner.graph_runner = CudaGraphRunner(runner.capture_target(), [1], graph_factory=EagerGraph)
    runner.verify_graph_runner = VerifyGraphRunner(runner.capture_target(), [1], (2, 4), graph_factory=EagerGraph)
    outs = engine.generate(PROMPTS[:1], {**GREEDY, "max_new_tokens": 8})
    assert [o.token_ids for o in outs] == reference
    assert sum(g.replays for g in runner.graph_runner.graphs.values()) > 0
    assert sum(g.replays for g in runner.verify_graph_runner.graphs.values()) > 0
    assert worker.capture.static.abs().sum() > 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())
    assert_no_leaks(engine)

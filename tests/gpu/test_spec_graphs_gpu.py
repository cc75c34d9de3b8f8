"""Speculative graphs on the H200 (bf16): TARGET_VERIFY replay vs eager logits on the same batch,
the chain draft loop replay vs eager draft tokens where the draft's margin is clear, the top-k tree
draft replay vs the eager tree expansion, and NGRAM / STANDALONE (chain and tree) engine runs through
the graph runners that end with every KV slot free."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402
from plait.speculative.tree import DraftTree  # noqa: E402
from tests.gpu.test_engine_gpu import release  # noqa: E402
from tests.helpers import count_calls  # noqa: E402

SHAPE = "llama-3.2-1b"
VOCAB = SHAPES[SHAPE]["vocab_size"]
NGRAM = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
         "speculative_num_draft_tokens": 4}


def _prefilled_rows(engine, prompts: list[list[int]]):
    """Rows whose prefixes hold the real KV of ``prompts`` (one plain prefill per prompt)."""
    engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 1})  # warm the engine
    runner = engine.runner
    reqs, slots = [], []
    for p in prompts:
        row = runner.req_to_token_pool.alloc()
        s = runner.allocator.alloc(len(p) + 4)
        runner.req_to_token_pool.write(row, 0, s[: len(p)])
        reqs.append(SimpleNamespace(kv_len=len(p), req_pool_idx=row))
        slots.append(s[len(p):])
    return reqs, torch.cat(slots)


@pytest.mark.parametrize("tree", [DraftTree.chain(11, [12, 13, 14]), DraftTree([11, 12, 13, 14], [-1, 0, 0, 1])])
def test_verify_graph_replay_matches_eager_logits(shape_dir, tree):
    """A chain through the graphs of a top-k 1 engine (captured without a tree mask), a tree through
    those of a top-k 2 engine (with one)."""
    engine = make_engine(shape_dir, **{**NGRAM, "speculative_eagle_topk": 1 if tree.is_chain else 2})
    runner = engine.runner
    graphs = runner.verify_graph_runner
    assert graphs is not None and 4 in graphs.widths
    prompts = random_prompts(5, 96, VOCAB, seed=3)  # bs 5 pads to the 8 bucket
    # Each request's own tokens as its tree, so the logits are not all from one token.
    reqs, slots = _prefilled_rows(engine, prompts)
    trees = [DraftTree([p[-1], *tree.tokens[1:]], tree.parents) for p in prompts]
    batch = lambda: engine.scheduler.spec_worker.build_verify_batch(reqs, trees, slots)  # noqa: E731
    assert graphs.can_run(batch())
    replayed = runner.forward(batch()).next_token_logits.float().clone()
    runner.verify_graph_runner = None
    eager = runner.forward(batch()).next_token_logits.float().clone()
    runner.verify_graph_runner = graphs
    release(engine)
    spread = (replayed - eager).abs().max().item()
    scale = eager.abs().max().item()
    assert replayed.shape == eager.shape == (20, eager.shape[1])
    assert spread <= 2e-2 * scale, f"verify graph vs eager max diff {spread} (logit scale {scale})"


def test_ngram_and_standalone_engines_replay_both_graph_kinds_and_free_every_slot(shape_dir):
    prompts = random_prompts(6, 64, VOCAB, seed=5)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}
    for spec in (NGRAM, {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": shape_dir}):
        engine = make_engine(shape_dir, **spec)
        engine.generate(prompts, params)
        outs = engine.generate(prompts, params)  # NGRAM: the second pass matches the first
        assert all(len(o.token_ids) == 24 for o in outs)
        assert engine.scheduler.spec_worker.stats.verify_steps > 0
        if spec is not NGRAM:
            assert engine.scheduler.spec_worker.draft_graphs is not None
            # The target as its own draft: bf16 drafts agree with the target almost always.
            assert engine.scheduler.spec_worker.stats.mean_accept_length() > 2.5
        assert engine.scheduler.kv_tokens_in_use() == 0
        assert engine.runner.req_to_token_pool.available_size() == engine.runner.req_to_token_pool.size
        release(engine)


@pytest.mark.parametrize("bs", [1, 4])
def test_chained_ngram_verify_replays_give_the_tokens_unchained_ones_give(shape_dir, bs):
    """A chained verify (launched from the previous one's outcome, before its tokens were committed,
    with the commit running behind the queued replay) runs the batch an unchained step runs: the
    same tokens in bf16, and every slot free afterwards."""
    prompts = random_prompts(6, 64, VOCAB, seed=9)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40}
    runs = []
    for chains in (False, True):
        engine = make_engine(shape_dir, max_running_requests=bs, **NGRAM)
        worker = engine.scheduler.spec_worker
        worker.chains_verify = chains
        engine.generate(prompts, params)
        steps = count_calls(worker, "decode_step")
        v0 = worker.stats.verify_steps
        runs.append([o.token_ids for o in engine.generate(prompts, params)])
        if chains:
            assert worker.stats.verify_steps - v0 > 2 * steps[0]
        assert engine.runner.verify_graph_runner is not None
        assert engine.scheduler.kv_tokens_in_use() == 0
        release(engine)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_verifies_launched_ahead_give_the_tokens_chains_give(shape_dir, bs, monkeypatch):
    """Verifies launched ahead (queued before the previous verify's result is read, tokens and
    positions chosen on the device; PLAIT_SPEC_LAUNCH_AHEAD) run through the verify graphs and give
    the tokens of chained verifies in bf16, with every slot free afterwards. bs 16 plans through the
    extend kernel, the others through decode rows."""
    prompts = random_prompts(bs if bs > 1 else 4, 64, VOCAB, seed=9)

    def launched_ahead(engine, ahead: str) -> None:
        assert (engine.scheduler.spec_worker.stats.launched_ahead > 0) == (ahead == "1")

    off, on = (_second_pass_under(monkeypatch, "PLAIT_SPEC_LAUNCH_AHEAD", value, shape_dir, bs, prompts, launched_ahead)
               for value in ("0", "1"))
    assert off == on


@pytest.mark.parametrize("bs", [1, 4])
def test_verifies_staged_for_their_guess_give_the_tokens_chains_give(shape_dir, bs, monkeypatch):
    """Verifies staged for their guessed outcome while the previous verify runs (PLAIT_SPEC_STAGE_NEXT:
    the graph's buffers filled and planned behind the running replay, launched when the guess holds)
    give the tokens of chained verifies in bf16, with every slot free afterwards."""
    prompts = random_prompts(4, 64, VOCAB, seed=9)

    def staged(engine, stage: str) -> None:
        assert (engine.scheduler.spec_worker.stats.staged["hit"] > 0) == (stage == "1")

    off, on = (_second_pass_under(monkeypatch, "PLAIT_SPEC_STAGE_NEXT", value, shape_dir, bs, prompts, staged)
               for value in ("0", "1"))
    assert off == on


def _second_pass_under(monkeypatch, var: str, value: str, shape_dir, bs: int, prompts, check) -> list[list[int]]:
    """The greedy tokens of an NGRAM engine's second pass over ``prompts`` (it drafts from the first
    pass's outputs) with ``var=value``; ``check(engine, value)`` runs before the engine is released,
    and every KV slot is free after the pass."""
    monkeypatch.setenv(var, value)
    engine = make_engine(shape_dir, max_running_requests=bs, **NGRAM)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40}
    engine.generate(prompts, params)
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    check(engine, value)
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert engine.scheduler.kv_tokens_in_use() == 0
    release(engine)
    return tokens


def test_eagle3_decode_graph_writes_the_hidden_states_an_eager_forward_writes(shape_dir, tmp_path):
    """EAGLE engines capture target graphs: the model writes the head's hidden states (residual inputs
    of layers [2, L//2, L-3]) into the capture's static buffer, and a replay writes the same rows as an
    eager forward of the same batch (bf16 tolerance)."""
    from plait.forward_batch import ForwardBatch, ForwardMode
    from plait.models.eagle_heads import make_eagle_head

    head = make_eagle_head(tmp_path / "eagle3", shape_dir, "EAGLE3", draft_vocab_size=32000)
    engine = make_engine(shape_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head))
    runner = engine.runner
    assert runner.graph_runner is not None and runner.verify_graph_runner is not None
    prompts = random_prompts(3, 64, VOCAB, seed=9)
    reqs, slots = _prefilled_rows(engine, prompts)
    dec_slots = slots.view(3, 4)[:, 0].contiguous()
    for r, s in zip(reqs, dec_slots, strict=True):
        runner.req_to_token_pool.write(r.req_pool_idx, r.kv_len, s[None])
    ids = torch.tensor([p[-1] for p in prompts], device="cuda")
    rows = torch.tensor([r.req_pool_idx for r in reqs], device="cuda")
    seq = [r.kv_len + 1 for r in reqs]

    def batch() -> ForwardBatch:
        return ForwardBatch(ForwardMode.DECODE, 3, ids, rows, torch.tensor(seq, device="cuda"), dec_slots,
                            torch.tensor([r.kv_len for r in reqs], device="cuda"), seq_lens_cpu=seq,
                            seq_lens_sum=sum(seq))

    assert runner.graph_runner.can_run(batch())
    runner.forward(batch())
    replayed = runner.hidden_capture.read(3).float().clone()
    graphs, runner.graph_runner = runner.graph_runner, None
    runner.forward(batch())
    eager = runner.hidden_capture.read(3).float().clone()
    runner.graph_runner = graphs
    release(engine)
    assert replayed.shape == (3, 3 * SHAPES[SHAPE]["hidden_size"])
    scale = eager.abs().max().item()
    assert scale > 0 and (replayed - eager).abs().max().item() <= 2e-2 * scale


TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}


def test_tree_draft_graph_replay_matches_the_eager_tree_expansion(shape_dir):
    """The top-k tree expansion replayed from its graph (bs 5 pads to the 8 bucket) against the eager
    expansion of the same inputs. bf16: a level's best scores are continuous in the logits, so the
    root's children's scores agree within rounding everywhere; whole expansions (tokens, parents) may
    part only where a k-th and (k + 1)-th candidate tie within rounding, so most requests agree
    exactly, and there every cumulative score agrees within bf16 rounding of its size."""
    from plait.speculative.tree_draft_graph import TreeDraftInputs

    engine = make_engine(shape_dir, speculative_algorithm="STANDALONE", speculative_draft_model_path=shape_dir,
                         **TREE)
    worker = engine.scheduler.spec_worker
    graphs = worker.tree_graphs
    assert graphs is not None and worker.draft_graphs is None and graphs.can_run(5, 3)
    prompts = random_prompts(5, [40, 64, 90, 17, 120], VOCAB, seed=11)  # mixed prefix lengths
    reqs, _ = _prefilled_rows(engine, prompts)
    inp = TreeDraftInputs(use=list(range(5)), prefix=[r.kv_len for r in reqs], rows=[r.req_pool_idx for r in reqs],
                          roots=torch.tensor([p[-1] for p in prompts], device="cuda"), max_depths=[3] * 5)
    replayed = graphs.replay(inp).clone()
    bucket = graphs.last_views[0].batch_size
    eager = worker._expand_eager(inp)
    release(engine)
    assert bucket == 8 and replayed.shape == eager.shape == (5, 3 * 7)
    nodes, scores_r, scores_e = replayed[:, :14], replayed[:, 14:], eager[:, 14:]
    # Log-probability units. Random weights give peaked logits, so deep cumulative scores reach hundreds;
    # bf16 hidden states (8 mantissa bits) put a relative error on every logit: the tolerance grows with
    # the score's size (1e-3 of it, a quarter of bf16's unit roundoff).
    tol = 5e-2 + 1e-3 * scores_e.abs()
    assert ((scores_r[:, 1:3] - scores_e[:, 1:3]).abs() <= tol[:, 1:3]).all()
    same = [b for b in range(5) if torch.equal(nodes[b], eager[b, :14])]
    assert len(same) >= 4, f"only requests {same} expand the same tree on both paths"
    assert ((scores_r[same] - scores_e[same]).abs() <= tol[same]).all(), (scores_r[same] - scores_e[same]).abs().max()


def test_standalone_tree_engine_replays_the_tree_graphs_and_frees_every_slot(shape_dir):
    prompts = random_prompts(6, 64, VOCAB, seed=5)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}
    engine = make_engine(shape_dir, speculative_algorithm="STANDALONE", speculative_draft_model_path=shape_dir,
                         **TREE)
    outs = engine.generate(prompts, params)
    worker = engine.scheduler.spec_worker
    assert all(len(o.token_ids) == 24 for o in outs)
    assert worker.tree_graphs is not None and worker.tree_graphs.last_views  # replayed at least once
    # The target as its own draft: bf16 drafts agree with the target almost always.
    assert worker.stats.mean_accept_length() > 2.5
    assert engine.scheduler.kv_tokens_in_use() == 0
    assert engine.runner.req_to_token_pool.available_size() == engine.runner.req_to_token_pool.size
    release(engine)


@pytest.mark.parametrize("bs", [1, 4])
def test_segmented_verify_graphs_give_the_tokens_one_graph_gives(shape_dir, bs, monkeypatch):
    """Verify graphs captured as segments cut before decoder layers 1, 3 and 7 (PLAIT_SEGMENTED_VERIFY_GRAPHS)
    replay the forward one graph replays: the same greedy tokens in bf16, every slot free afterwards."""
    from plait.executor.graph_utils import SegmentedCudaGraph

    def segmented(engine, value: str) -> None:
        graphs = engine.runner.verify_graph_runner
        assert graphs is not None
        if value == "1":
            assert {type(g) for g in graphs.graphs.values()} == {SegmentedCudaGraph}
            assert {len(g.segments) for g in graphs.graphs.values()} == {4}  # 16 layers: cuts at 1, 3, 7
        else:
            assert not any(isinstance(g, SegmentedCudaGraph) for g in graphs.graphs.values())

    prompts = random_prompts(4, 64, VOCAB, seed=11)
    one, segments = (_second_pass_under(monkeypatch, "PLAIT_SEGMENTED_VERIFY_GRAPHS", value, shape_dir, bs, prompts,
                                        segmented) for value in ("0", "1"))
    assert one == segments

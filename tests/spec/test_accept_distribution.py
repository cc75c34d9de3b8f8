"""Sampled acceptance keeps the target distribution (function level, not the engine).

On a vocabulary of 4 tokens, a target model is a root distribution p0 and a conditional table
p(y | x). Each trial runs the acceptance routine on a draft (chain or tree; one-hot drafts, or
drafts sampled from a soft draft distribution q) and reads the first two emitted tokens; when a step
emits only one, a second step (again drafted and accepted) supplies the next. Over 20000 trials
the joint of the two positions must match p0(x) p(y | x) by a chi-square test at p > 0.001.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from plait.speculative.accept import (
    child_token_table,
    greedy_accept,
    one_hot_decisions,
    tree_accept_sampled,
    walk_decisions,
)
from plait.speculative.tree import DraftTree

V = 4
TRIALS = 20000


def _dirichlet(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.dirichlet(np.ones(V) * 0.8, size=shape)


class Toy:
    """Target p0 / p(y|x) and draft q0 / q(y|x), all different from each other."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.p0, self.p = _dirichlet(rng, ()), _dirichlet(rng, (V,))
        self.q0, self.q = _dirichlet(rng, ()), _dirichlet(rng, (V,))

    def target_at(self, root_dist: np.ndarray, tree: DraftTree) -> np.ndarray:
        """Target distribution at every node: the root's is given, a node with token x has p(.|x)."""
        return np.stack([root_dist] + [self.p[t] for t in tree.tokens[1:]])


def _one_hot_tree(rng: np.random.Generator, root: int, branching: list[int]) -> DraftTree:
    """Deterministic (one-hot) guesses: ``branching[d]`` children per node at depth d, tokens
    chosen without regard to the target (so both acceptance and rejection are exercised)."""
    tokens, parents, frontier = [root], [-1], [0]
    for width in branching:
        nxt = []
        for node in frontier:
            for tok in rng.choice(V, size=width, replace=False):
                tokens.append(int(tok))
                parents.append(node)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(tokens, parents)


def _sampled_tree(rng: np.random.Generator, toy: Toy, root: int, root_q: np.ndarray,
                  branching: list[int]) -> tuple[DraftTree, np.ndarray]:
    """Guesses drawn from the draft: siblings independently from their parent's q."""
    tokens, parents, qs, frontier = [root], [-1], [np.full(V, 1.0 / V)], [(0, root_q)]
    for width in branching:
        nxt = []
        for node, q in frontier:
            for _ in range(width):
                tok = int(rng.choice(V, p=q))
                tokens.append(tok)
                parents.append(node)
                qs.append(q)
                nxt.append((len(tokens) - 1, toy.q[tok]))
        frontier = nxt
    return DraftTree(tokens, parents), np.stack(qs)


def _step(rng: np.random.Generator, toy: Toy, root: int, root_p: np.ndarray, root_q: np.ndarray,
          branching: list[int], soft: bool) -> list[int]:
    if soft:
        tree, q = _sampled_tree(rng, toy, root, root_q, branching)
    else:
        tree, q = _one_hot_tree(rng, root, branching), None
    u = rng.random((tree.width, max(branching) + 1))
    path, bonus = tree_accept_sampled(tree, toy.target_at(root_p, tree), u, q)
    return tree.path_tokens(path[1:]) + [bonus]


def _joint_counts(toy: Toy, branching: list[int], soft: bool, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    root = 0  # the token before the two positions; its value only names the root node
    for _ in range(TRIALS):
        out = _step(rng, toy, root, toy.p0, toy.q0, branching, soft)
        if len(out) < 2:
            x = out[0]
            out = out + _step(rng, toy, x, toy.p[x], toy.q[x], branching, soft)[:1]
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("branching", [[1, 1, 1], [2, 2]], ids=["chain", "tree"])
@pytest.mark.parametrize("soft", [False, True], ids=["one-hot", "soft"])
def test_sampled_acceptance_preserves_the_joint_of_two_positions(branching, soft):
    toy = Toy(seed=3)
    counts = _joint_counts(toy, branching, soft, seed=11)
    expected = toy.p0[:, None] * toy.p  # P(x, y) = p0(x) p(y | x)
    keep = expected.flatten() > 0
    result = chisquare(counts.flatten()[keep], expected.flatten()[keep] * TRIALS)
    assert result.pvalue > 0.001, (counts / TRIALS, expected)


def _device_steps(rng: np.random.Generator, toy: Toy, roots: list[int], root_ps: np.ndarray,
                  branching: list[int]) -> list[list[int]]:
    """One step of many independent trials through the engine's device rule (``one_hot_decisions``
    over every node at once, then the host walk): the emitted tokens of each trial."""
    trees = [_one_hot_tree(rng, root, branching) for root in roots]
    probs = np.concatenate([toy.target_at(p, t) for p, t in zip(root_ps, trees, strict=True)])
    cols = max(branching)
    children = torch.tensor(child_token_table(trees, cols)).view(-1, cols)
    rows = probs.shape[0]
    with np.errstate(divide="ignore"):
        scores = torch.from_numpy(np.log(probs)).float()
    uniforms = torch.from_numpy(rng.random((rows, cols)))
    keys = torch.from_numpy(rng.integers(-(2**62), 2**62, size=rows))
    decisions = one_hot_decisions(scores, children, uniforms, keys).numpy()
    out, k = [], 0
    for t in trees:
        path, bonus = walk_decisions(t, decisions[k : k + t.width])
        out.append(t.path_tokens(path[1:]) + [bonus])
        k += t.width
    return out


@pytest.mark.parametrize("branching", [[1, 1, 1], [2, 2]], ids=["chain", "tree"])
def test_device_one_hot_rule_preserves_the_joint_of_two_positions(branching):
    toy = Toy(seed=3)
    rng = np.random.default_rng(17)
    outs = _device_steps(rng, toy, [0] * TRIALS, np.stack([toy.p0] * TRIALS), branching)
    short = [i for i, o in enumerate(outs) if len(o) < 2]
    firsts = [outs[i][0] for i in short]
    seconds = _device_steps(rng, toy, firsts, toy.p[firsts], branching)
    for i, nxt in zip(short, seconds, strict=True):
        outs[i] = outs[i] + nxt[:1]
    counts = np.zeros((V, V))
    for o in outs:
        counts[o[0], o[1]] += 1
    expected = (toy.p0[:, None] * toy.p).flatten() * TRIALS
    assert chisquare(counts.flatten(), expected).pvalue > 0.001, counts / TRIALS


def test_device_rule_without_children_draws_what_the_plain_sampler_draws():
    """A node with no children (a request riding along without a draft) gets the plain sampler's
    token for the same keys: argmax of scores plus the same Gumbel noise."""
    from plait.sampling import add_gumbel_noise_, greedy_ids

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 50, generator=gen)
    keys = torch.arange(64, dtype=torch.int64) * 7919
    decisions = one_hot_decisions(scores, torch.full((64, 1), -1), torch.rand(64, 1, generator=gen).double(), keys)
    plain = greedy_ids(add_gumbel_noise_(scores.clone(), keys))
    assert torch.equal(decisions[:, 0], torch.zeros(64, dtype=torch.int64))
    assert torch.equal(decisions[:, 1], plain)


def test_a_repeated_sibling_token_is_never_accepted():
    """Siblings 7, 7: the walk zeroed p(7) at the first, so the second may not be taken even when
    its uniform is tiny."""
    scores = torch.zeros(1, 10)  # p uniform
    children = torch.tensor(child_token_table([_tree_with_children([7, 7])], 2)).view(-1, 2)[:1]
    decisions = one_hot_decisions(scores, children, torch.tensor([[0.99, 1e-9]], dtype=torch.float64),
                                  torch.tensor([3]))
    assert children.tolist() == [[7, -1]]
    assert decisions[0, :2].tolist() == [0, 0] and decisions[0, 2].item() != 7


def _tree_with_children(tokens: list[int]) -> DraftTree:
    return DraftTree([0, *tokens], [-1] + [0] * len(tokens))


def test_a_wrong_rule_is_caught_by_the_same_check():
    """The test has teeth: always accepting one-hot drafts (ignoring p) fails it."""
    toy = Toy(seed=3)
    rng = np.random.default_rng(5)
    counts = np.zeros((V, V))
    for _ in range(TRIALS):
        tree = _one_hot_tree(rng, 0, [1, 1])
        counts[tree.tokens[1], tree.tokens[2]] += 1
    expected = (toy.p0[:, None] * toy.p).flatten() * TRIALS
    assert chisquare(counts.flatten(), expected).pvalue < 1e-6


def test_greedy_acceptance_follows_the_longest_matching_path():
    # root -> a(5) -> c(7);  root -> b(6) -> d(8) -> e(9)
    tree = DraftTree([1, 5, 6, 7, 8, 9], [-1, 0, 0, 1, 2, 4])
    # target argmax per node: root wants 6, b wants 8, d wants 9, e wants 3.
    path, bonus = greedy_accept(tree, [6, 0, 8, 0, 9, 3])
    assert path == [0, 2, 4, 5] and bonus == 3
    path, bonus = greedy_accept(tree, [4, 0, 0, 0, 0, 0])
    assert path == [0] and bonus == 4

"""Draft attention backends: a factory that chooses the draft's backend and names what it built.

``DraftBackendFactory`` builds the draft model's backends over the draft KV pool (which shares
``req_to_token`` with the target). The choice of backend is made here and nowhere else
(``draft_backend_name``): ``--speculative-draft-attention-backend`` if set, else the half of the
target's (prefill, decode) pair that ``--speculative-attention-mode`` names (prefill by default),
for the draft's decode steps and its extends alike. Every backend it returns,
each per-step child of a multi-step container included, carries the effective kernel name the
registry stamped on it when it was built (wrappers such as the PLAIT_CHECK_PLANS checker copy the
stamp of what they wrap), so code that asks "which kernel serves draft step 2" reads the truth; the
container is named after its children.

``MultiStepDraftBackend`` holds one child per draft step. All steps of a draft loop are planned
before the loop runs (the sequence lengths of every step are known up front: step s attends to
``prefix + s + 1`` positions), each step's batch is marked right after its plan, and
the loop's forwards then run on those plans without planning again (docs/architecture.md, the
batch carries its plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.attention.base import AttentionBackend
from plait.attention.plan_check import maybe_check_plans
from plait.attention.registry import build_backend
from plait.config import EngineConfig
from plait.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool


class MultiStepDraftBackend:
    """One backend per draft step; ``name`` is the effective kernel name of the steps."""

    def __init__(self, children: list[AttentionBackend], name: str) -> None:
        self.children = children
        self.name = name

    def plan_steps(self, batches: list[ForwardBatch]) -> None:
        """Plan every step's batch on its own child and mark it (the multi-step pre-planning site)."""
        if len(batches) > len(self.children):
            raise ValueError(f"{len(batches)} draft steps but {len(self.children)} per-step backends")
        for child, fb in zip(self.children, batches, strict=False):
            fb.attn_backend = child
            child.init_forward_metadata(fb)
            fb.mark_forward_metadata_ready()

    def plan_steps_out_graph(self, batches: list[ForwardBatch], in_capture: bool = False) -> None:
        """The graph half of ``plan_steps``: host-side planning of every step's (padded) batch on its
        own child, each batch marked; the children's ``in_graph`` runs inside the captured loop."""
        if len(batches) > len(self.children):
            raise ValueError(f"{len(batches)} draft steps but {len(self.children)} per-step backends")
        for child, fb in zip(self.children, batches, strict=False):
            fb.attn_backend = child
            child.init_forward_metadata_out_graph(fb, in_capture)
            fb.mark_forward_metadata_ready()


def draft_backend_name(config: EngineConfig) -> str:
    """The backend the draft model runs on, for draft decode steps and draft extends alike."""
    if config.speculative_draft_attention_backend is not None:
        return config.speculative_draft_attention_backend
    prefill, decode = config.attention_backends()
    return decode if config.speculative_attention_mode == "decode" else prefill


class DraftBackendFactory:
    def __init__(self, config: EngineConfig, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool,
                 num_q_heads: int) -> None:
        self.requested = draft_backend_name(config)
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads

    def _create_backend(self) -> AttentionBackend:
        # build_backend stamps the leaf's effective name; the checker wrapper copies it.
        return maybe_check_plans(build_backend(self.requested, self.req_to_token_pool, self.kv_pool, self.num_q_heads))

    def create_extend_backend(self) -> AttentionBackend:
        """Serves the draft's extends (mirrored prefills, draft-extend over accepted tokens)."""
        return self._create_backend()

    def create_decode_backend(self, num_steps: int) -> MultiStepDraftBackend:
        """One backend per draft step (the draft's decode steps and tree-expansion steps)."""
        children = [self._create_backend() for _ in range(num_steps)]
        return MultiStepDraftBackend(children, children[0].name)

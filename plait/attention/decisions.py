"""Where backend-dependent decisions live, and the check that they read the backend *pair*.

SGLang shipped bugs where only ``--prefill-attention-backend`` or ``--decode-attention-backend`` was
set and a decision read the base ``--attention-backend`` field instead. Every module
listed here decides something from the attention backend; it must read ``attention_backends()`` and
the half it needs, never the base field. ``tests/test_backend_decisions.py`` walks these modules.
"""

from __future__ import annotations

import ast

# module -> the decision it makes (and the half it needs)
DECISION_MODULES: dict[str, str] = {
    "plait.executor.model_runner": "which backends to build, the (prefill, decode) pair; logged at start",
    "plait.executor.cuda_graph_runner": "graph buffers and padded-row fill value: decode half",
    "plait.executor.verify_graph_runner": "verify graph state: the half the speculative mode selects",
    "plait.attention.registry": "building each half by name",
    "plait.attention.hybrid": "which half serves a forward mode",
    "plait.layers.radix_attention": "KV write path (rotary kernel or backend store): the half serving the batch",
    "plait.speculative.draft_backend": "the draft's backend: the draft flag, else the half the speculative mode names",
}
# Not decisions here: prefix-cache chunking (every backend extends over a cached prefix, so the
# scheduler chunks the same way for all of them).

BASE_FIELD = "attention_backend"


def reads_of_base_field(source: str) -> list[int]:
    """Line numbers where ``source`` reads an attribute named ``attention_backend`` (the base field)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr == BASE_FIELD and isinstance(node.ctx, ast.Load)]

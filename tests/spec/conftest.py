"""Speculative tests run with the plan checker on (docs/architecture.md §3.1): a forward on a stale plan raises."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _check_plans(monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")


@pytest.fixture(scope="session")
def chain_reference(one_layer):
    """Non-speculative greedy outputs of ``chain_cases.PROMPTS`` (the chained verifies' reference)."""
    from tests.helpers import make_engine
    from tests.spec.chain_cases import GREEDY, PROMPTS

    return [o.token_ids for o in make_engine(one_layer).generate(PROMPTS, GREEDY)]

"""Speculative tests run with the plan checker on (docs/architecture.md §3.1): a forward on a stale plan raises."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _check_plans(monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")

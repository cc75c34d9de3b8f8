"""The speculative worker an engine configuration asks for (None when speculation is off).

Whoever builds a ``Scheduler`` calls ``create_spec_worker`` and hands the worker to it, so the
scheduler floor never imports this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.config import EngineConfig
from plait.speculative.worker import BaseSpecWorker

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner


def create_spec_worker(config: EngineConfig, runner: ModelRunner) -> BaseSpecWorker | None:
    # Imported on demand: a draft-model worker pulls in model loading that n-gram engines never need.
    algo = config.speculative_algorithm
    if algo is None:
        return None
    if algo == "NGRAM":
        from plait.speculative.ngram import NgramWorker

        return NgramWorker(config, runner)
    if algo == "STANDALONE":
        from plait.speculative.standalone import StandaloneWorker

        return StandaloneWorker(config, runner)
    from plait.speculative.eagle import EagleWorker

    return EagleWorker(config, runner)

"""Shared GPU-test fixtures: the llama-3.2-1b shape written once per module (random weights are
drawn at load, `load_format="dummy"`)."""

from __future__ import annotations

import tempfile

import pytest

from plait.bench.shapes import write_shape_dir

SHAPE = "llama-3.2-1b"


@pytest.fixture(scope="module")
def shape_dir() -> str:
    return str(write_shape_dir(tempfile.mkdtemp(), SHAPE))

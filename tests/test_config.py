"""EngineConfig is frozen in fact: construction only checks, never rewrites a field; the values an
algorithm derives (the speculative numbers) are filled by ``from_kwargs`` before construction."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from plait.config import SPECULATIVE_DERIVED_FIELDS, EngineConfig

CONFIG_SOURCE = pathlib.Path(__file__).resolve().parents[1] / "plait" / "config.py"


def test_construction_with_defaults_leaves_every_field_as_declared():
    cfg = EngineConfig(model="m")
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model":
            assert getattr(cfg, f.name) == f.default, f.name


def test_from_kwargs_fills_the_speculative_numbers_before_construction():
    cfg = EngineConfig.from_kwargs(model="m", speculative_algorithm="NGRAM", speculative_num_steps=2)
    assert {name: getattr(cfg, name) for name in SPECULATIVE_DERIVED_FIELDS} == {
        "speculative_num_steps": 2, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3}


def test_rebuilding_a_config_from_its_own_fields_gives_the_same_config():
    cfg = EngineConfig.from_kwargs(model="m", speculative_algorithm="EAGLE", speculative_draft_model_path="d",
                                   speculative_eagle_topk=2)
    assert EngineConfig(**vars(cfg)) == cfg
    assert cfg.replace() == cfg


def test_from_kwargs_accepts_unset_numbers_spelled_as_none():
    # The CLI passes every option, unset ones as None.
    cfg = EngineConfig.from_kwargs(model="m", speculative_algorithm="NGRAM", speculative_num_steps=None,
                                   speculative_eagle_topk=None, speculative_num_draft_tokens=None)
    assert cfg.speculative_num_draft_tokens == 4


def test_direct_construction_with_an_unset_speculative_number_fails_naming_the_flag_and_from_kwargs():
    with pytest.raises(ValueError, match="--speculative-num-steps.*from_kwargs"):
        EngineConfig(model="m", speculative_algorithm="NGRAM")


def test_a_constructed_config_rejects_assignment():
    cfg = EngineConfig(model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]


def test_the_config_module_never_writes_attributes_around_the_frozen_dataclass():
    calls = [node for node in ast.walk(ast.parse(CONFIG_SOURCE.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "__setattr__"]
    assert calls == []


@pytest.mark.parametrize("device", ["cuda:1", "gpu", "mps", ""])
def test_a_device_plait_does_not_run_on_fails_listing_the_devices(device):
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(model="m", device=device)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_fails_at_start_saying_what_to_use(tiny_model_dir):
    import plait

    with pytest.raises(RuntimeError, match="torch sees no CUDA device.*--device cpu"):
        plait.Engine(model=str(tiny_model_dir("llama")), device="cuda", max_total_tokens=256)

"""A family must classify every parameter it hands to megatron_tp: one that its
layer map names neither as a split linear nor as replicated is an error at
set-up naming it, never a silent full copy on every TP rank."""

from __future__ import annotations

import dataclasses

import pytest
from toy_encoder import ToyEncoderFamily
from tp_cases import family_cls

from disagg_llm_tp.parallelize import parallelize_module, unclassified_parameters


@pytest.mark.parametrize("key,family", [("qwen2", "qwen2"), ("llama", "llama"), ("qwen2_5_vl", "qwen2_5_vl")])
def test_first_party_families_declare_every_parameter(tiny_dirs, key, family):
    fam = family_cls(family)(tiny_dirs[key])
    assert unclassified_parameters(fam.build(), fam.layer_map()) == []


def test_undeclared_parameter_fails_with_its_name():
    fam = ToyEncoderFamily(".")
    lmap = fam.layer_map()
    assert unclassified_parameters(fam.build(), lmap) == []
    # The family forgets its norm: set-up refuses before anything is split.
    bare = dataclasses.replace(lmap, replicated=())
    with pytest.raises(ValueError, match=r"does not classify parameter\(s\) norm\.weight, norm\.bias;"):
        parallelize_module(fam.build(), bare, shard=0, degree=2, config=None, comm=None)  # type: ignore[arg-type]

"""The shared table of per-method test knobs (tests/method_knobs.py) names every registered method,
and each entry is a valid configuration of its method."""
import pytest

import sparsevllm
from method_knobs import METHOD_KNOBS
from sparsevllm.method_registry import make_config


def test_the_knob_table_names_every_registered_method():
    assert sorted(METHOD_KNOBS) == sorted(sparsevllm.available_methods())


@pytest.mark.parametrize("method", sorted(METHOD_KNOBS))
def test_each_methods_table_knobs_are_accepted(method):
    # dummy weights: DeltaKV then needs no trained compressor, which the tests build for their model
    make_config(None, method, load_format="dummy", **METHOD_KNOBS[method])

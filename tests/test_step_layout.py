"""The C++ step's argument layout, written once in ``wiola.fast.step_layout``: the table's enum
names are the C++ enums in order, the compiled library reports the same lengths (and a library
that does not is refused by name), every slot names a tensor of the model with the table's shape,
and ``wiola.fast.quantize`` packs exactly the table's matrices."""

from __future__ import annotations

import dataclasses
import re

import pytest

import wiola
import wiola.fast
from wiola.fast import quantize
from wiola.fast import step_layout as layout

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")


def _enum(name: str) -> list[str]:
    source = decode_step_cpu.SOURCE.read_text()
    body = re.search(r"enum " + name + r" \{([^}]*)\}", source)
    assert body, f"enum {name} not found in {decode_step_cpu.SOURCE.name}"
    return [item.strip() for item in body.group(1).split(",") if item.strip()]


def test_table_names_the_cpp_enums_in_order():
    assert _enum("Global") == [s.enum for s in layout.GLOBALS] + ["kNumGlobal"]
    assert _enum("PerLayer") == [s.enum for s in layout.PER_LAYER] + ["kPerLayer"]
    assert len(_enum("State")) == len(layout.STATE) + 1 and len(_enum("Dim")) == len(layout.DIMS) + 1


def test_library_reports_the_table_and_a_drift_is_refused():
    assert decode_step_cpu.load() is not None, decode_step_cpu.BUILD_ERROR  # load checks the counts
    layout.check_counts(layout.counts(), "here")
    names = ("dims", "global slots", "slots per layer", "cache buffers")
    for i, name in enumerate(names):  # a drift in any one of the four counts, either way
        for step in (1, -1):
            bad = list(layout.counts())
            bad[i] += step
            with pytest.raises(
                RuntimeError, match=rf"lib.so: the compiled step's layout differs .*\({name} {bad[i]} != "
            ):
                layout.check_counts(tuple(bad), "lib.so")
    with pytest.raises(RuntimeError, match=r"lib.so: the compiled step's layout differs .*slots per layer 13 != 12"):
        layout.check_counts((*layout.counts()[:2], 13, layout.counts()[3]), "lib.so")


@pytest.mark.parametrize("gate", [True, False])
def test_every_slot_is_a_model_tensor_of_the_table_shape(gate):
    config = dataclasses.replace(
        wiola.WiolaConfig(vocab_size=301, d_model=40, n_layers=2, n_heads=4, d_ff=72), gate=gate
    )
    model = wiola.fast.WiolaModel(config)
    size = layout.sizes(config)
    tensors = decode_step_cpu.step_parameters(model)
    slots = layout.slots(config.n_layers)
    assert len(tensors) == len(slots) == len(layout.GLOBALS) + config.n_layers * len(layout.PER_LAYER)
    for (path, slot), t in zip(slots, tensors, strict=True):
        if slot.gate and not gate:
            assert t is None, path
            continue
        assert tuple(t.shape) == layout.shape(slot.shape, size), f"{path}: {tuple(t.shape)}"
    assert quantize.matrix_names(config.n_layers) == tuple(p for p, s in slots if s.matrix)
    assert [slots[i][0] for i in decode_step_cpu.matrix_slots(config.n_layers)] == list(quantize.matrix_names(2))

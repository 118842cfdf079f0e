"""AIP-134 update masks: an empty mask means the fields populated in the request's
resource (proto3 zero values count as not populated), "*" every field."""

from __future__ import annotations

import pytest

from mneme import apiconv
from mneme.domain import DIRECTIVE_FIELDS, MENTAL_MODEL_FIELDS
from mneme.errors import InvalidArgument
from mneme.v1 import directives_pb2, mental_models_pb2, resources_pb2


def test_an_empty_mask_names_the_populated_fields_and_star_names_all():
    d = directives_pb2.Directive(text="Answer in German.", tags=["de"])
    assert apiconv.update_paths([], DIRECTIVE_FIELDS, d) == ["text", "tags"]
    d.active = False  # optional: set, though false
    d.priority = 0  # a plain scalar at zero: not populated
    assert apiconv.update_paths([], DIRECTIVE_FIELDS, d) == ["text", "active", "tags"]
    assert apiconv.update_paths(["*"], DIRECTIVE_FIELDS, d) == list(DIRECTIVE_FIELDS)
    assert apiconv.update_paths(["priority", "priority"], DIRECTIVE_FIELDS, d) == ["priority"]
    assert apiconv.update_paths([], DIRECTIVE_FIELDS, directives_pb2.Directive()) == []
    m = mental_models_pb2.MentalModel(display_name="n", refresh_policy=mental_models_pb2.MANUAL)
    assert apiconv.update_paths([], MENTAL_MODEL_FIELDS, m) == ["display_name", "refresh_policy"]
    with pytest.raises(InvalidArgument) as e:
        apiconv.update_paths(["text", "colour"], DIRECTIVE_FIELDS, d)
    assert e.value.violations[0][0] == "update_mask.paths[1]"


def test_an_empty_bank_mask_names_display_name_and_each_populated_config_field():
    bank = resources_pb2.Bank(name="banks/b", config=resources_pb2.BankConfig(
        retain_mission="Keep birthdays.", store_documents=False))
    assert apiconv.bank_paths_populated(bank) == ["config.retain_mission",
                                                  "config.store_documents"]
    bank.display_name = "B"
    bank.config.skepticism = 4
    assert apiconv.bank_paths_populated(bank) == [
        "display_name", "config.retain_mission", "config.skepticism", "config.store_documents"]
    assert apiconv.bank_paths_populated(resources_pb2.Bank(name="banks/b")) == []

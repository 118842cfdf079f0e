"""ListOperationsRequest.filter read as the catalog's keywords (services.ingest.grpc_api)."""

import pytest

from mneme.errors import InvalidArgument
from services.ingest.grpc_api import operations_filter


def test_mnemes_names_and_hindsights_select_the_same_operations():
    assert operations_filter('state = "RUNNING" AND kind = "consolidate"') == {
        "state": "running", "kind": "consolidate"}
    # a client moving from Hindsight 1.1 keeps its status and type values
    assert operations_filter("status = processing AND type = consolidation") == {
        "state": "running", "kind": "consolidate"}
    assert operations_filter('status = "completed"') == {"state": "succeeded"}
    assert operations_filter("status = Failed") == {"state": "failed"}


def test_a_status_hindsight_has_and_mneme_does_not_is_refused_naming_filter():
    # Hindsight's "cancelled" is a failed operation with cancel_requested here: selecting
    # every failed one for it would list more than was asked for
    with pytest.raises(InvalidArgument) as e:
        operations_filter('status = "cancelled"')
    assert [f for f, _ in e.value.violations] == ["filter"]

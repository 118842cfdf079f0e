"""mneme.locomo: session ids of dialog ids, for the benchmark's session recall."""

from __future__ import annotations

from mneme import locomo


def test_session_of_and_session_ids():
    assert locomo.session_of("D3:5") == "3"
    assert locomo.session_of(" D12:1 ") == "12"
    assert locomo.session_of("odd") == "odd"
    # distinct sessions in rank order
    assert locomo.session_ids(["D3:5", "D1:2", "D3:7", "D2:1"]) == ["3", "1", "2"]


def test_session_recall_counts_each_evidence_session_once():
    ranked = locomo.session_ids(["D3:5", "D3:6", "D1:2", "D2:1"])
    evidence = locomo.session_ids(["D1:9", "D1:4", "D4:1"])  # sessions 1 and 4
    assert locomo.recall_at(ranked, evidence, 2) == 0.5
    assert locomo.recall_at(ranked, evidence, 1) == 0.0

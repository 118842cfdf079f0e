"""Updates through a real ``mneme up`` (AIP-134): without an update_mask, UpdateBank,
UpdateDirective and UpdateMentalModel change the fields populated in the request and keep
the others; "*" still replaces every field. A mental model refreshed every N facts needs
N >= 1 (INVALID_ARGUMENT naming mental_model.refresh_every, on create and update)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import field_mask_pb2

from mneme.client import field_violations
from mneme.v1 import banks_pb2, directives_pb2, mental_models_pb2, resources_pb2


def refused(call, field: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in [f for f, _ in field_violations(e.value)]


def test_update_bank_without_a_mask_changes_the_populated_fields_only(m):
    m.upsert_bank("nomask", display_name="Old", retain_mission="Keep names of pets.",
                  skepticism=5, store_documents=False)
    b = m.banks.UpdateBank(banks_pb2.UpdateBankRequest(bank=resources_pb2.Bank(
        name="banks/nomask", config=resources_pb2.BankConfig(reflect_mission="Be brief."))))
    assert (b.display_name, b.config.retain_mission, b.config.skepticism,
            b.config.store_documents, b.config.reflect_mission) == (
        "Old", "Keep names of pets.", 5, False, "Be brief.")
    assert m.get_bank("nomask") == b
    # nothing populated: nothing changes
    assert m.banks.UpdateBank(banks_pb2.UpdateBankRequest(
        bank=resources_pb2.Bank(name="banks/nomask"))) == b
    # "*" is a full replace: what is not given takes its default
    b = m.banks.UpdateBank(banks_pb2.UpdateBankRequest(
        bank=resources_pb2.Bank(name="banks/nomask", display_name="New"),
        update_mask=field_mask_pb2.FieldMask(paths=["*"])))
    assert (b.display_name, b.config.retain_mission, b.config.skepticism,
            b.config.store_documents) == ("New", "", 3, True)


def test_update_directive_without_a_mask_changes_the_populated_fields_only(m):
    m.upsert_bank("nomask-d")
    d = m.create_directive("nomask-d", "Answer in German.", title="German", priority=7,
                           active=False, tags=["de"])
    got = m.directives.UpdateDirective(directives_pb2.UpdateDirectiveRequest(
        directive=directives_pb2.Directive(name=d.name, text="Answer in French.")))
    assert (got.text, got.title, got.priority, got.active, list(got.tags)) == (
        "Answer in French.", "German", 7, False, ["de"])
    assert m.get_directive("nomask-d", d.id).priority == 7


def test_update_mental_model_without_a_mask_changes_the_populated_fields_only(m):
    m.upsert_bank("nomask-m")
    mm = m.create_mental_model("nomask-m", "Pets", "Which pets does Ana have?",
                               content="Ana has a cat.", tags=["pets"], max_tokens=300,
                               refresh_policy="every_n_facts", refresh_every=5)
    got = m.mental_models.UpdateMentalModel(mental_models_pb2.UpdateMentalModelRequest(
        mental_model=mental_models_pb2.MentalModel(name=mm.name, display_name="Ana's pets")))
    assert (got.display_name, got.source_query, got.content, list(got.tags), got.max_tokens,
            got.refresh_policy, got.refresh_every) == (
        "Ana's pets", "Which pets does Ana have?", "Ana has a cat.", ["pets"], 300,
        mental_models_pb2.EVERY_N_FACTS, 5)


def test_every_n_facts_needs_refresh_every_of_at_least_one(m):
    m.upsert_bank("every-n")
    refused(lambda: m.create_mental_model("every-n", "Pets", "Which pets?",
                                          refresh_policy="every_n_facts"),
            "mental_model.refresh_every")
    mm = m.create_mental_model("every-n", "Pets", "Which pets?")
    # the policy alone, the count alone and both: the model as it would be is checked
    refused(lambda: m.update_mental_model("every-n", mm.id, refresh_policy="every_n_facts"),
            "mental_model.refresh_every")
    refused(lambda: m.update_mental_model("every-n", mm.id, refresh_policy="every_n_facts",
                                          refresh_every=0), "mental_model.refresh_every")
    got = m.update_mental_model("every-n", mm.id, refresh_policy="every_n_facts",
                                refresh_every=2)
    assert (got.refresh_policy, got.refresh_every) == (mental_models_pb2.EVERY_N_FACTS, 2)
    refused(lambda: m.update_mental_model("every-n", mm.id, refresh_every=0),
            "mental_model.refresh_every")
    assert m.update_mental_model("every-n", mm.id, refresh_policy="manual",
                                 refresh_every=0).refresh_every == 0

"""Per-topic fetch waits: MNEME_KAFKA_TOPIC_FETCH_MAX_WAIT_MS overrides
MNEME_KAFKA_FETCH_MAX_WAIT_MS for the consumers of the topics it names."""

import pydantic
import pytest
from pydantic_settings import SettingsError

from mneme.bootstrap import services
from mneme.bus import INTAKE, MEMORY, PROGRESS
from mneme.bus.kafka_log import KafkaOptions
from mneme.config import Settings
from mneme.runtime.kafka import build_broker


def test_the_setting_is_json_per_topic_and_reaches_the_client_options(monkeypatch):
    monkeypatch.setenv("MNEME_KAFKA_FETCH_MAX_WAIT_MS", "80")
    monkeypatch.setenv("MNEME_KAFKA_TOPIC_FETCH_MAX_WAIT_MS", '{"mneme.progress.v1": 5}')
    options = KafkaOptions(**Settings().kafka_options())
    assert options.fetch_wait(PROGRESS) == 5
    assert options.fetch_wait(INTAKE) == options.fetch_wait(MEMORY) == 80


@pytest.mark.parametrize("value, names", [
    ('{"mneme.progres.v1": 5}', "mneme.progres.v1"),   # a typo would change nothing
    ('{"mneme.progress.v1": -1}', "mneme.progress.v1"),
    ('{"mneme.progress.v1": 600000}', "mneme.progress.v1"),
    ("progress=5", "kafka_topic_fetch_max_wait_ms"),
])
def test_a_bad_value_is_refused_naming_the_setting_and_topic(monkeypatch, value, names):
    monkeypatch.setenv("MNEME_KAFKA_TOPIC_FETCH_MAX_WAIT_MS", value)
    with pytest.raises((pydantic.ValidationError, SettingsError)) as e:
        Settings()
    assert "kafka_topic_fetch_max_wait_ms" in str(e.value) and names in str(e.value)


def test_options_refuse_a_wait_out_of_range():
    with pytest.raises(ValueError, match="0..60000"):
        KafkaOptions(topic_fetch_max_wait_ms=((PROGRESS, 70_000),))
    with pytest.raises(ValueError, match="0..60000"):
        KafkaOptions(fetch_max_wait_ms=-5)


def test_each_topics_subscribers_get_its_wait():
    broker = build_broker(services().values(), options=KafkaOptions(
        fetch_max_wait_ms=90, topic_fetch_max_wait_ms=((PROGRESS, 7),)))
    waits = {}
    for sub in broker.subscribers:  # what FastStream hands each aiokafka consumer
        for topic in sub.topic_names:
            waits.setdefault(topic, set()).add(sub._connection_args["fetch_max_wait_ms"])
    assert waits[PROGRESS] == {7}
    assert waits[INTAKE] == waits[MEMORY] == {90}

"""RepeatLimiter: a client library's repeated log lines are summarised, mneme's kept."""

from __future__ import annotations

import logging

from mneme.logrepeat import RepeatLimiter


def _record(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_repeats_of_a_noisy_logger_are_dropped_then_counted():
    now = [0.0]
    f = RepeatLimiter(window_s=30, clock=lambda: now[0])
    kept = []
    for t in range(0, 65):  # one reconnect error a second for 65 s, from two nodes
        now[0] = float(t)
        for node in (1, 2):
            r = _record("aiokafka", "Unable connect to node with id %s: %s", node, "refused")
            if f.filter(r):
                kept.append((t, r.getMessage()))
    assert kept == [
        (0, "Unable connect to node with id 1: refused"),
        (30, "Unable connect to node with id 1: refused (59 more like it in the last 30 s)"),
        (60, "Unable connect to node with id 1: refused (59 more like it in the last 30 s)")]


def test_other_loggers_and_other_messages_pass():
    f = RepeatLimiter(window_s=30, clock=lambda: 0.0)
    assert all(f.filter(_record("mneme.bus.kafka_log", "lost topics")) for _ in range(3))
    assert f.filter(_record("aiokafka.consumer.fetcher", "Failed fetch"))
    assert f.filter(_record("aiokafka", "Unable to update metadata"))
    assert not f.filter(_record("aiokafka", "Unable to update metadata"))
    info = _record("aiokafka", "Discovered coordinator %s", 1)
    info.levelno = logging.INFO
    assert f.filter(info) and f.filter(info)

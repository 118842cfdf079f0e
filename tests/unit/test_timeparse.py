"""mneme.timeparse: relative and coarse time expressions resolve to whole periods against
the item's own timestamp; ordinary chat sentences yield nothing."""

from __future__ import annotations

import json
import pathlib
import re
from datetime import datetime, time, timedelta, timezone

import pytest

from mneme.domain import TimeWindow
from mneme.timeparse import (describe_window, parse_session_datetime, parse_when, query_window,
                             time_zone, time_zone_name, wall_clock)

UTC = timezone.utc
REF = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)  # LoCoMo conv-26 session 1: a Monday


def day(y, m, d, y2=None, m2=None, d2=None) -> TimeWindow:
    return TimeWindow(datetime(y, m, d, tzinfo=UTC),
                      datetime.combine(datetime(y2 or y, m2 or m, d2 or d).date(), time.max, tzinfo=UTC))


def one(text: str, ref: datetime = REF):
    ms = parse_when(text, ref)
    assert len(ms) == 1, (text, ms)
    return ms[0]


@pytest.mark.parametrize("text,expected,gran", [
    ("I went to a LGBTQ support group yesterday and it was so powerful.", day(2023, 5, 7), "day"),
    ("We went camping last week.", day(2023, 5, 1, d2=7), "week"),
    ("I moved there in 2015.", day(2015, 1, 1, 2015, 12, 31), "year"),
    ("March 2023 was cold.", day(2023, 3, 1, d2=31), "month"),
    ("It was 8 May, 2023.", day(2023, 5, 8), "day"),
    ("two days ago", day(2023, 5, 6), "day"),
    ("last Saturday we hiked", day(2023, 5, 6), "day"),
    ("next month", day(2023, 6, 1, d2=30), "month"),
    ("last month", day(2023, 4, 1, d2=30), "month"),
    ("I painted that lake sunrise last year!", day(2022, 1, 1, 2022, 12, 31), "year"),
    ("this weekend", day(2023, 5, 13, d2=14), "weekend"),
    ("last weekend", day(2023, 5, 6, d2=7), "weekend"),
    ("music in the 90s", day(1990, 1, 1, 1999, 12, 31), "decade"),
    ("in May 2023", day(2023, 5, 1, d2=31), "month"),
    ("May 20th, 2021", day(2021, 5, 20), "day"),
    ("on 2023-04-02", day(2023, 4, 2), "day"),
    ("the day before yesterday", day(2023, 5, 6), "day"),
    ("four years ago", day(2019, 1, 1, 2019, 12, 31), "year"),
    ("last summer", day(2022, 6, 1, 2022, 8, 31), "season"),
    ("on the 5th", day(2023, 5, 5), "day"),
])
def test_expressions_resolve_to_their_whole_period(text, expected, gran):
    m = one(text)
    assert m.window == expected
    assert m.granularity == gran
    assert text[m.start:m.end] == m.text


def test_coarse_dates_are_ranges():
    few = one("I started a few years ago.").window
    assert few.start == datetime(2018, 1, 1, tzinfo=UTC)  # 2 to 5 years back, whole years
    assert few.end.date() == datetime(2021, 12, 31).date()
    since = one("I've lived here since 2016.")
    assert since.window.start == datetime(2016, 1, 1, tzinfo=UTC) and since.window.end == REF
    rng = one("from May to July 2023").window
    assert rng == day(2023, 5, 1, 2023, 7, 31)
    early = one("in early 2020").window
    assert early == day(2020, 1, 1, 2020, 4, 30)
    assert one("between 2015 and 2018").window == day(2015, 1, 1, 2018, 12, 31)
    assert one("before 2016").window == TimeWindow(None, datetime(2015, 12, 31, 23, 59, 59, 999999, tzinfo=UTC))


def test_absolute_and_relative_flags():
    assert one("in 2015").relative is False
    assert one("8 May, 2023").relative is False
    assert one("yesterday").relative is True


def test_reference_is_the_items_timestamp_not_the_clock():
    assert one("yesterday", datetime(2001, 3, 1, 8, 0, tzinfo=UTC)).window == day(2001, 2, 28)
    # naive references are UTC; an aware one is read on its own clock: 02:00 on 8 May in
    # Tokyo (17:00 on 7 May in UTC) says "yesterday" of 7 May
    assert one("yesterday", datetime(2023, 5, 8, 13, 56)).window == day(2023, 5, 7)
    tokyo = timezone(timedelta(hours=9))
    assert one("yesterday", datetime(2023, 5, 8, 2, 0, tzinfo=tokyo)).window == day(2023, 5, 7)


def test_tense_decides_direction_of_bare_weekdays():
    assert one("I'll go hiking on Friday.").window == day(2023, 5, 12)
    assert one("On Friday I went hiking.").window == day(2023, 5, 5)


@pytest.mark.parametrize("text,kept", [
    ("Erin bakes sourdough bread every Sunday morning.", []),
    ("On Saturdays she teaches the violin.", []),
    ("We go camping every summer.", []),
    ("Every Christmas the family meets at Grandma's.", []),
    ("I see my therapist every other Monday.", []),
    ("Each weekend we hike, and every Sunday in June 2023 we swam.", ["June 2023"]),
    ("I ran every day last week.", ["last week"]),
])
def test_habits_are_not_dates(text, kept):
    """A recurring time ("every Sunday", "each summer") names no single period: pinning it to
    the last one would date the fact wrongly and make recall's temporal fit rank it down."""
    assert [m.text for m in parse_when(text, REF)] == kept


@pytest.mark.parametrize("text", [
    "May I ask what you did?",
    "I'm swamped with the kids & work.",
    "Hey Mel! Good to see you!",
    "Hey Caroline! Good to see you! I'm swamped with the kids & work. What's up with you? Anything new?",
    "I am a second year student and now I have a dog.",
    "I have 3 kids and 2 cats.",
    "A friend made it for my 18th birthday.",
    "It's gonna be my 4th one!",
    "I was in my 20s then.",
    "Version 2.10.15 is out.",
    "I paid 2000 dollars for it.",
    "We march on, and may I add, June said hi.",
    "You may want to rest a second.",
    "I love summer camp and my new year's resolution is to read.",
    "I finished the painting in two days.",
])
def test_no_false_positives_on_ordinary_sentences(text):
    assert parse_when(text, REF) == []


_TIME_WORD = re.compile(
    r"\d|yesterday|today|tonight|tomorrow|week|month|year|day|night|morning|ago|summer|winter|"
    r"spring|fall|autumn|monday|tuesday|wednesday|thursday|friday|saturday|sunday|mon|tue|wed|"
    r"thu|fri|sat|sun|january|february|march|april|may|june|july|august|september|october|"
    r"november|december|christmas|thanksgiving|halloween|easter|nineties|eighties", re.I)


def _locomo_turns():
    root = pathlib.Path(__file__).resolve().parents[2]
    for path in (root.parent / "shared/data/locomo/locomo_dev.json", root / "examples/locomo/conv-26.json"):
        if path.is_file():
            data = json.loads(path.read_text())
            conv = (data if isinstance(data, list) else [data])[0]["conversation"]
            for k, v in conv.items():
                if k.startswith("session_") and isinstance(v, list):
                    ref = parse_session_datetime(conv[f"{k}_date_time"])
                    for t in v:
                        yield t["text"], ref
            return
    pytest.skip("no LoCoMo data")


def test_every_mention_on_a_real_conversation_is_a_time_expression():
    n = 0
    for text, ref in _locomo_turns():
        for m in parse_when(text, ref):
            n += 1
            assert _TIME_WORD.search(m.text), (m.text, text)
            assert m.window.start is None or m.window.end is None or m.window.start <= m.window.end
    assert n > 50  # conv-26 says "yesterday", "last week", ... many times


def test_parse_session_datetime():
    assert parse_session_datetime("1:56 pm on 8 May, 2023") == datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    assert parse_session_datetime("10:37 am on 27 June, 2023") == datetime(2023, 6, 27, 10, 37, tzinfo=UTC)
    assert parse_session_datetime("2023-05-08T10:00:00+02:00") == datetime(2023, 5, 8, 8, 0, tzinfo=UTC)
    with pytest.raises(ValueError):
        parse_session_datetime("not a date at all")


def test_query_window():
    assert query_window("what did I do last week?", REF) == day(2023, 5, 1, d2=7)
    assert query_window("What happened in May 2023?", REF) == day(2023, 5, 1, d2=31)
    assert query_window("yesterday", REF) == day(2023, 5, 7)
    assert query_window("When did Caroline go to the LGBTQ support group?", REF) is None
    assert query_window("What did Melanie do between 2015 and 2018?", REF) == day(2015, 1, 1, 2018, 12, 31)


def test_describe_window():
    assert describe_window(day(2023, 5, 7)) == "7 May 2023"
    assert describe_window(day(2023, 5, 1, d2=7)) == "1\u20137 May 2023"
    assert describe_window(day(2023, 3, 1, d2=31)) == "March 2023"
    assert describe_window(day(2015, 1, 1, 2015, 12, 31)) == "2015"
    assert describe_window(day(2018, 1, 1, 2021, 12, 31)) == "2018\u20132021"


# ---- time zones: dates are the speaker's calendar dates --------------------------------------

LATE_IN_NEW_YORK = datetime(2024, 3, 2, 4, 30, tzinfo=UTC)  # 23:30 on 1 March there


@pytest.mark.parametrize("zone,yesterday,today", [
    ("", day(2024, 3, 1), day(2024, 3, 2)),
    ("America/New_York", day(2024, 2, 29), day(2024, 3, 1)),
    ("-05:00", day(2024, 2, 29), day(2024, 3, 1)),
    ("Asia/Kolkata", day(2024, 3, 1), day(2024, 3, 2)),
    ("Pacific/Kiritimati", day(2024, 3, 1), day(2024, 3, 2)),  # +14:00: 18:30 on 2 March
    ("Pacific/Pago_Pago", day(2024, 2, 29), day(2024, 3, 1)),  # -11:00: 17:30 on 1 March
])
def test_relative_dates_are_read_on_the_zones_calendar(zone, yesterday, today):
    ref = wall_clock(LATE_IN_NEW_YORK, zone)
    assert ref == LATE_IN_NEW_YORK  # the same instant, read on another clock
    assert one("I ran a marathon yesterday", ref).window == yesterday
    assert query_window("what did I do yesterday?", ref) == yesterday
    from mneme.timeparse import day_window
    assert day_window(ref) == today


def test_daylight_saving_is_the_zones_own():
    # 04:30Z is 23:30 the day before in New York in winter (-05:00), 00:30 in summer (-04:00)
    winter = wall_clock(datetime(2024, 1, 10, 4, 30, tzinfo=UTC), "America/New_York")
    summer = wall_clock(datetime(2024, 7, 10, 4, 30, tzinfo=UTC), "America/New_York")
    assert (winter.day, summer.day) == (9, 10)
    assert time_zone_name(winter) == time_zone_name(summer) == "America/New_York"


def test_time_zone_names_and_offsets():
    assert time_zone("") is time_zone("UTC") is time_zone("z") is UTC
    assert time_zone("+05:30").utcoffset(None) == timedelta(hours=5, minutes=30)
    assert time_zone("-0800").utcoffset(None) == timedelta(hours=-8)
    for name in ("", "America/New_York", "+05:30", "-11:00"):
        ref = wall_clock(LATE_IN_NEW_YORK, name)
        assert time_zone_name(ref) == name
        assert wall_clock(LATE_IN_NEW_YORK, time_zone_name(ref)) == ref
    assert time_zone_name(datetime(2024, 1, 1)) == ""  # naive: UTC
    # host files of the tz database would read differently on another host
    for bad in ("Mars/Olympus", "../../etc/passwd", "+24:00", "America/", "x\x00y",
                "localtime", "posixrules", "right/UTC", "posix/Europe/Paris", "Factory"):
        with pytest.raises(ValueError, match="IANA|offset"):
            time_zone(bad)
    # the ends of the representable range stay readable in any zone
    from mneme.domain import MAX_TIME, MIN_TIME
    assert wall_clock(MAX_TIME, "Pacific/Kiritimati") == MAX_TIME
    assert wall_clock(MIN_TIME, "Pacific/Pago_Pago") == MIN_TIME

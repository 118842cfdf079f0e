"""Time normalisation: find time expressions in text and resolve them to UTC windows.

Every relative expression is resolved against a *reference* datetime -- the timestamp of
the item the text came from (DESIGN §1), never the wall clock. Expressions name periods,
and the window spans the whole period the expression names:

    "yesterday"       -> that day, 00:00:00 ... 23:59:59.999999
    "last week"       -> the previous Monday ... Sunday
    "in 2015"         -> 2015-01-01 ... 2015-12-31 end of day
    "March 2023"      -> the whole month
    "a few years ago" -> a fuzzy range (2 to 5 years back, whole years)
    "since 2016"      -> 2016-01-01 ... the reference itself

The recogniser is a set of small regular-expression rules (this module) rather than
``dateparser.search_dates``: ``search_dates`` returns points, not periods, and on LoCoMo
turns it matches ordinary words ("May I ask", "We", "now", "am a second year", "my 18th
birthday") and reads "the 90s" as 90 seconds ago; its ``REQUIRE_PARTS`` gate loses real
dates ("on the 5th"). ``dateparser.parse`` is used where it is reliable: session date strings
in formats the fixed patterns do not know (:func:`parse_session_datetime`).

Ambiguous direction (a bare "Saturday", "in May", "the summer") resolves to the most recent
past occurrence, or to the next one when the sentence speaks about the future ("will",
"going to", "'ll", "plans for", a present progressive), like dateparser's
``PREFER_DATES_FROM='past'`` with a tense cue.

Dates are calendar dates. The reference is taken as a wall clock: an aware datetime is
read in its own zone, so "yesterday" said at 23:30 on 1 March in New York is 29 February
(pass :func:`wall_clock` of the instant and the speaker's zone); a naive one is UTC (LoCoMo
and most chat logs carry no zone). A window holds its days as UTC days (00:00Z ... 23:59Z of
that date), whatever zone they were resolved in, so windows from items and queries of
different zones compare as dates.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from functools import lru_cache
from zoneinfo import ZoneInfo

from mneme.domain import TimeWindow, utc

__all__ = [
    "TimeMention",
    "time_zone",
    "time_zone_name",
    "wall_clock",
    "parse_when",
    "parse_session_datetime",
    "query_window",
    "describe_window",
    "day_window",
]

_US = timedelta(microseconds=1)

# ---- zones -------------------------------------------------------------------------------

_OFFSET = re.compile(r"^(?:UTC|GMT)?([+-])(\d{2}):?(\d{2})$")
#: What a time zone may be, for error messages.
TIME_ZONE_FORMS = ('an IANA time zone name like "America/New_York", "UTC", or an offset '
                   'like "+05:30"')


@lru_cache(maxsize=1024)
def time_zone(name: str) -> tzinfo:
    """``name`` → tzinfo: "" / "UTC" / "Z" → UTC; a fixed offset "+05:30", "-0800" or
    "UTC+01:00" (at most ±23:59) → that offset; otherwise a name of the IANA database as
    the pinned ``tzdata`` package lists it ("Europe/Paris"; not host files such as
    "localtime", "posixrules" or "right/…", which would read differently on another
    host), read by :mod:`zoneinfo`. Raises ValueError saying what is accepted
    (:data:`TIME_ZONE_FORMS`) for anything else."""
    s = name.strip()
    if s.upper() in ("", "UTC", "Z", "GMT", "ETC/UTC"):
        return timezone.utc
    m = _OFFSET.match(s)
    if m:
        hours, minutes = int(m.group(2)), int(m.group(3))
        if hours > 23 or minutes > 59:
            raise ValueError(f"offset out of range: {name!r}; {TIME_ZONE_FORMS}")
        delta = timedelta(hours=hours, minutes=minutes)
        return timezone(-delta if m.group(1) == "-" else delta)
    if s not in _iana_names() or s == "Factory":
        raise ValueError(f"unknown time zone {name[:64]!r}; {TIME_ZONE_FORMS}")
    try:
        return ZoneInfo(s)
    except (ValueError, KeyError, OSError, UnicodeError):
        raise ValueError(f"unknown time zone {name[:64]!r}; {TIME_ZONE_FORMS}") from None


@lru_cache(maxsize=1)
def _iana_names() -> frozenset[str]:
    """The zone names of the pinned ``tzdata`` package (its ``zones`` list): one set on
    every host, whatever the system's tz database holds."""
    from importlib.resources import files
    return frozenset(files("tzdata").joinpath("zones").read_text(encoding="utf-8").split())


def time_zone_name(dt: datetime) -> str:
    """The zone of aware ``dt`` as :func:`time_zone` reads it back: an IANA name, an
    offset "+05:30", or "" for UTC and naive datetimes."""
    tz = dt.tzinfo
    if tz is None or tz == timezone.utc:
        return ""
    if isinstance(tz, ZoneInfo):
        return tz.key
    off = dt.utcoffset() or timedelta(0)
    if not off:
        return ""
    sign, off = ("-", -off) if off < timedelta(0) else ("+", off)
    minutes = int(off.total_seconds()) // 60
    return f"{sign}{minutes // 60:02d}:{minutes % 60:02d}"


def wall_clock(instant: datetime, zone: str) -> datetime:
    """``instant`` (aware; naive = UTC) as the date and clock time it was in ``zone``
    (:func:`time_zone`; "" = UTC), as an aware datetime of that zone: the reference
    :func:`parse_when`, :func:`query_window` and :func:`day_window` read as a wall clock.
    Raises ValueError for an unknown zone; an instant at the edge of the representable
    range stays in UTC rather than overflow."""
    tz = time_zone(zone)
    try:
        return utc(instant).astimezone(tz)
    except OverflowError:
        return utc(instant)


def _as_wall_utc(d: datetime) -> datetime:
    """``d``'s wall clock (its own zone; naive = UTC) tagged UTC: the resolver's frame."""
    return d.replace(tzinfo=timezone.utc)


# ---- windows -----------------------------------------------------------------------------


def _start(d: date) -> datetime:
    return datetime.combine(d, time.min, tzinfo=timezone.utc)


def _end(d: date) -> datetime:
    return datetime.combine(d, time.max, tzinfo=timezone.utc)


def day_window(d: date | datetime, last: date | datetime | None = None) -> TimeWindow:
    """The whole day(s) ``d`` … ``last`` (inclusive) as a window of UTC days; a
    datetime gives its calendar date in its own zone (naive = UTC; :func:`wall_clock`)."""
    if isinstance(d, datetime):
        d = d.date()
    if isinstance(last, datetime):
        last = last.date()
    return TimeWindow(_start(d), _end(last or d))


def _month_last(y: int, m: int) -> date:
    return date(y, m, calendar.monthrange(y, m)[1])


def _month(y: int, m: int) -> TimeWindow:
    return TimeWindow(_start(date(y, m, 1)), _end(_month_last(y, m)))


def _months(y1: int, m1: int, y2: int, m2: int) -> TimeWindow:
    return TimeWindow(_start(date(y1, m1, 1)), _end(_month_last(y2, m2)))


def _year(y: int, y2: int | None = None) -> TimeWindow:
    return TimeWindow(_start(date(y, 1, 1)), _end(date(y2 or y, 12, 31)))


def _week(d: date) -> TimeWindow:
    mon = d - timedelta(days=d.weekday())
    return TimeWindow(_start(mon), _end(mon + timedelta(days=6)))


def _add_months(y: int, m: int, n: int) -> tuple[int, int]:
    k = y * 12 + (m - 1) + n
    return k // 12, k % 12 + 1


def _shift_days(d: date, n: int) -> date | None:
    try:
        return d + timedelta(days=n)
    except OverflowError:  # absurd counts ("100000 days ago")
        return None


# ---- the mention ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TimeMention:
    """A time expression found in text.

    ``text`` is the matched substring, ``start``/``end`` its character offsets in the
    input; ``window`` the resolved UTC interval; ``granularity`` one of day, week, weekend,
    month, season, year, decade, range, fuzzy, open; ``relative`` is True when resolving it
    needed the reference (e.g. "yesterday", "last May"), False for absolute dates
    ("8 May, 2023", "in 2015").
    """

    text: str
    start: int
    end: int
    window: TimeWindow
    granularity: str
    relative: bool = True

    def describe(self) -> str:
        """The window in words ("7 May 2023", "1–7 May 2023", "2015"), see
        :func:`describe_window`."""
        return describe_window(self.window)


# ---- vocabulary --------------------------------------------------------------------------

_MONTHS = {
    "january": 1, "february": 2, "march": 3, "april": 4, "may": 5, "june": 6, "july": 7,
    "august": 8, "september": 9, "october": 10, "november": 11, "december": 12,
    "jan": 1, "feb": 2, "mar": 3, "apr": 4, "jun": 6, "jul": 7, "aug": 8, "sep": 9,
    "sept": 9, "oct": 10, "nov": 11, "dec": 12,
}
_MONTH_FULL = r"(?:january|february|march|april|may|june|july|august|september|october|november|december)"
_MONTH_ANY = r"(?:january|february|march|april|may|june|july|august|september|october|november|december|jan|feb|mar|apr|jun|jul|aug|sept|sep|oct|nov|dec)"
_WEEKDAYS = {"monday": 0, "tuesday": 1, "wednesday": 2, "thursday": 3, "friday": 4,
             "saturday": 5, "sunday": 6}
_WD = r"(?:monday|tuesday|wednesday|thursday|friday|saturday|sunday)"
_WD_ABBR = {"mon": 0, "tue": 1, "tues": 1, "wed": 2, "thu": 3, "thur": 3, "thurs": 3, "fri": 4,
            "sat": 5, "sun": 6}
_YEAR = r"(?:1[5-9]\d\d|20\d\d|2100)"
_NUMWORDS = {
    "a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
    "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
    "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
    "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
}
# Vague quantities become (min, max) counts; the window spans the whole spread.
_FUZZY = {"couple": (2, 3), "few": (2, 5), "several": (3, 7), "many": (5, 20),
          "number": (3, 10), "some": (2, 6)}
_APPROX = r"(?:(?:about|around|almost|nearly|roughly|over|like|just|only|maybe)\s+)?"
_NUM = (_APPROX + r"(?P<num>\d{1,3}|a\s+couple(?:\s+of)?|couple\s+of|a\s+few|few|several|many|"
        r"a\s+number\s+of|some|an?|one|two|three|four|five|six|seven|eight|nine|ten|eleven|"
        r"twelve|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|"
        r"thirty|forty|fifty)")
_UNITS = {"day": "day", "days": "day", "weekend": "weekend", "weekends": "weekend",
          "week": "week", "weeks": "week", "month": "month", "months": "month",
          "year": "year", "years": "year", "decade": "decade", "decades": "decade"}
_SEASONS = {"spring": 3, "summer": 6, "fall": 9, "autumn": 9, "winter": 12}
_DECADE_WORDS = {"twenties": 20, "thirties": 30, "forties": 40, "fifties": 50,
                 "sixties": 60, "seventies": 70, "eighties": 80, "nineties": 90}

# Words that, right before a bare month/year/season/holiday, make it a time expression.
_PREP = {"in", "since", "during", "until", "till", "by", "from", "through", "throughout",
         "of", "around", "before", "after", "early", "late", "mid", "to", "between",
         "and", "on", "at", "for", "over", "this", "last", "next", "past", "circa",
         "year", "into", "end", "beginning", "start", "middle"}
_MONTH_PREP = {"in", "since", "during", "until", "till", "by", "from", "through", "throughout",
               "of", "around", "before", "after", "early", "late", "mid", "between", "into",
               "end", "beginning", "start", "middle"}
_MONTH_PREP_STRONG = {"in", "since", "during", "until", "till", "through", "throughout", "of",
                      "early", "late", "mid", "from", "between"}
_YEAR_PREP = {"in", "since", "during", "until", "till", "by", "from", "through", "throughout",
              "of", "around", "before", "after", "early", "late", "mid", "circa", "year",
              "between", "into", "end", "beginning", "start", "middle"}
_FUTURE = re.compile(
    r"\b(?:will|shall|gonna|going\s+to|plan(?:s|ning|ned)?\s+to|hope\s+to|want\s+to|wanna|"
    r"can't\s+wait|cannot\s+wait|looking\s+forward|upcoming|coming\s+up|soon|intend|"
    r"scheduled|would\s+like\s+to|plans?\s+for)\b|['\u2019]ll\b|"
    # a present progressive ("we're going camping on Saturday"), not an -ing adjective
    r"(?:\b(?:am|are|is)\s+|['\u2019](?:m|re)\s+)(?!(?:amazing|interesting|exciting|boring|"
    r"inspiring|relaxing|annoying|charming|stunning|surprising|thrilling|rewarding|challenging|"
    r"refreshing|touching|heartwarming|fascinating|nothing|something|anything|everything|"
    r"missing|outstanding|loving|caring|willing|lacking)\b)\w+ing\b",
    re.I,
)
_SENT_END = re.compile(r"[.!?\n]")
# "every Sunday", "each summer", "every other weekend": a habit, not a date (as the plural
# "on Sundays" is); no rule's mention begins with these words, so they are checked before it.
_HABIT_BEFORE = re.compile(r"\b(?:every|each)\s+(?:(?:other|single|second|third)\s+)?$", re.I)


def _num(s: str) -> tuple[int, int]:
    """'two' -> (2, 2); 'a few' -> (2, 5)."""
    s = " ".join(s.lower().split())
    for k, v in _FUZZY.items():
        if k in s.split():
            return v
    if s.isdigit():
        return int(s), int(s)
    n = _NUMWORDS.get(s, 1)
    return n, n


def _sentence(text: str, a: int, b: int) -> str:
    """The sentence around text[a:b] (for tense cues)."""
    lo = max((m.end() for m in _SENT_END.finditer(text, 0, a)), default=0)
    m = _SENT_END.search(text, b)
    return text[lo:(m.start() if m else len(text))]


def _prev_word(text: str, a: int) -> str:
    m = re.search(r"([A-Za-z]+)[\s,-]*$", text[max(0, a - 30):a])
    return m.group(1).lower() if m else ""


# ---- rules -------------------------------------------------------------------------------
# Each rule: (pattern, handler). A handler gets (match, context) and returns
# (window, granularity, relative[, (start, end) of the mention if not the whole match])
# or None to reject the match.


class _Ctx:
    __slots__ = ("text", "ref", "day", "_future")

    def __init__(self, text: str, ref: datetime):
        self.text = text
        self.ref = ref
        self.day = ref.date()

    def future(self, m: re.Match) -> bool:
        """True when the sentence around the match speaks about the future."""
        return bool(_FUTURE.search(_sentence(self.text, m.start(), m.end())))


def _r_iso(m, c):
    try:
        d = date(int(m["y"]), int(m["m"]), int(m["d"]))
    except ValueError:
        return None
    return day_window(d), "day", False


def _r_numeric(m, c):
    a, b, y = (int(m["a"]), int(m["b"]), int(m["y"])) if m["a"] else (int(m["a2"]), int(m["b2"]), int(m["y2"]))
    if y < 100:
        y += 2000 if y <= (c.day.year % 100) + 5 else 1900
    mo, d = (b, a) if a > 12 else (a, b)  # US order unless the first part cannot be a month
    try:
        return day_window(date(y, mo, d)), "day", False
    except ValueError:
        return None


def _pick_year(c: _Ctx, m: re.Match, mo: int, d: int | None) -> int:
    """Year for a month/day written without one: the most recent such date not after the
    reference (past preference), or the next one when the sentence speaks of the future."""
    y = c.day.year
    probe = date(y, mo, min(d or 1, calendar.monthrange(y, mo)[1]))
    if c.future(m):
        if d is None:
            return y if mo >= c.day.month else y + 1
        return y if probe >= c.day else y + 1
    if d is None:
        return y if mo <= c.day.month else y - 1
    return y if probe <= c.day else y - 1


def _r_day_month(m, c):
    mo = _MONTHS[m["mon"].lower().rstrip(".")]
    d = int(m["d"])
    if m["mon"].lower() == "may" and not m["mon"][0].isupper() and not m["y"]:
        return None  # "I may 2 ..." style noise
    y = int(m["y"]) if m["y"] else _pick_year(c, m, mo, d)
    try:
        return day_window(date(y, mo, d)), "day", not m["y"]
    except ValueError:
        return None


def _r_month_year(m, c):
    mo = _MONTHS[m["mon"].lower().rstrip(".")]
    return _month(int(m["y"]), mo), "month", False


def _r_month(m, c):
    word = m["mon"]
    mo = _MONTHS[word.lower()]
    rel = (m["rel"] or "").lower()
    if not rel:
        prev = _prev_word(c.text, m.start())
        strong = prev in _MONTH_PREP and (word[0].isupper() or prev in _MONTH_PREP_STRONG)
        # "from May to July": the second month of a range
        ranged = word[0].isupper() and re.search(
            rf"\b{_MONTH_FULL}\s+(?:to|and|through|until|till|-|\u2013)\s+$",
            c.text[max(0, m.start() - 25):m.start()], re.I)
        if not (strong or ranged):
            return None  # "May I ask", "we march", "June said", "and may I add"
    y = c.day.year
    if rel == "last" or rel == "past":
        y = y if mo < c.day.month else y - 1
    elif rel in ("next", "coming"):
        y = y if mo > c.day.month else y + 1
    elif rel == "this":
        pass
    else:
        y = _pick_year(c, m, mo, None)
    return _month(y, mo), "month", True


def _r_year_range(m, c):
    y1, y2 = int(m["y1"]), int(m["y2"])
    if y2 < 100:
        y2 += (y1 // 100) * 100
    sep = m["sep"].strip().lower()
    if len(m["y2"]) == 2 and sep not in ("-", "\u2013", "\u2014"):
        return None  # "2015 to 20 people"
    if y2 <= y1 or (sep == "and" and not m["from"]):
        return None  # "in 2015 and 2018" names two years, not a range
    return _year(y1, y2), "range", False


def _r_year(m, c):
    prev = _prev_word(c.text, m.start())
    if prev not in _YEAR_PREP:
        return None  # a bare number: "2015 people", "for 2000 dollars"
    if re.match(r"\s*(?:%|dollars|people|km|miles|euros|\$)", c.text[m.end():], re.I):
        return None
    return _year(int(m["y"])), "year", False


def _r_decade(m, c):
    g = m["dec"].lower().replace("'", "").replace("\u2019", "")
    if g in _DECADE_WORDS:
        d = _DECADE_WORDS[g]
        base = 1900 if 1900 + d + 9 < c.day.year else 2000
        if base == 2000 and 2000 + d > c.day.year:
            base = 1900
        start = base + d
    elif len(g) == 5 and g.endswith("00s") and int(g[:4]) < 2000:  # "the 1900s": the century
        return _year(int(g[:4]), int(g[:4]) + 99), "decade", False
    elif len(g) == 5:  # 1990s
        start = int(g[:4])
    else:  # 90s
        d = int(g[:2])
        start = 2000 + d if 2000 + d <= c.day.year else 1900 + d
    the = m["the"] or re.search(r"\bthe\s+(?:early|late|mid)[\s-]*$", c.text[max(0, m.start() - 12):m.start()], re.I)
    if len(g) != 5 and not the:
        return None  # "in my 20s" is an age, not a decade
    return _year(start, start + 9), "decade", len(g) != 5


def _r_dayword(m, c):
    w = " ".join(m[0].lower().split())
    if "day before yesterday" in w:
        n = -2
    elif "day after tomorrow" in w:
        n = 2
    elif w.startswith("yesterday") or w == "last night":
        n = -1
    elif w.startswith("tomorrow"):
        n = 1
    else:  # today, tonight, this morning ...
        n = 0
    return day_window(c.day + timedelta(days=n)), "day", True


def _weekend(c: _Ctx, offset_weeks: int) -> TimeWindow:
    sat = c.day - timedelta(days=c.day.weekday()) + timedelta(days=5 + 7 * offset_weeks)
    return day_window(sat, sat + timedelta(days=1))


def _r_period(m, c):
    rel = " ".join(m["rel"].lower().split())
    unit = m["unit"].lower()
    the = bool(m["the"])
    if the and rel in ("last", "past") and re.match(r"\s+of\b", c.text[m.end():]):
        return None  # "the last week of May"
    d = c.day
    if unit == "weekend":
        if rel in ("last", "past", "previous", "this past"):
            off = -1  # the most recent weekend that is over (or the one before, on a weekend)
        elif rel in ("this", "current"):
            off = 0
        elif rel == "coming":
            off = 0 if d.weekday() < 5 else 1
        else:  # next, following
            off = 1
        return _weekend(c, off), "weekend", True
    if the and rel in ("past", "last", "next", "coming"):  # rolling: "the past week"
        sign = 1 if rel in ("next", "coming") else -1
        if unit == "week":
            other = d + timedelta(days=sign * 7)
        elif unit == "month":
            y, mo = _add_months(d.year, d.month, sign)
            other = date(y, mo, min(d.day, calendar.monthrange(y, mo)[1]))
        elif unit == "year":
            other = date(d.year + sign, d.month, min(d.day, 28) if d.month == 2 else d.day)
        else:  # decade
            other = date(d.year + 10 * sign, d.month, min(d.day, 28))
        lo, hi = (other, d) if sign < 0 else (d, other)
        return day_window(lo, hi), "range", True
    off = {"last": -1, "past": -1, "previous": -1, "this past": -1, "this": 0,
           "current": 0, "next": 1, "coming": 1, "following": 1}[rel]
    if unit == "week":
        return _week(d + timedelta(days=7 * off)), "week", True
    if unit == "month":
        y, mo = _add_months(d.year, d.month, off)
        return _month(y, mo), "month", True
    if unit == "year":
        return _year(d.year + off), "year", True
    start = (d.year // 10 + off) * 10  # decade
    return _year(start, start + 9), "decade", True


def _r_bare_weekend(m, c):
    d = c.day
    if m["pre"].lower() == "for":
        off = 0  # "plans for the weekend": the current week's
    elif d.weekday() >= 5:
        off = 0  # said during a weekend: this one
    elif c.future(m) or d.weekday() >= 3:
        off = 0  # Thursday/Friday: the coming weekend
    else:
        off = -1  # Monday–Wednesday: the one just past
    return _weekend(c, off), "weekend", True


def _r_weekday(m, c):
    w = m["wd"].lower().rstrip(".")
    rel = " ".join((m["rel"] or "").lower().split())
    if w in _WD_ABBR and (not rel or m["plural"]):
        return None  # "sat", "sun", "wed" alone are ordinary words
    wd = _WEEKDAYS.get(w, _WD_ABBR.get(w))
    if m["plural"]:
        return None  # "on Mondays": a habit, not a date
    if not rel and not m["wd"][0].isupper():
        return None
    d = c.day
    back = (d.weekday() - wd) % 7 or 7  # days back to the previous such weekday
    fwd = (wd - d.weekday()) % 7 or 7
    if rel in ("last", "past", "this past"):
        target = d - timedelta(days=back)
    elif rel in ("next", "coming"):
        target = d + timedelta(days=fwd)
    elif rel == "this":
        target = d + timedelta(days=wd - d.weekday())
        if target < d and c.future(m):
            target += timedelta(days=7)
    else:  # "on Saturday" / "Saturday": the past one unless the sentence is about plans
        target = d + timedelta(days=fwd) if c.future(m) else d - timedelta(days=back)
    return day_window(target), "day", True


def _r_ago(m, c):
    lo_n, hi_n = _num(m["num"])
    unit = _UNITS[m["unit"].lower()]
    d = c.day
    if unit == "day":
        a, b = _shift_days(d, -hi_n), _shift_days(d, -lo_n)
        return (day_window(a, b), "day" if lo_n == hi_n else "fuzzy", True) if a and b else None
    if unit == "weekend":
        return TimeWindow(_weekend(c, -hi_n).start, _weekend(c, -lo_n).end), "weekend" if lo_n == hi_n else "fuzzy", True
    if unit == "week":
        a, b = _shift_days(d, -7 * hi_n), _shift_days(d, -7 * lo_n)
        if not (a and b):
            return None
        return TimeWindow(_week(a).start, _week(b).end), "week" if lo_n == hi_n else "fuzzy", True
    if unit == "month":
        y1, m1 = _add_months(d.year, d.month, -hi_n)
        y2, m2 = _add_months(d.year, d.month, -lo_n)
        if y1 < 1:
            return None
        return _months(y1, m1, y2, m2), "month" if lo_n == hi_n else "fuzzy", True
    k = 10 if unit == "decade" else 1
    if d.year - k * hi_n < 1:
        return None
    return _year(d.year - k * hi_n, d.year - k * lo_n), "year" if lo_n == hi_n and k == 1 else "fuzzy", True


def _r_in_future(m, c):
    if not (c.future(m) or m["fromnow"]):
        return None  # "I did it in two days" is a duration
    lo_n, hi_n = _num(m["num"])
    unit = _UNITS[m["unit"].lower()]
    d = c.day
    if unit == "day":
        a, b = _shift_days(d, lo_n), _shift_days(d, hi_n)
        return (day_window(a, b), "day" if lo_n == hi_n else "fuzzy", True) if a and b else None
    if unit == "week":
        a, b = _shift_days(d, 7 * lo_n), _shift_days(d, 7 * hi_n)
        return (TimeWindow(_week(a).start, _week(b).end), "week" if lo_n == hi_n else "fuzzy", True) if a and b else None
    if unit == "month":
        y1, m1 = _add_months(d.year, d.month, lo_n)
        y2, m2 = _add_months(d.year, d.month, hi_n)
        return _months(y1, m1, y2, m2), "month" if lo_n == hi_n else "fuzzy", True
    k = 10 if unit == "decade" else 1
    if d.year + k * hi_n > 9000:
        return None
    return _year(d.year + k * lo_n, d.year + k * hi_n), "year" if lo_n == hi_n and k == 1 else "fuzzy", True


def _r_past_n(m, c):
    """"the past two weeks", "the last few years": a rolling window ending at the reference."""
    _, hi_n = _num(m["num"])
    unit = _UNITS[m["unit"].lower()]
    d = c.day
    if unit == "day":
        a = _shift_days(d, -hi_n)
    elif unit == "week":
        a = _shift_days(d, -7 * hi_n)
    elif unit == "month":
        y, mo = _add_months(d.year, d.month, -hi_n)
        a = date(y, mo, min(d.day, calendar.monthrange(y, mo)[1])) if y >= 1 else None
    else:
        k = 10 if unit == "decade" else 1
        a = date(d.year - k * hi_n, d.month, min(d.day, 28)) if d.year - k * hi_n >= 1 else None
    return (day_window(a, d), "range", True) if a else None


def _r_next_n(m, c):
    """"the next few months", "the coming weeks": a rolling window starting at the reference."""
    _, hi_n = _num(m["num"] or "few")
    unit = _UNITS[m["unit"].lower()]
    d = c.day
    if unit == "day":
        b = _shift_days(d, hi_n)
    elif unit == "week":
        b = _shift_days(d, 7 * hi_n)
    elif unit == "month":
        y, mo = _add_months(d.year, d.month, hi_n)
        b = date(y, mo, min(d.day, calendar.monthrange(y, mo)[1]))
    else:
        k = 10 if unit == "decade" else 1
        b = date(d.year + k * hi_n, d.month, min(d.day, 28)) if d.year + k * hi_n < 9000 else None
    return (day_window(d, b), "range", True) if b else None


_PERFECT = re.compile(r"\b(?:have|has|had)\b|['\u2019]ve\b", re.I)


def _r_ongoing(m, c):
    """"I've had them for 3 years (now)": ongoing for N units up to the reference. Only
    with "now" or a perfect tense -- "I lived there for 3 years" does not end now."""
    if not (m["now"] or _PERFECT.search(_sentence(c.text, m.start(), m.end()))):
        return None
    return _r_past_n(m, c)


def _r_had_a_weekend(m, c):
    """"I had a quiet weekend", "been a busy week": the weekend just past / the past 7 days.
    Only the word "weekend"/"week" is the mention."""
    d = c.day
    if m["unit"].lower() == "weekend":
        w, gran = _weekend(c, 0 if d.weekday() >= 5 else -1), "weekend"
    else:
        w, gran = day_window(d - timedelta(days=7), d), "range"
    return w, gran, True, (m.start("unit"), m.end("unit"))


def _r_other_day(m, c):
    return day_window(c.day - timedelta(days=7), c.day - timedelta(days=1)), "fuzzy", True


_SEASON_PREP = {"in", "during", "over", "since", "until", "till", "through", "throughout",
                "this", "last", "next", "early", "late", "mid", "all", "before", "after", "by"}


def _season_window(season: str, y: int) -> TimeWindow:
    """Meteorological seasons (northern hemisphere); winter Y = Dec Y … Feb Y+1."""
    s = _SEASONS[season]
    if s == 12:
        return _months(y, 12, y + 1, 2)
    return _months(y, s, y, s + 2)


def _r_season(m, c):
    season = m["season"].lower()
    rel = (m["rel"] or "").lower()
    if m["y"]:
        return _season_window(season, int(m["y"])), "season", False
    prev = _prev_word(c.text, m.start())
    if not rel and not (prev in _SEASON_PREP or (m["the"] and prev in _PREP | {"all"})):
        return None  # "summer camp", "I love winter", "the fall of Rome"
    ref = c.ref
    cands = [_season_window(season, y) for y in range(c.day.year - 2, c.day.year + 2)]
    current = next((w for w in cands if w.start <= ref <= w.end), None)
    past = [w for w in cands if w.end < ref]
    future = [w for w in cands if w.start > ref]
    if rel == "this":
        w = current or next(x for x in cands if x.start.year == c.day.year)
    elif rel in ("last", "past"):
        w = past[-1]
    elif rel in ("next", "coming"):
        w = future[0]
    else:  # "in the summer": the current one, else the coming one for plans, else the last
        w = current or (future[0] if c.future(m) else past[-1])
    return w, "season", True


def _easter(y: int) -> date:
    """Gregorian Easter Sunday (anonymous Gregorian algorithm)."""
    a, b, cc = y % 19, y // 100, y % 100
    d, e = b // 4, b % 4
    f = (b + 8) // 25
    g = (b - f + 1) // 3
    h = (19 * a + b - d - g + 15) % 30
    i, k = cc // 4, cc % 4
    l_ = (32 + 2 * e + 2 * i - h - k) % 7
    m = (a + 11 * h + 22 * l_) // 451
    mo = (h + l_ - 7 * m + 114) // 31
    return date(y, mo, (h + l_ - 7 * m + 114) % 31 + 1)


def _holiday(name: str, y: int) -> date:
    n = " ".join(name.lower().replace("\u2019", "'").split())
    if "eve" in n and "christmas" in n:
        return date(y, 12, 24)
    if "christmas" in n:
        return date(y, 12, 25)
    if "new year" in n:
        return date(y, 12, 31) if "eve" in n else date(y, 1, 1)
    if "thanksgiving" in n:  # US: fourth Thursday of November
        first = date(y, 11, 1)
        return first + timedelta(days=(3 - first.weekday()) % 7 + 21)
    if "halloween" in n:
        return date(y, 10, 31)
    if "valentine" in n:
        return date(y, 2, 14)
    if "easter" in n:
        return _easter(y)
    return date(y, 7, 4)  # independence day / fourth of july


def _r_holiday(m, c):
    rel = (m["rel"] or "").lower()
    if not rel and _prev_word(c.text, m.start()) not in _PREP:
        return None  # "my new year's resolution", "Christmas tree"
    days = [_holiday(m["hol"], y) for y in range(c.day.year - 1, c.day.year + 2)]
    if rel == "this":
        target = days[1]
    elif rel in ("last", "past"):
        target = max(x for x in days if x < c.day)
    elif rel in ("next", "coming"):
        target = min(x for x in days if x > c.day)
    elif c.future(m):
        target = min(x for x in days if x >= c.day)
    else:
        target = max(x for x in days if x <= c.day)
    return day_window(target), "day", True


def _r_part_of_period(m, c):
    """"the end of the month", "the beginning of the year": part of the current period."""
    part = m["part"].lower()
    unit = m["unit"].lower()
    base = {"week": _week(c.day), "month": _month(c.day.year, c.day.month),
            "year": _year(c.day.year)}[unit]
    return _part(base, part, unit), "range", True


def _part(w: TimeWindow, part: str, gran: str) -> TimeWindow:
    """Early/mid/late part of a period: years by months (Jan–Apr, May–Aug, Sep–Dec),
    months by days (1–10, 11–20, 21–end), decades by years (0–3, 4–6, 7–9), anything
    else by thirds of its days."""
    p = part.lower().rstrip("-")
    k = 0 if p in ("early", "beginning", "start") else 1 if p in ("mid", "middle") else 2
    a, b = w.start.date(), w.end.date()
    if gran == "year" and a.year == b.year:
        return _months(a.year, 1 + 4 * k, a.year, 4 + 4 * k)
    if gran == "month":
        lo = (1, 11, 21)[k]
        hi = (10, 20, b.day)[k]
        return day_window(a.replace(day=lo), a.replace(day=hi))
    if gran == "decade":
        lo, hi = ((0, 3), (4, 6), (7, 9))[k]
        return _year(a.year + lo, a.year + hi)
    n = (b - a).days + 1
    third = max(1, n // 3)
    if k == 0:
        return day_window(a, a + timedelta(days=third - 1))
    if k == 1:
        return day_window(a + timedelta(days=third), b - timedelta(days=third))
    return day_window(b - timedelta(days=third - 1), b)


def _r_ordinal_day(m, c):
    """"on the 5th", "the 21st of last month": a day of the current (or named) month."""
    d = int(m["d"])
    rel = (m["rel"] or "").lower()
    if not rel and not m["on"]:
        return None
    y, mo = c.day.year, c.day.month
    if rel:
        y, mo = _add_months(y, mo, {"last": -1, "this": 0, "next": 1}[rel])
    elif c.future(m):
        if d < c.day.day:
            y, mo = _add_months(y, mo, 1)
    elif d > c.day.day:
        y, mo = _add_months(y, mo, -1)
    try:
        return day_window(date(y, mo, d)), "day", True
    except ValueError:
        return None


_RULES: list[tuple[re.Pattern, object]] = [
    (re.compile(r"\b(?P<y>\d{4})-(?P<m>\d{2})-(?P<d>\d{2})\b"), _r_iso),
    (re.compile(r"\b(?P<a>\d{1,2})/(?P<b>\d{1,2})/(?P<y>\d{4}|\d{2})\b|\b(?P<a2>\d{1,2})\.(?P<b2>\d{1,2})\.(?P<y2>\d{4})\b"),
     _r_numeric),
    (re.compile(
        rf"\b(?:(?:{_WD}),?\s+)?(?:the\s+)?(?P<d>[0-3]?\d)(?:st|nd|rd|th)?\s+(?:of\s+)?"
        rf"(?P<mon>{_MONTH_ANY})\b\.?(?:,?\s+(?P<y>{_YEAR})\b)?", re.I), _r_day_month),
    (re.compile(
        rf"\b(?:(?:{_WD}),?\s+)?(?P<mon>{_MONTH_ANY})\.?\s+(?:the\s+)?(?P<d>[0-3]?\d)"
        rf"(?:st|nd|rd|th)?\b(?!:|\s*(?:am|pm|%|percent|people|times|kids|hours|minutes|years|dollars)\b)"
        rf"(?:,?\s+(?P<y>{_YEAR})\b)?", re.I), _r_day_month),
    (re.compile(rf"\b(?P<mon>{_MONTH_ANY})\.?,?\s+(?:of\s+)?(?P<y>{_YEAR})\b", re.I), _r_month_year),
    (re.compile(rf"\b(?:(?P<rel>last|next|this|coming|past)\s+)?(?P<mon>{_MONTH_FULL})\b", re.I), _r_month),
    (re.compile(
        rf"\b(?:(?P<from>between|from)\s+)?(?P<y1>{_YEAR})(?P<sep>\s*(?:-|\u2013|\u2014)\s*|\s+(?:to|until|till|through|and)\s+)"
        rf"(?P<y2>{_YEAR}|\d\d)\b", re.I), _r_year_range),
    (re.compile(rf"\b(?P<y>{_YEAR})\b(?!\s*[-/.]\s*\d)", re.I), _r_year),
    (re.compile(
        r"\b(?P<the>the\s+)?(?P<dec>(?:1[5-9]|20)\d0s|['\u2019]?\d0s|"
        r"twenties|thirties|forties|fifties|sixties|seventies|eighties|nineties)\b", re.I), _r_decade),
    (re.compile(
        r"\b(?:the\s+day\s+before\s+yesterday|the\s+day\s+after\s+tomorrow|"
        r"(?:yesterday|tomorrow)(?:\s+(?:morning|afternoon|evening|night))?|today|tonight|"
        r"last\s+night|this\s+(?:morning|afternoon|evening))\b", re.I), _r_dayword),
    (re.compile(
        r"\b(?P<the>the\s+)?(?P<rel>this\s+past|last|this|next|past|coming|previous|current|following)"
        r"\s+(?P<unit>week|weekend|month|year|decade)\b", re.I), _r_period),
    (re.compile(r"\b(?P<pre>over|on|at|during|for)\s+the\s+weekend\b", re.I), _r_bare_weekend),
    (re.compile(
        rf"\b(?:(?P<rel>this\s+past|last|next|this|coming|past|on)\s+)?(?P<wd>{_WD}|(?:mon|tues?|wed|thu(?:rs?)?|fri|sat|sun)\b\.?)(?P<plural>s)?"
        r"(?:\s+(?:morning|afternoon|evening|night))?\b", re.I), _r_weekday),
    (re.compile(rf"\b{_NUM}\s+(?P<unit>days?|weekends?|weeks?|months?|years?|decades?)\s+(?:ago|back)\b", re.I), _r_ago),
    (re.compile(rf"\bin\s+(?:(?:about|around|roughly|another)\s+)?{_NUM}\s+(?P<unit>days?|weeks?|months?|years?)\b"
                r"(?P<fromnow>\s+from\s+now)?", re.I), _r_in_future),
    (re.compile(rf"\b{_NUM}\s+(?P<unit>days?|weeks?|months?|years?)\s+(?P<fromnow>from\s+now)\b", re.I), _r_in_future),
    (re.compile(rf"\bthe\s+(?:past|last|previous)\s+{_NUM}\s+(?P<unit>days|weeks|months|years|decades)\b", re.I), _r_past_n),
    (re.compile(rf"\bthe\s+(?:next|coming|following)\s+(?:{_NUM}\s+)?(?P<unit>days|weeks|months|years)\b", re.I), _r_next_n),
    (re.compile(rf"\bfor\s+(?:the\s+)?(?:(?:past|last)\s+)?{_NUM}\s+(?P<unit>days?|weeks?|months?|years?|decades?)"
                r"(?P<now>\s+now)?\b", re.I), _r_ongoing),
    (re.compile(r"\bthe\s+other\s+day\b", re.I), _r_other_day),
    (re.compile(r"\b(?:had|spent|was|been|what)\s+(?:a|an|such\s+a|my|our)\s+(?:[a-z-]+\s+){0,3}?"
                r"(?P<unit>weekend|week)\b(?!\s+(?:of|before|after|later|earlier|ago|from))", re.I), _r_had_a_weekend),
    (re.compile(r"\b(?P<on>on\s+)?the\s+(?P<d>[0-3]?\d)(?:st|nd|rd|th)\b(?:\s+of\s+(?P<rel>last|this|next)\s+month\b)?"
                r"(?!\s+(?:floor|time|grade|place|anniversary|birthday|day|week|month|year|century|street|"
                r"avenue|row|round|attempt|edition|generation|of))", re.I), _r_ordinal_day),
    (re.compile(
        rf"\b(?:(?P<rel>last|this|next|past|coming)\s+|(?P<the>the\s+))?(?P<season>spring|summer|fall|autumn|winter)"
        rf"(?:\s+(?:of\s+)?(?P<y>{_YEAR})\b)?\b", re.I), _r_season),
    (re.compile(
        r"\b(?:(?P<rel>last|this|next|past|coming)\s+)?(?P<hol>christmas(?:\s+eve|\s+day)?|"
        r"new\s+year['\u2019]?s(?:\s+eve|\s+day)?|thanksgiving|halloween|valentine['\u2019]?s(?:\s+day)?|"
        r"easter|independence\s+day|(?:the\s+)?fourth\s+of\s+july)\b", re.I), _r_holiday),
    (re.compile(r"\b(?:the\s+)?(?P<part>beginning|start|middle|end)\s+of\s+(?:the|this)\s+(?P<unit>week|month|year)\b",
                re.I), _r_part_of_period),
]


# ---- post-processing: modifiers and ranges --------------------------------------------------

_PART_BEFORE = re.compile(r"(?:\b(?:in|at|by|from|until)\s+)?\b(?:the\s+)?(?P<part>early|mid-?|late|beginning\s+of|"
                          r"start\s+of|middle\s+of|end\s+of)\s*$", re.I)
_OPEN_BEFORE = re.compile(r"\b(?P<op>ever\s+since|since|up\s+until|until|till|before|after)\s+$", re.I)
_RANGE_GAP = re.compile(r"^\s*(?:-|\u2013|\u2014|to|until|till|through|and)\s*$", re.I)
_RANGE_START = re.compile(r"\b(?:from|between)\s+$", re.I)


def _apply_modifiers(text: str, ms: list[TimeMention], ref: datetime) -> list[TimeMention]:
    out: list[TimeMention] = []
    for t in ms:
        before = text[max(0, t.start - 30):t.start]
        pm = _PART_BEFORE.search(before)
        if pm and t.granularity in ("month", "year", "season", "decade", "week"):
            a = t.start - (len(before) - pm.start("part"))
            t = TimeMention(text[a:t.end], a, t.end, _part(t.window, pm["part"].split()[0], t.granularity),
                            "range", t.relative)
        om = _OPEN_BEFORE.search(text[max(0, t.start - 20):t.start])
        if om:
            op = " ".join(om["op"].lower().split())
            a = t.start - (min(20, t.start) - om.start())
            if op.endswith("since") or op == "after":
                lo = t.window.start if op.endswith("since") else t.window.end + _US
                hi = max(ref, lo) if op.endswith("since") else None
                t = TimeMention(text[a:t.end], a, t.end, TimeWindow(lo, hi), "open", t.relative)
            else:
                hi = t.window.end if op != "before" else t.window.start - _US
                t = TimeMention(text[a:t.end], a, t.end, TimeWindow(None, hi), "open", t.relative)
        out.append(t)
    # ranges: "from May to July 2023", "between 3 and 5 May" (the latter only if both matched)
    merged: list[TimeMention] = []
    i = 0
    while i < len(out):
        a = out[i]
        if i + 1 < len(out):
            b = out[i + 1]
            gap = text[a.end:b.start]
            starts = _RANGE_START.search(text[max(0, a.start - 10):a.start])
            dash = gap.strip() in ("-", "\u2013", "\u2014")
            if (_RANGE_GAP.match(gap) and (starts or dash or gap.strip().lower() in ("to", "through"))
                    and a.window.start and b.window.end and a.granularity != "open" and b.granularity != "open"):
                lo = a.window.start
                if lo > b.window.end and a.relative:
                    # "from May to July 2023": the start takes the end's year
                    try:
                        lo = lo.replace(year=b.window.end.year)
                    except ValueError:
                        lo = lo.replace(year=b.window.end.year, day=28)
                    if lo > b.window.end:
                        lo = lo.replace(year=lo.year - 1)
                if lo <= b.window.end:
                    s = a.start - (len(starts[0]) if starts else 0)
                    merged.append(TimeMention(text[s:b.end], s, b.end, TimeWindow(lo, b.window.end),
                                              "range", a.relative or b.relative))
                    i += 2
                    continue
        merged.append(a)
        i += 1
    return merged


# ---- public API ---------------------------------------------------------------------------


def parse_when(text: str, reference: datetime) -> list[TimeMention]:
    """Time expressions in ``text``, in order of appearance, each resolved against
    ``reference`` (the item's own timestamp, read as a wall clock in its own zone: pass
    :func:`wall_clock`; naive = UTC) to a :class:`TimeWindow` of UTC days spanning the
    period it names. Overlapping candidates keep the longest
    ("8 May, 2023" wins over "May, 2023"). Returns [] when there is none; never raises
    on ordinary text."""
    if not text:
        return []
    ref = _as_wall_utc(reference)
    ctx = _Ctx(text, ref)
    cands: list[TimeMention] = []
    for pat, handler in _RULES:
        for m in pat.finditer(text):
            try:
                r = handler(m, ctx)
            except (ValueError, OverflowError, KeyError):
                r = None
            if r is None:
                continue
            w, gran, rel = r[:3]
            a, b = r[3] if len(r) > 3 else (m.start(), m.end())
            if _HABIT_BEFORE.search(text, max(0, a - 30), a):
                continue
            cands.append(TimeMention(text[a:b], a, b, w, gran, rel))
    cands.sort(key=lambda t: (-(t.end - t.start), t.start))
    picked: list[TimeMention] = []
    for t in cands:
        if all(t.end <= p.start or t.start >= p.end for p in picked):
            picked.append(t)
    picked.sort(key=lambda t: t.start)
    return _apply_modifiers(text, picked, ref)


_SESSION_FORMATS = ("%I:%M %p on %d %B, %Y", "%I:%M %p on %d %b, %Y", "%I:%M%p on %d %B, %Y",
                    "%I:%M %p on %B %d, %Y", "%d %B %Y %H:%M", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d")


def parse_session_datetime(text: str) -> datetime:
    """A session date string such as LoCoMo's ``"1:56 pm on 8 May, 2023"`` → aware UTC
    datetime. Tries fixed formats first, then ``dateparser.parse``. Raises ValueError if
    the string is not a date."""
    s = " ".join(text.strip().split())
    for fmt in _SESSION_FORMATS:
        try:
            return datetime.strptime(s, fmt).replace(tzinfo=timezone.utc)
        except ValueError:
            pass
    try:
        return utc(datetime.fromisoformat(s))
    except ValueError:
        pass
    import dateparser  # lazy: ~0.3 s import

    dt = dateparser.parse(s, languages=["en"], settings={"TIMEZONE": "UTC", "TO_TIMEZONE": "UTC",
                                                        "RETURN_AS_TIMEZONE_AWARE": True})
    if dt is None:
        raise ValueError(f"not a date: {text!r}")
    return utc(dt)


def query_window(query: str, now: datetime) -> TimeWindow | None:
    """The time window a recall query refers to ("what did I do last week?",
    "in May 2023", "yesterday"), resolved against ``now`` (the query timestamp, read as a
    wall clock in its own zone as in :func:`parse_when`). Several
    expressions give the window covering all of them; None when the query names no time."""
    ms = parse_when(query, now)
    if not ms:
        return None
    starts = [m.window.start for m in ms]
    ends = [m.window.end for m in ms]
    lo = None if any(s is None for s in starts) else min(starts)
    hi = None if any(e is None for e in ends) else max(ends)
    return TimeWindow(lo, hi)


def _aligned_day(w: TimeWindow) -> bool:
    return (w.start.time() == time.min and w.end.time() == time.max)


def describe_window(w: TimeWindow) -> str:
    """A window in words: "7 May 2023", "1–7 May 2023", "May 2023", "March – May 2023",
    "2015", "2018–2021", "since 1 January 2016", "until 31 December 2015"."""
    def day(d: datetime) -> str:
        return f"{d.day} {calendar.month_name[d.month]} {d.year}"

    if w.start is None and w.end is None:
        return ""
    if w.start is None:
        return f"until {day(w.end)}"
    if w.end is None:
        return f"since {day(w.start)}"
    s, e = w.start, w.end
    if _aligned_day(w):
        sd, ed = s.date(), e.date()
        whole_months = sd.day == 1 and ed == _month_last(ed.year, ed.month)
        if whole_months and (sd.month, ed.month) == (1, 12):
            return str(sd.year) if sd.year == ed.year else f"{sd.year}\u2013{ed.year}"
        if whole_months:
            a = calendar.month_name[sd.month]
            b = f"{calendar.month_name[ed.month]} {ed.year}"
            if (sd.year, sd.month) == (ed.year, ed.month):
                return b
            return f"{a} \u2013 {b}" if sd.year == ed.year else f"{a} {sd.year} \u2013 {b}"
        if sd == ed:
            return day(s)
        if (sd.year, sd.month) == (ed.year, ed.month):
            return f"{sd.day}\u2013{day(e)}"
        if sd.year == ed.year:
            return f"{sd.day} {calendar.month_name[sd.month]} \u2013 {day(e)}"
    return f"{day(s)} \u2013 {day(e)}"

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
``dateparser.search_dates`` alone: ``search_dates`` returns points, not periods, and it
matches ordinary words ("May I ask", "We", "now", "second") and misreads "the 90s" as
90 seconds. ``dateparser`` is still used where it is reliable: parsing session date strings
(:func:`parse_session_datetime`) and as a gated fallback for date strings the rules do not
know (e.g. "on the 5th"), accepted only when the matched text carries a strong date cue.

Day boundaries are UTC days: the reference is converted to UTC first (LoCoMo and most chat
logs carry no zone, so naive times are taken as UTC).
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone

from mneme.domain import TimeWindow, utc

__all__ = [
    "TimeMention",
    "parse_when",
    "parse_session_datetime",
    "query_window",
    "describe_window",
    "day_window",
]

_US = timedelta(microseconds=1)

# ---- windows -----------------------------------------------------------------------------


def _start(d: date) -> datetime:
    return datetime.combine(d, time.min, tzinfo=timezone.utc)


def _end(d: date) -> datetime:
    return datetime.combine(d, time.max, tzinfo=timezone.utc)


def day_window(d: date | datetime, last: date | datetime | None = None) -> TimeWindow:
    """The whole UTC day(s) ``d`` … ``last`` (inclusive) as a window; datetimes are
    converted to UTC first and only their date is used."""
    if isinstance(d, datetime):
        d = utc(d).date()
    if isinstance(last, datetime):
        last = utc(last).date()
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
_YEAR = r"(?:1[5-9]\d\d|20\d\d|2100)"
_NUMWORDS = {
    "a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
    "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
    "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
    "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
}
# Vague quantities become (min, max) counts; the window spans the whole spread.
_FUZZY = {"couple": (2, 3), "few": (2, 5), "several": (3, 7), "many": (5, 20),
          "number": (3, 10)}
_NUM = (r"(?P<num>\d{1,3}|a\s+couple(?:\s+of)?|couple\s+of|a\s+few|few|several|many|"
        r"a\s+number\s+of|an?|one|two|three|four|five|six|seven|eight|nine|ten|eleven|"
        r"twelve|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|"
        r"thirty|forty|fifty)")
_UNITS = {"day": "day", "days": "day", "week": "week", "weeks": "week", "month": "month",
          "months": "month", "year": "year", "years": "year", "decade": "decade",
          "decades": "decade"}
_SEASONS = {"spring": 3, "summer": 6, "fall": 9, "autumn": 9, "winter": 12}
_DECADE_WORDS = {"twenties": 20, "thirties": 30, "forties": 40, "fifties": 50,
                 "sixties": 60, "seventies": 70, "eighties": 80, "nineties": 90}

# Words that, right before a bare month/year/season/holiday, make it a time expression.
_PREP = {"in", "since", "during", "until", "till", "by", "from", "through", "throughout",
         "of", "around", "before", "after", "early", "late", "mid", "to", "between",
         "and", "on", "at", "for", "over", "this", "last", "next", "past", "circa",
         "year", "about", "into", "end", "beginning", "start", "middle"}
_FUTURE = re.compile(
    r"\b(?:will|shall|gonna|going\s+to|plan(?:s|ning|ned)?\s+to|hope\s+to|want\s+to|wanna|"
    r"can't\s+wait|cannot\s+wait|looking\s+forward|upcoming|coming\s+up|soon|intend|"
    r"scheduled|would\s+like\s+to)\b|'ll\b|\u2019ll\b",
    re.I,
)
_SENT_END = re.compile(r"[.!?\n]")


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
# Each rule: (pattern, handler). A handler gets (match, text, reference date, reference
# datetime) and returns (window, granularity, relative) or None to reject the match.


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
    a, b, y = int(m["a"]), int(m["b"]), int(m["y"])
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
    if not rel and _prev_word(c.text, m.start()) not in _PREP:
        return None  # "May I ask", "we march", "June said"
    if not rel and word.islower() and word.lower() in ("may", "march"):
        return None
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


def _r_year(m, c):
    y1 = int(m["y1"])
    if m["y2"]:
        y2 = int(m["y2"])
        if y2 < 100:
            y2 += (y1 // 100) * 100
        if y2 <= y1:
            return None
        return _year(y1, y2), "range", False
    if m["between"]:
        return None
    prev = _prev_word(c.text, m.start())
    if prev not in _PREP or prev in ("and", "to", "at", "for", "over", "this", "last", "next"):
        return None  # a bare number: "2015 people", "for 2000 dollars"
    if re.match(r"\s*(?:%|dollars|people|km|miles|euros|\$)", c.text[m.end():], re.I):
        return None
    return _year(y1), "year", False


def _r_decade(m, c):
    g = m["dec"].lower().replace("'", "").replace("\u2019", "")
    if g in _DECADE_WORDS:
        d = _DECADE_WORDS[g]
        base = 1900 if 1900 + d + 9 < c.day.year else 2000
        if base == 2000 and 2000 + d > c.day.year:
            base = 1900
        start = base + d
    elif len(g) == 5:  # 1990s
        start = int(g[:4])
    else:  # 90s
        d = int(g[:2])
        start = 2000 + d if 2000 + d <= c.day.year else 1900 + d
    if len(g) != 5 and not m["the"]:
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
    if the and rel in ("past", "last", "next", "coming"):  # rolling: "the past week"
        sign = 1 if rel in ("next", "coming") else -1
        if unit == "weekend":
            return _weekend(c, -1 if d.weekday() < 5 else -1) if sign < 0 else _weekend(c, 0 if d.weekday() < 5 else 1), "weekend", True
        if unit in ("week", "day"):
            other = d + timedelta(days=sign * 7)
        elif unit == "month":
            y, mo = _add_months(d.year, d.month, sign)
            other = date(y, mo, min(d.day, calendar.monthrange(y, mo)[1]))
        elif unit == "year":
            other = date(d.year + sign, d.month, 28 if (d.month, d.day) == (2, 29) else d.day)
        else:  # decade
            other = date(d.year + 10 * sign, d.month, min(d.day, 28))
        lo, hi = (other, d) if sign < 0 else (d, other)
        return day_window(lo, hi), "range", True
    off = {"last": -1, "past": -1, "previous": -1, "this past": -1, "this": 0,
           "current": 0, "next": 1, "coming": 1 if unit != "weekend" else 0,
           "following": 1}[rel]
    if unit == "week":
        return _week(d + timedelta(days=7 * off)), "week", True
    if unit == "weekend":
        if off < 0 and d.weekday() >= 5 and rel != "this past":
            off = -1  # "last weekend" said on a Sunday: the one before
        elif off < 0 and d.weekday() >= 5:
            off = 0 if d.weekday() == 6 else -1
        if rel == "coming" and d.weekday() >= 5:
            off = 1
        return _weekend(c, off), "weekend", True
    if unit == "month":
        y, mo = _add_months(d.year, d.month, off)
        return _month(y, mo), "month", True
    if unit == "year":
        return _year(d.year + off), "year", True
    start = (d.year // 10 + off) * 10  # decade
    return _year(start, start + 9), "decade", True


def _r_bare_weekend(m, c):
    d = c.day
    if m["pre"].lower() == "this":
        off = 0
    elif d.weekday() >= 5:
        off = 0  # said during a weekend: this one
    elif c.future(m) or d.weekday() >= 3:
        off = 0  # Thursday/Friday: the coming weekend
    else:
        off = -1  # Monday–Wednesday: the one just past
    return _weekend(c, off), "weekend", True


def _r_weekday(m, c):
    wd = _WEEKDAYS[m["wd"].lower()]
    rel = " ".join((m["rel"] or "").lower().split())
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


def _r_other_day(m, c):
    return day_window(c.day - timedelta(days=7), c.day - timedelta(days=1)), "fuzzy", True


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
    if not rel and _prev_word(c.text, m.start()) not in _PREP | {"the", "all"}:
        return None
    if not rel and not m["the"] and _prev_word(c.text, m.start()) not in ("in", "during", "over", "since", "until", "this", "last", "next", "early", "late", "mid", "all"):
        return None  # "summer camp", "I love winter"
    ref = c.ref
    cands = [_season_window(season, y) for y in range(c.day.year - 2, c.day.year + 2)]
    current = next((w for w in cands if w.start <= ref <= w.end), None)
    past = [w for w in cands if w.end < ref]
    future = [w for w in cands if w.start > ref]
    if rel == "this":
        w = current or (future[0] if c.future(m) or not past else past[-1])
        # "this summer" in the same calendar year
        same_year = [x for x in cands if x.start.year == c.day.year]
        w = current or (same_year[0] if same_year else w)
    elif rel in ("last", "past"):
        w = past[-1]
    elif rel in ("next", "coming"):
        w = future[0]
    else:
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
    return _part(base, part), "range", True


def _part(w: TimeWindow, part: str) -> TimeWindow:
    """Thirds of a window: early/beginning/start, mid/middle, late/end."""
    a, b = w.start.date(), w.end.date()
    n = (b - a).days + 1
    third = max(1, n // 3)
    p = part.lower().rstrip("-")
    if p in ("early", "beginning", "start"):
        return day_window(a, a + timedelta(days=third - 1))
    if p in ("mid", "middle"):
        return day_window(a + timedelta(days=third), b - timedelta(days=third))
    return day_window(b - timedelta(days=third - 1), b)


_RULES: list[tuple[re.Pattern, object]] = [
    (re.compile(r"\b(?P<y>\d{4})-(?P<m>\d{2})-(?P<d>\d{2})\b"), _r_iso),
    (re.compile(r"\b(?P<a>\d{1,2})[/.](?P<b>\d{1,2})[/.](?P<y>\d{4}|\d{2})\b"), _r_numeric),
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
        rf"\b(?:(?P<between>between|from)\s+)?(?P<y1>{_YEAR})(?:\s*(?:-|\u2013|\u2014|to|until|till|through|and)\s*"
        rf"(?P<y2>{_YEAR}|\d\d)\b)?\b(?!\s*-\s*\d)", re.I), _r_year),
    (re.compile(
        r"\b(?P<the>the\s+)?(?:early\s+|late\s+|mid-?)?(?P<dec>(?:1[5-9]|20)\d0s|['\u2019]?\d0s|"
        r"twenties|thirties|forties|fifties|sixties|seventies|eighties|nineties)\b", re.I), _r_decade),
    (re.compile(
        r"\b(?:the\s+day\s+before\s+yesterday|the\s+day\s+after\s+tomorrow|"
        r"(?:yesterday|tomorrow)(?:\s+(?:morning|afternoon|evening|night))?|today|tonight|"
        r"last\s+night|this\s+(?:morning|afternoon|evening))\b", re.I), _r_dayword),
    (re.compile(
        r"\b(?P<the>the\s+)?(?P<rel>this\s+past|last|this|next|past|coming|previous|current|following)"
        r"\s+(?P<unit>week|weekend|month|year|decade)\b", re.I), _r_period),
    (re.compile(r"\b(?P<pre>over|on|at|during|for|this)\s+the\s+weekend\b|\b(?P<pre2>this)\s+weekend\b", re.I),
     lambda m, c: _r_bare_weekend(_Pre(m), c)),
    (re.compile(
        rf"\b(?:(?P<rel>this\s+past|last|next|this|coming|past|on)\s+)?(?P<wd>{_WD})(?P<plural>s)?"
        r"(?:\s+(?:morning|afternoon|evening|night))?\b", re.I), _r_weekday),
    (re.compile(rf"\b{_NUM}\s+(?P<unit>days?|weeks?|months?|years?|decades?)\s+(?:ago|back)\b", re.I), _r_ago),
    (re.compile(rf"\bin\s+(?:(?:about|around|roughly|another)\s+)?{_NUM}\s+(?P<unit>days?|weeks?|months?|years?)\b"
                r"(?P<fromnow>\s+from\s+now)?", re.I), _r_in_future),
    (re.compile(rf"\b{_NUM}\s+(?P<unit>days?|weeks?|months?|years?)\s+(?P<fromnow>from\s+now)\b", re.I), _r_in_future),
    (re.compile(rf"\bthe\s+(?:past|last|previous)\s+{_NUM}\s+(?P<unit>days|weeks|months|years|decades)\b", re.I), _r_past_n),
    (re.compile(r"\bthe\s+other\s+day\b", re.I), _r_other_day),
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


class _Pre:
    """Adapts the two alternatives of the bare-weekend rule to one ``pre`` group."""

    def __init__(self, m: re.Match):
        self._m = m

    def __getitem__(self, k):
        if k == "pre":
            return self._m["pre"] or self._m["pre2"]
        return self._m[k]

    def start(self):
        return self._m.start()

    def end(self):
        return self._m.end()


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
        if pm and t.granularity in ("month", "year", "season", "decade", "week") and "-" not in t.text[:1]:
            a = t.start - (len(before) - pm.start("part"))
            t = TimeMention(text[a:t.end], a, t.end, _part(t.window, pm["part"].split()[0]),
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


# ---- dateparser fallback -----------------------------------------------------------------

_FALLBACK_CUE = re.compile(r"\b(?:the\s+)?\d{1,2}(?:st|nd|rd|th)\b", re.I)


def _fallback(text: str, ref: datetime, taken: list[tuple[int, int]]) -> list[TimeMention]:
    """``dateparser.search_dates`` for strings the rules do not cover ("on the 5th").
    Only runs when an uncovered ordinal day is present, and only keeps matches that
    contain that cue: search_dates alone is too eager (it matches "We", "now", "may")."""
    cues = [m for m in _FALLBACK_CUE.finditer(text)
            if not any(a <= m.start() < b for a, b in taken)]
    if not cues:
        return []
    from dateparser.search import search_dates  # lazy: ~0.3 s import

    naive_ref = ref.replace(tzinfo=None)
    try:
        found = search_dates(text, languages=["en"], settings={
            "RELATIVE_BASE": naive_ref, "PREFER_DATES_FROM": "past",
            "RETURN_AS_TIMEZONE_AWARE": False, "REQUIRE_PARTS": ["day"],
        }) or []
    except Exception:  # dateparser raises assorted errors on odd input; the rules already ran
        return []
    out: list[TimeMention] = []
    pos = 0
    for s, dt in found:
        i = text.find(s, pos)
        if i < 0:
            continue
        pos = i + len(s)
        if not any(i <= c.start() < i + len(s) for c in cues):
            continue
        if any(i < b and a < i + len(s) for a, b in taken):
            continue
        out.append(TimeMention(s, i, i + len(s), day_window(dt.date()), "day", True))
    return out


# ---- public API ---------------------------------------------------------------------------


def parse_when(text: str, reference: datetime) -> list[TimeMention]:
    """Time expressions in ``text``, in order of appearance, each resolved against
    ``reference`` (the item's own timestamp; naive = UTC) to a UTC :class:`TimeWindow`
    spanning the period it names. Overlapping candidates keep the longest
    ("8 May, 2023" wins over "May, 2023"). Returns [] when there is none; never raises
    on ordinary text."""
    if not text:
        return []
    ref = utc(reference)
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
            w, gran, rel = r
            cands.append(TimeMention(m[0], m.start(), m.end(), w, gran, rel))
    cands.sort(key=lambda t: (-(t.end - t.start), t.start))
    picked: list[TimeMention] = []
    for t in cands:
        if all(t.end <= p.start or t.start >= p.end for p in picked):
            picked.append(t)
    picked += _fallback(text, ref, [(p.start, p.end) for p in picked])
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
    "in May 2023", "yesterday"), resolved against ``now`` (the query timestamp). Several
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

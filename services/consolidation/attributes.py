"""Single-valued attributes a fact states, found offline by patterns (issue 9 item 10).

A person has one name, one home city, one employer, one age, one relationship status and
one favourite X at a time. :func:`statements` reads the ``(subject, attribute) → value``
pairs a fact's text states *in the present* ("My name is Anna", "I live in Berlin",
"I now work at Microsoft", "Alice is 31 years old", "My favourite colour is green"), so
consolidation can tell that "I moved to Lisbon" contradicts "I live in Berlin" although
the two texts name different places (which the cosine/name rules keep apart).

Deliberately conservative — a missed statement only means the old behaviour (a separate
observation), a wrong one would revise an unrelated belief:

* present tense only ("I lived in Berlin", "I used to work at …" state no current value);
* a clause that is negated, hypothetical or a wish before the match (up to the clause's
  comma or "but") ("if I live in …",
  "I don't live in …", "I wish I worked at …") states nothing, nor does a question;
* names, places and employers must be capitalised words;
* a text that gives one attribute two different values states neither.

Subjects: first person ("I", "my") is the fact's speaker — its "Speaker:" prefix (the
offline extractor writes one), else ``speaker`` — or ``"user"``; third person is a
capitalised name, "the user", or a relative of the speaker ("my sister" → "anna's
sister"). Subjects, attributes and values are lowercased; plain regular expressions, so
the result is deterministic and needs no model.
"""

from __future__ import annotations

import re
from functools import lru_cache

#: The attributes recognised (``favourite <thing>`` is open-ended).
ATTRIBUTES = ("name", "home", "employer", "age", "relationship", "favourite")

Key = tuple[str, str]

_NAME = r"[A-Z][a-z'\-]+(?: [A-Z][a-z'\-]+)?"
_CAP = r"(?!I\b)[A-Z][\w'&\-]*"  # "I" starts a clause, never a name's part
# Places and organisations: capitalised words, with the lowercase joints of real names
# ("Rio de Janeiro", "Bank of America", "Stratford upon Avon") and an optional "the".
_PROPER = (rf"(?:the )?{_CAP}(?: (?:{_CAP}|(?:de|da|do|del|di|du|la|le|el|am|upon|of|&)"
           rf"(?= {_CAP})))*")
_NUMBER = (r"\d{1,3}|(?:twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety)(?:[- ](?:one|two|"
           r"three|four|five|six|seven|eight|nine))?|one|two|three|four|five|six|seven|eight|"
           r"nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen")
_STATUS = r"single|married|engaged|divorced|widowed|separated"
_ADV = r"(?: (?:now|currently|still|just|recently|finally|actually|officially|happily|newly))*"
_FAV_VALUE = r"[A-Za-z0-9][\w'&\- ]{0,60}?"
_FAV_END = (r"(?=\s*(?:$|[.,;:!?)]|\s(?:and|but|because|since|which|though|although|now|these "
            r"days|at the moment|nowadays|lately|right now)\b))")

# Third-person subjects: a name, "the user", or "my <relative>".
_SUBJ3 = rf"(?P<subj>(?:[Tt]he )?[Uu]ser|[Mm]y [a-z]+(?:-in-law)?|{_NAME})"

# (attribute, pattern); group "v" is the value, "subj" (if present) the subject,
# "fav" the favourite thing. First-person patterns have no "subj" group.
_PATTERNS: list[tuple[str, re.Pattern]] = [(a, re.compile(p)) for a, p in [
    # name
    ("name", rf"\b[Mm]y name(?:'s| is){_ADV} (?P<v>{_NAME})\b"),
    ("name", rf"\b(?:[Cc]all|[Pp]eople call|[Ee]veryone calls|[Ff]riends call) me (?P<v>{_NAME})\b"),
    ("name", rf"\bI go by (?P<v>{_NAME})\b"),
    ("name", rf"\bI(?:'m| am) called (?P<v>{_NAME})\b"),
    ("name", rf"\bI(?:'ve| have)? changed my name to (?P<v>{_NAME})\b"),
    ("name", rf"\b{_SUBJ3}'s name(?: is|'s){_ADV} (?P<v>{_NAME})\b"),
    # home (city or place of residence)
    ("home", rf"\bI{_ADV} (?:live|reside) in (?P<v>{_PROPER})"),
    ("home", rf"\bI(?:'m| am){_ADV} (?:living|based|residing) in (?P<v>{_PROPER})"),
    ("home", rf"\bI(?:'ve| have)?{_ADV} (?:moved|relocated)(?: back)?(?: from {_PROPER})?(?: back)?"
             rf" to (?P<v>{_PROPER})"),
    ("home", rf"\b[Mm]y home is(?: now)? in (?P<v>{_PROPER})"),
    ("home", rf"\b{_SUBJ3}{_ADV} (?:lives|resides) in (?P<v>{_PROPER})"),
    ("home", rf"\b{_SUBJ3} is{_ADV} (?:living|based|residing) in (?P<v>{_PROPER})"),
    ("home", rf"\b{_SUBJ3}(?: has)?{_ADV} (?:moved|relocated)(?: back)?(?: from {_PROPER})?"
             rf"(?: back)? to (?P<v>{_PROPER})"),
    # employer
    ("employer", rf"\bI{_ADV} work (?:at|for) (?P<v>{_PROPER})"),
    ("employer", rf"\bI(?:'m| am){_ADV} (?:working (?:at|for)|employed (?:at|by)) (?P<v>{_PROPER})"),
    ("employer", rf"\bI(?:'ve| have)?{_ADV} (?:started (?:working at|a (?:new )?job at|at)|got a "
                 rf"(?:new )?job (?:at|with)|got hired (?:at|by)|was hired by) (?P<v>{_PROPER})"),
    ("employer", rf"\b[Mm]y employer is{_ADV} (?P<v>{_PROPER})"),
    ("employer", rf"\b{_SUBJ3}{_ADV} works (?:at|for) (?P<v>{_PROPER})"),
    ("employer", rf"\b{_SUBJ3} is{_ADV} (?:working (?:at|for)|employed (?:at|by)) (?P<v>{_PROPER})"),
    ("employer", rf"\b{_SUBJ3}(?: has)?{_ADV} (?:started (?:working at|a (?:new )?job at)|got a "
                 rf"(?:new )?job (?:at|with)|got hired (?:at|by)|was hired by) (?P<v>{_PROPER})"),
    # age
    ("age", rf"\bI(?:'m| am){_ADV} (?P<v>{_NUMBER}) years? old\b"),
    ("age", rf"\bI{_ADV} turned (?P<v>{_NUMBER})\b"),
    ("age", rf"\b[Mm]y age is (?P<v>{_NUMBER})\b"),
    ("age", rf"\b{_SUBJ3} is{_ADV} (?P<v>{_NUMBER}) years? old\b"),
    ("age", rf"\b{_SUBJ3}{_ADV} turned (?P<v>{_NUMBER})\b"),
    # relationship status
    ("relationship", rf"\bI(?:'m| am){_ADV} (?P<v>{_STATUS})\b"),
    ("relationship", rf"\bI(?:'m| am){_ADV} (?P<v>in a relationship)\b"),
    ("relationship", rf"\bI{_ADV} got (?P<v>married|engaged|divorced)\b"),
    ("relationship", rf"\b{_SUBJ3} is{_ADV} (?P<v>{_STATUS}|in a relationship)\b"),
    ("relationship", rf"\b{_SUBJ3}{_ADV} got (?P<v>married|engaged|divorced)\b"),
    # favourite <thing>
    ("favourite", rf"\b[Mm]y (?:all-time |absolute )?favou?rite (?P<fav>[a-z]+(?: [a-z]+)?) "
                  rf"(?:is|'s){_ADV} (?P<v>{_FAV_VALUE}){_FAV_END}"),
    ("favourite", rf"\b{_SUBJ3}'s (?:all-time |absolute )?favou?rite (?P<fav>[a-z]+(?: [a-z]+)?) "
                  rf"(?:is|'s){_ADV} (?P<v>{_FAV_VALUE}){_FAV_END}"),
]]

# Words before a match (in its clause) that make it no statement of the present:
# negation, condition, wish, plan, belief, a past moment ("when I turned ten").
_GUARD = re.compile(
    r"\b(?:not|never|no longer|n't|if|unless|whether|wish|wished|would|could|might|maybe|"
    r"perhaps|hope|hoping|want|wants|wanted|plan|plans|planning|dream|dreams|imagine|suppose|"
    r"pretend|thinks|think|thought|used|before|until|once|anymore|when|whenever|after|since)\b",
    re.I)
# The guard looks back to the start of the match's clause only ("I used to work at Google,
# but I now work at Microsoft" states Microsoft).
_CLAUSE = re.compile(r",|\bbut\b|\bwhile\b|\bwhereas\b", re.I)
_SPEAKER = re.compile(r"^\s*([A-Z][\w.'-]*(?: [A-Z][\w.'-]*){0,3})\s*:\s+(?=\S)")
_CAPTION = re.compile(r"\s*\[shares a photo:[^\]]*\]\s*$")
_SENTENCE = re.compile(r"[^.!?;]+(?:[.!?;]+|$)")
# Capitalised words that are no one's name at the start of a third-person subject.
_NOT_SUBJECTS = {"i", "the", "a", "an", "we", "she", "he", "it", "they", "this", "that",
                 "there", "here", "who", "what", "which", "everyone", "someone", "nobody",
                 "then", "now", "so", "and", "but", "also", "yes", "no", "well", "today",
                 "yesterday", "tomorrow", "his", "her", "their", "our", "your", "its", "one"}
_ROLES = {"user", "human", "me"}
_FAV_NORMAL = {"colour": "color", "favorite": "favourite", "movies": "movie", "films": "film"}


def split_speaker(text: str, speaker: str = "") -> tuple[str, str]:
    """(speaker, body) of a fact text: the "Speaker:" prefix if it has one, else
    ``speaker``, else "user"; lowercased. The body has no prefix nor photo caption."""
    body = _CAPTION.sub("", text.replace("\u2019", "'"))
    m = _SPEAKER.match(body)
    if m:
        speaker, body = m.group(1), body[m.end():]
    who = (speaker or "user").strip().lower()
    return ("user" if who in _ROLES else who), body


def _subject(raw: str | None, speaker: str) -> str | None:
    if raw is None:
        return speaker
    low = raw.lower()
    if low in ("user", "the user"):
        return "user"
    if low.startswith("my "):
        return f"{speaker}'s {low[3:]}"
    words = low.split()
    if words[0] in _NOT_SUBJECTS:  # "Then Anna lives …": the name is the last word
        return words[1] if len(words) == 2 and words[1] not in _NOT_SUBJECTS else None
    return low


def _value(attr: str, raw: str) -> str:
    v = " ".join(raw.lower().split())
    if attr in ("home", "employer") and v.startswith("the "):
        v = v[4:]
    return v


def statements(text: str, speaker: str = "") -> dict[Key, str]:
    """``(subject, attribute) → value`` for every single-valued attribute ``text`` states
    in the present (see the module docstring). ``speaker`` names "I" when the text has no
    "Speaker:" prefix. Attributes are those of :data:`ATTRIBUTES`, a favourite as
    ``"favourite <thing>"`` ("favourite color"). Empty for questions."""
    return dict(_statements(text, speaker))


@lru_cache(maxsize=65536)  # every fact with a statement re-reads its scope's observations
def _statements(text: str, speaker: str) -> tuple[tuple[Key, str], ...]:
    who, body = split_speaker(text, speaker)
    if body.rstrip().endswith("?"):
        return ()
    found: dict[Key, set[str]] = {}
    for sm in _SENTENCE.finditer(body):
        sent = sm.group(0)
        if sent.rstrip().endswith("?"):
            continue
        for attr, pat in _PATTERNS:
            for m in pat.finditer(sent):
                if _GUARD.search(_CLAUSE.split(sent[:m.start()])[-1]):
                    continue
                subj = _subject(m.groupdict().get("subj"), who)
                if subj is None:
                    continue
                name = attr
                if attr == "favourite":
                    thing = " ".join(_FAV_NORMAL.get(w, w) for w in m.group("fav").split())
                    name = f"favourite {thing}"
                found.setdefault((subj, name), set()).add(_value(attr, m.group("v")))
    return tuple((k, next(iter(v))) for k, v in sorted(found.items()) if len(v) == 1)

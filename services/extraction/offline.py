"""Offline fact extraction (no LLM): retain items → self-contained facts with speakers,
entities, times and links.

What one item becomes:
- **Segments.** A chat turn "Speaker: text" (or ``metadata["speaker"]``) is one segment
  attributed to the speaker; a transcript with one "Name: ..." per line gives one segment
  per line; other text is split into paragraphs.
- **Sentences → facts.** spaCy splits each segment into sentences. Pure pleasantries
  ("Hey Mel!", "Good to see you!", "What's up with you?": no content word) are dropped,
  unless that would leave the item without any fact. The rest are grouped into facts of
  whole sentences: a short turn (≤ 4 sentences, ≤ 80 words) stays one fact; longer text is
  cut into groups of up to 3 sentences / ~60 words. A fact keeps its speaker prefix so it
  stands alone ("Melanie: I'm swamped with the kids & work."); an image caption
  (``metadata["blip_caption"]``, ``"image_caption"`` or ``"caption"``) is appended to the
  item's last fact as "[shares a photo: …]".
- **Type.** ``experience`` when the speaker is the agent itself ("assistant", "agent",
  "AI", "bot", or ``metadata["speaker_role"]`` in agent/assistant), else ``world``.
- **Times.** ``mentioned_at`` is the item's timestamp. ``occurred_start/end`` is the
  window of the fact's first time expression, resolved against the item's timestamp by
  :mod:`mneme.timeparse` ("yesterday" in a turn of 8 May 2023 → all of 7 May 2023). When
  the fact names no time, both default to the whole day of the item's timestamp: the
  event was told then, and "today or shortly before" is the best offline evidence there
  is -- a temporal query for that day should find it. Days are the speaker's calendar
  days: with the item's ``time_zone`` the timestamp is read on that zone's clock
  (:func:`mneme.timeparse.wall_clock`). Relative expressions are also
  annotated in the text with their resolved dates ("yesterday (7 May 2023)") so that the
  fact stays true when read later (turn off with ``annotate_times=False``).
- **Entities.** The speaker (PERSON) first, then the NER entities and noun-phrase
  concepts of the fact's sentences and caption (:func:`mneme.nlp.entity_mentions`),
  resolved per bank by :class:`~services.extraction.resolver.EntityResolver`, which keeps
  kinds apart ("Jordan" the person ≠ "Jordan" the country). A mention that is the name
  (or first name) of a speaker of the request is taken as that PERSON whatever label the
  small NER model gave it ("Gina" tagged GPE in Gina's own conversation). Text in scripts
  written without spaces (CJK, Thai) yields no entities: the English pipeline cannot
  segment it (its keywords are found through the text stores' CJK segmentation).
- **Links.** ``temporal`` (weight 1.0) from each fact to the previous fact of the same item;
  ``causal`` (weight 1.0) when a fact starts with a causal connective ("because", "so I",
  "that's why", "therefore", "as a result") -- to the previous fact of the item, or, for
  the first fact of an item, to the last fact of the item before it in the same request.
  With ``link_adjacent=True`` (default) the first fact of an item also gets a ``temporal``
  link (weight 0.5) to the last fact of the previous item of the same request when both
  belong to the same document and were said within a day: consecutive turns of one
  conversation (a question and its answer) belong together.
- **Ids.** Fact n of item i: ``derive_id(source_id, i, n)``; its chunk:
  ``derive_id(source_id, i, "chunk", n)`` (every fact is its own chunk here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Callable, Sequence

from mneme import nlp as _nlp
from mneme.domain import EXPERIENCE, WORLD, Fact, Link, RetainItem, derive_id, entity_key, utc
from mneme.timeparse import day_window, parse_when, wall_clock
from services.extraction.llm import CANCELLED, ExtractionIncomplete, ItemExtractionFailed
from services.extraction.resolver import EntityResolver
from services.extraction.vectors import EmbeddingParts

__all__ = ["OfflineExtractor", "AGENT_SPEAKERS", "embedding_parts", "named_speaker",
           "sentences_of"]

#: Speaker names (lowercase) that mean the agent itself → ``experience`` facts.
AGENT_SPEAKERS = frozenset({"assistant", "agent", "ai", "bot", "ai assistant"})
_AGENT_ROLES = frozenset({"agent", "assistant", "ai"})
_ROLE_WORDS = frozenset({"user", "assistant", "agent", "ai", "system", "human", "bot"})
# Words that end in a colon but do not name a speaker.
_NOT_SPEAKERS = frozenset("""
note notes update summary q a question answer title subject todo warning important reminder
tip tips example edit ps re fyi source date time location http https step steps result
results conclusion caution info tldr ingredients total name address phone email
""".split())
_SPEAKER_RE = re.compile(r"^[ \t]*([A-Za-z][\w.'\u2019-]*(?: [A-Za-z][\w.'\u2019-]*){0,3})[ \t]*:[ \t]+(?=\S)")
_CAPTION_KEYS = ("blip_caption", "image_caption", "caption")
_CAUSAL_RE = re.compile(
    r"^\W*(?:because\b|therefore\b|thus\b|hence\b|consequently\b|as\s+a\s+result\b|"
    r"(?:that|this|which)(?:'s|\u2019s|\s+is|\s+was)\s+why\b|(?:that|this)\s+is\s+because\b|"
    r"because\s+of\s+(?:that|this)\b|so,|so\s+(?:i|we|he|she|they|you|my|our|now|then|"
    r"that's|that\u2019s|it)\b)", re.I)
# Words that carry no content in a sentence: greetings, thanks, small talk. A sentence
# with nothing but these, stop words, punctuation and vocatives is a pleasantry.
_PLEASANTRY = frozenset("""
hey hi hello thanks thank good great cool wow awesome amazing nice glad see bye lol haha
yeah yes yep yup ok okay sure congrats congratulations totally really new talk soon later
care take catch chat chatting hear pleasure welcome sound sounds fun agree absolutely
definitely exactly true right love lovely happy appreciate luck cheers proud hope well
go going be do have get doing up fantastic wonderful incredible sweet kind thoughtful
oh omg wish best miss missed cute beautiful nice interesting exciting excited stuff
thing things lot lots guy guys buddy friend dear man way awesome impressive inspiring
tell share know sorry hear hearing keep posted look looks like feel feels mean means
""".split())
_GREETING = frozenset({"hey", "hi", "hello", "thanks", "thank", "bye", "congrats", "wow",
                       "oh", "yep", "yeah", "yes", "sure", "congratulations", "dear", "hiya"})

#: A fact of fewer words than this is embedded with the turn it answers (see
#: :func:`embedding_parts`); the context itself is cut to ``_CONTEXT_WORDS`` words.
_SHORT_REPLY_WORDS = 12
_CONTEXT_WORDS = 40
#: A sentence of fewer words than this ("Wow!", "Thanks so much.") gets no vector of its
#: own in a long fact's (see :func:`embedding_parts`).
_SENTENCE_WORDS = 3
# a sentence ends at . ! ? before a capital or a quote, not after an initial or a title
_SENTENCE_END = re.compile(r"(?<=[.!?])(?<!\b[A-Z]\.)(?<!\b(?:Dr|Mr|Ms|St|Jr|Sr|vs)\.)"
                           r"(?<!\bMrs\.)(?<!\bProf\.)\s+(?=[A-Z\"'\u201c])")

_WORDS_PER_FACT = 60
_SENTENCES_PER_FACT = 3
_SHORT_ITEM_WORDS = 80
_SHORT_ITEM_SENTENCES = 4
#: Items parsed per spaCy call when a request can be cancelled: ``stop`` is asked between
#: slices, so a cancel stops a large request within one slice's work (about a second).
SLICE_ITEMS = 64


@dataclass
class _Segment:
    item_pos: int  # position of the item in the request
    speaker: str | None
    text: str


@dataclass
class _Chunk:
    speaker: str | None
    sentences: list  # spaCy Spans
    text: str = ""
    caption: str = ""
    caption_doc: object = None
    links: list[Link] = field(default_factory=list)
    causal: bool = False


def _speaker_of(line: str) -> tuple[str | None, str]:
    """("Caroline", "I went ...") for "Caroline: I went ..."; (None, line) otherwise."""
    m = _SPEAKER_RE.match(line)
    if not m:
        return None, line
    name = m.group(1).strip()
    words = name.split()
    if any(w.lower().strip(".") in _NOT_SPEAKERS for w in words):
        return None, line
    # a role ("user", "assistant") or a name in title case ("Caroline", "Dr. Ann Lee");
    # "Meeting notes: ..." is a heading, not a speaker
    if not (name.lower() in _ROLE_WORDS or all(w[0].isupper() for w in words)):
        return None, line
    if line[m.end():].startswith("//"):
        return None, line  # a URL scheme
    return name, line[m.end():]


def _segments(pos: int, item: RetainItem) -> list[_Segment]:
    text = item.content.strip()
    if not text:
        return []
    meta_speaker = (item.metadata or {}).get("speaker", "").strip()
    if meta_speaker:
        if text.lower().startswith(meta_speaker.lower() + ":"):
            text = text[len(meta_speaker) + 1:].strip()
        return [_Segment(pos, meta_speaker, text)]
    lines = text.splitlines()
    parsed = [_speaker_of(ln) for ln in lines]
    if any(s for s, _ in parsed):
        segs: list[_Segment] = []
        for spk, body in parsed:
            if spk is not None or not segs:
                segs.append(_Segment(pos, spk, body.strip()))
            elif body.strip():
                segs[-1].text += "\n" + body.strip()
        return [s for s in segs if s.text]
    # plain text: paragraphs, so no fact spans a paragraph break
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [_Segment(pos, None, p) for p in paras]


def _is_agent(speaker: str | None, item: RetainItem) -> bool:
    role = (item.metadata or {}).get("speaker_role", "").strip().lower()
    if role:
        return role in _AGENT_ROLES
    return bool(speaker) and speaker.strip().lower() in AGENT_SPEAKERS


def _caption(item: RetainItem) -> str:
    meta = item.metadata or {}
    for k in _CAPTION_KEYS:
        c = (meta.get(k) or "").strip()
        if c:
            # "a photo of a dog ..." → "a dog ...": the prefix repeats "[shares a photo"
            return re.sub(r"^(?:a|an)\s+(?:photo|picture|image|pic)\s+of\s+", "", c, flags=re.I)
    return ""


def _is_pleasantry(sent, names: set[str]) -> bool:
    """True when the sentence has no content word (see ``_PLEASANTRY``)."""
    greeting = any(t.lower_ in _GREETING or t.pos_ == "INTJ" for t in sent)
    for t in sent:
        if t.is_punct or t.is_space or t.is_stop or not t.text.strip():
            continue
        low, lemma = t.lower_, t.lemma_.lower()
        if low in _PLEASANTRY or lemma in _PLEASANTRY or t.pos_ in ("INTJ", "PRON", "DET",
                                                                   "AUX", "PART", "CCONJ",
                                                                   "SCONJ", "ADP", "SYM"):
            continue
        if t.pos_ == "PROPN" and (greeting or low in names or any(n.startswith(low) for n in names)):
            continue  # a vocative: "Thanks, Mel!"
        if t.pos_ == "ADV" and not t.is_alpha:
            continue
        return False
    return True


def _group(sents: list) -> list[list]:
    """Sentences → groups of whole sentences (see the module docs for the sizes)."""
    words = [len(s.text.split()) for s in sents]
    if len(sents) <= _SHORT_ITEM_SENTENCES and sum(words) <= _SHORT_ITEM_WORDS:
        return [sents] if sents else []
    groups: list[list] = []
    cur: list = []
    n = 0
    for s, w in zip(sents, words):
        if cur and (len(cur) >= _SENTENCES_PER_FACT or n + w > _WORDS_PER_FACT):
            groups.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += w
    if cur:
        if groups and n < 8:
            groups[-1].extend(cur)  # a short tail reads better with what precedes it
        else:
            groups.append(cur)
    return groups


class OfflineExtractor:
    """:class:`mneme.ports.Extractor` without an LLM (see the module docs).

    ``resolver``: the per-bank :class:`EntityResolver` (default: a memory-only one);
    ``annotate_times``: append resolved dates to relative time expressions in fact text;
    ``link_adjacent``: link consecutive items of one request (see the module docs).
    Thread-safe as far as its collaborators are (spaCy calls are serialised by
    :mod:`mneme.nlp`, the resolver locks itself).
    """

    def __init__(self, resolver: EntityResolver | None = None, annotate_times: bool = True,
                 link_adjacent: bool = True):
        self.resolver = resolver or EntityResolver()
        self.annotate_times = annotate_times
        self.link_adjacent = link_adjacent

    def extract(self, bank_id: str, item: RetainItem, item_index: int,
                source_id: str) -> list[Fact]:
        """Facts of one item (no embeddings); ids ``derive_id(source_id, item_index, n)``."""
        return self.extract_many(bank_id, [item], source_id, first_index=item_index)

    def extract_many(self, bank_id: str, items: Sequence[RetainItem], source_id: str,
                     first_index: int = 0, stop: Callable[[], bool] | None = None) -> list[Fact]:
        """Facts of all ``items`` of one request, in item order; item k has index
        ``first_index + k``. Texts go through spaCy in ``nlp.pipe`` calls of
        :data:`SLICE_ITEMS` items and all entities through one resolver transaction.
        Every item with non-blank content yields at least one fact; blank items yield none.

        ``stop()`` (the operation was cancelled) is asked between slices, not before the
        first (the handler asks before it starts). Once it is true the items not parsed
        yet are not extracted: raises :class:`ExtractionIncomplete` with the facts of the
        items before them and a failure of reason ``cancelled`` for each of the others."""
        # spaCy's objects live only inside the zone (in _facts' frame): what these texts
        # added to the pipeline's strings is dropped at its end (a server parses for months)
        with _nlp.zone():
            facts, mention_lists, done, speakers = self._facts(bank_id, items, source_id,
                                                               first_index, stop)
        for f, refs in zip(facts, self.resolver.resolve_many(bank_id, mention_lists)):
            f.entities = refs
        if done < len(items):
            raise ExtractionIncomplete(facts, {
                first_index + k: ItemExtractionFailed(
                    first_index + k, CANCELLED,
                    "the operation was cancelled before this item was extracted")
                for k in range(done, len(items))},
                {first_index + k: speakers[k] for k in range(done, len(items)) if speakers[k]})
        return facts

    def _facts(self, bank_id: str, items: Sequence[RetainItem], source_id: str,
               first_index: int, stop: Callable[[], bool] | None = None
               ) -> tuple[list[Fact], list[list[tuple[str, str]]], int, list[list[str]]]:
        """:meth:`extract_many`'s facts without entities, each fact's entity mentions
        as (name, label) pairs (plain strings: nothing of spaCy's is returned), how
        many items were extracted (fewer than ``items`` when ``stop()`` turned true), and
        the entity ids of each item's speakers (resolved for every item, up front)."""
        segs_by_item = [_segments(k, it) for k, it in enumerate(items)]
        captions = [_caption(it) for it in items]
        all_segs = [s for segs in segs_by_item for s in segs]
        speakers = list(dict.fromkeys(s.speaker for s in all_segs if s.speaker))
        names = {n.lower() for sp in speakers for n in sp.split()}
        speaker_keys = {entity_key(sp) for sp in speakers} | {
            entity_key(sp.split()[0]) for sp in speakers if len(sp.split()[0]) >= 3}

        # Speakers first, so the full name "Melanie" becomes canonical before a later
        # "Mel" in the text can claim it (the resolver then makes "Mel" an alias).
        # (one list per speaker: the same decisions as one list, and each speaker's id)
        ids = dict(zip(speakers, self.resolver.resolve_many(
            bank_id, [[(s, "PERSON")] for s in speakers]))) if speakers else {}
        item_speakers = [list(dict.fromkeys(r.id for s in segs if s.speaker
                                            for r in ids.get(s.speaker, ())))
                         for segs in segs_by_item]

        facts: list[Fact] = []
        mention_lists: list[list[tuple[str, str]]] = []
        prev_last: tuple[RetainItem, str] | None = None
        step = SLICE_ITEMS if stop is not None else max(1, len(items))
        for a in range(0, len(items), step):
            if a and stop is not None and stop():
                return facts, mention_lists, a, item_speakers
            b = min(len(items), a + step)
            per_item = self._chunks(items[a:b], segs_by_item[a:b], captions[a:b], names)
            prev_last = self._slice_facts(bank_id, items[a:b], per_item, source_id,
                                          first_index + a, speaker_keys, prev_last,
                                          facts, mention_lists)
        return facts, mention_lists, len(items), item_speakers

    def _chunks(self, items: Sequence[RetainItem], segs_by_item: list, captions: list[str],
                names: set[str]) -> list[list[_Chunk]]:
        """Each item's chunks (sentence groups, its caption on the last), parsed in one
        spaCy call."""
        all_segs = [s for segs in segs_by_item for s in segs]
        texts = [s.text for s in all_segs] + [c for c in captions if c]
        docs = _nlp.parse_many(texts)
        seg_docs = dict(zip(map(id, all_segs), docs[:len(all_segs)]))
        cap_docs = iter(docs[len(all_segs):])
        cap_doc = [next(cap_docs) if c else None for c in captions]
        per_item: list[list[_Chunk]] = []
        for k, (item, segs) in enumerate(zip(items, segs_by_item)):
            chunks: list[_Chunk] = []
            fallback: list[_Chunk] = []
            for seg in segs:
                doc = seg_docs[id(seg)]
                sents = [s for s in doc.sents if s.text.strip()]
                kept = [s for s in sents if not _is_pleasantry(s, names)]
                chunks += [_Chunk(seg.speaker, g) for g in _group(kept)]
                if sents:
                    fallback.append(_Chunk(seg.speaker, sents))
            if captions[k]:
                if not chunks and fallback:
                    chunks = [fallback[-1]]  # "Look at this!" + a photo is content
                elif not chunks:  # only a photo
                    chunks = [_Chunk((item.metadata or {}).get("speaker") or None, [])]
                chunks[-1].caption = captions[k]
                chunks[-1].caption_doc = cap_doc[k]
            if not chunks and fallback:
                chunks = fallback  # never lose an item: keep its small talk
            per_item.append(chunks)
        return per_item

    def _slice_facts(self, bank_id: str, items: Sequence[RetainItem],
                     per_item: list[list[_Chunk]], source_id: str, first_index: int,
                     speaker_keys: set[str], prev_last: tuple[RetainItem, str] | None,
                     facts: list[Fact], mention_lists: list[list[tuple[str, str]]]
                     ) -> tuple[RetainItem, str] | None:
        """Append the facts of ``items`` (and their mentions) to ``facts`` and
        ``mention_lists``; ``prev_last`` is the last item before them with its last fact
        id (the link across slices), and the same for these items is returned."""
        for k, (item, chunks) in enumerate(zip(items, per_item)):
            idx = first_index + k
            ts = utc(item.timestamp)
            local = wall_clock(ts, item.time_zone)  # dates are the speaker's calendar dates
            default = day_window(local)
            item_facts: list[Fact] = []
            for n, ch in enumerate(chunks):
                text, window = self._text_and_time(ch, local)
                fid = derive_id(source_id, idx, n)
                meta = dict(item.metadata or {})
                if ch.speaker:
                    meta.setdefault("speaker", ch.speaker)
                links: list[Link] = []
                causal = bool(ch.sentences) and bool(_CAUSAL_RE.match(ch.sentences[0].text))
                if item_facts:
                    links.append(Link(item_facts[-1].id, "temporal", 1.0))
                    if causal:
                        links.append(Link(item_facts[-1].id, "causal", 1.0))
                elif prev_last is not None:
                    p_item, p_id = prev_last
                    if causal:
                        links.append(Link(p_id, "causal", 1.0))
                    if self.link_adjacent and p_item.document_id == item.document_id and \
                            abs(utc(p_item.timestamp) - ts) <= timedelta(days=1):
                        links.append(Link(p_id, "temporal", 0.5))
                f = Fact(
                    id=fid, bank_id=bank_id, text=text,
                    fact_type=EXPERIENCE if _is_agent(ch.speaker, item) else WORLD,
                    context=item.context,
                    occurred_start=window.start if window else default.start,
                    occurred_end=window.end if window else default.end,
                    mentioned_at=ts, tags=tuple(item.tags), metadata=meta,
                    document_id=item.document_id, chunk_id=derive_id(source_id, idx, "chunk", n),
                    links=links, item_index=idx)
                item_facts.append(f)
                mentions: list[tuple[str, str]] = []
                if ch.speaker:
                    mentions.append((ch.speaker, "PERSON"))
                for s in ch.sentences:
                    mentions += _nlp.entity_mentions(s)
                if ch.caption_doc is not None:
                    mentions += _nlp.entity_mentions(ch.caption_doc)
                mention_lists.append([(n, "PERSON" if l != "PERSON" and entity_key(n) in speaker_keys
                                       else l) for n, l in mentions])
            facts += item_facts
            # an item without facts (blank) breaks the chain: the next one does not
            # answer the item before it
            prev_last = (item, item_facts[-1].id) if item_facts else None
        return prev_last

    @staticmethod
    def embedding_parts(facts: Sequence[Fact]) -> list[EmbeddingParts]:
        """See :func:`embedding_parts`."""
        return embedding_parts(facts)

    def _text_and_time(self, ch: _Chunk, ts: datetime):
        """Fact text (speaker prefix, annotated times, caption) and the window of its
        first time expression (None when it names no time); ``ts`` is the item's time on
        its speaker's wall clock (:func:`mneme.timeparse.wall_clock`)."""
        parts: list[str] = []
        window = None
        for s in ch.sentences:
            st = s.text.strip()
            mentions = parse_when(st, ts)
            if mentions and window is None:
                window = mentions[0].window
            if self.annotate_times:
                for m in reversed(mentions):
                    if m.relative and m.describe():
                        st = f"{st[:m.end]} ({m.describe()}){st[m.end:]}"
            parts.append(st)
        body = " ".join(parts)
        if ch.caption:
            body = f"{body} [shares a photo: {ch.caption}]".strip()
        text = f"{ch.speaker}: {body}" if ch.speaker else body
        return text, window


def _body_words(text: str) -> int:
    """Words of a fact's own statement: without its "Speaker:" prefix and photo caption."""
    body = re.sub(r"\[shares a photo:[^\]]*\]\s*$", "", text)
    _, body = _speaker_of(body)
    return len(body.split())


# First-person forms → the speaker's name (with the verb of a contraction in the third
# person), for the text a chat turn is embedded as.
_FIRST_PERSON = [(re.compile(r"\bI(?:'m|\u2019m| am)\b"), "{} is"),
                 (re.compile(r"\bI(?:'ve|\u2019ve)\b"), "{} has"),
                 (re.compile(r"\bI(?:'ll|\u2019ll)\b"), "{} will"),
                 (re.compile(r"\bI(?:'d|\u2019d)\b"), "{} would"),
                 (re.compile(r"\bI\b"), "{}"),
                 (re.compile(r"\b(?:[Mm]y|[Mm]ine)\b"), "{}'s"),
                 (re.compile(r"\b(?:me|myself)\b"), "{}")]


def named_speaker(text: str) -> str:
    """A chat turn's text with its speaker named instead of "I": "Caroline: I went to my
    support group" → "Caroline: Caroline went to Caroline's support group". Text without
    a speaker prefix, or whose speaker is a role ("user", "assistant"), is unchanged.

    For embedding only (the fact's text stays verbatim): a small sentence encoder does
    not tie "I" to the "Caroline:" in front of it, so "What did Caroline do ...?" is
    nearer to the named form. Measured with MiniLM-L6 on the LoCoMo dev split
    (README, Benchmark): evidence recall@10 0.733 → 0.753, multi-hop 0.432 → 0.471; the
    same with the prefix dropped measured 0.749, dropping the prefix alone 0.740, and
    also naming the addressee for "you" 0.741."""
    speaker, body = _speaker_of(text)
    if not speaker or speaker.lower() in _ROLE_WORDS:
        return text
    for rx, repl in _FIRST_PERSON:
        body = rx.sub(repl.format(speaker), body)
    return f"{speaker}: {body}"


def embedding_parts(facts: Sequence[Fact]) -> list[EmbeddingParts]:
    """How each of ``facts`` (one request's facts, in order) is embedded
    (:func:`services.extraction.vectors.embed_parts` makes one vector of it). The texts
    name the speaker instead of "I" (:func:`named_speaker`); the fact's own text stays
    verbatim, only its vector changes (and replay reuses it, as derived events carry
    their embeddings).

    * A short reply ("Melanie: Yeah, I painted that lake sunrise last year!") means
      little on its own: a fact of fewer than ``_SHORT_REPLY_WORDS`` words that starts an
      item linked to the previous turn (the ``temporal`` 0.5 link of ``link_adjacent``) is
      embedded as one text with that turn: "<fact> (in reply to <previous fact>)".
    * A longer fact of two or more sentences (:func:`sentences_of`) is embedded as its
      sentences, the sum of their vectors: a turn that mixes topics ("... It reminds me of
      the film camera I had as a kid" in a turn about nature) is then near a question
      about any one of them, not only the average of the whole. Other facts: their text.
    * A fact that is not a short reply and follows a turn takes a little of that turn's
      vector as context (``context``: its index; weight
      :data:`~services.extraction.vectors.CONTEXT_WEIGHT`): "That's my sister and my
      dogs" after "Who is in the photo?".

    Measured on the LoCoMo dev split (README, Benchmark; full ``make bench`` runs):
    evidence recall@10 0.756 before; the whole text and its sentences 0.764 (at twice
    the embedding work); the sentences alone 0.761; the sentences and the turn before
    0.783."""
    at = {f.id: k for k, f in enumerate(facts)}
    out: list[EmbeddingParts] = []
    for f in facts:
        text = named_speaker(f.text)
        prev = next((at[lk.target_id] for lk in f.links
                     if lk.kind == "temporal" and lk.weight < 1.0 and lk.target_id in at),
                    None)
        if prev is not None and _body_words(f.text) < _SHORT_REPLY_WORDS:
            ctx = named_speaker(facts[prev].text).split()
            ctx_text = " ".join(ctx[:_CONTEXT_WORDS]) + (" …" if len(ctx) > _CONTEXT_WORDS else "")
            out.append(EmbeddingParts((f"{text} (in reply to {ctx_text})",)))
        else:
            out.append(EmbeddingParts(tuple(sentences_of(text) or [text]), prev))
    return out


def sentences_of(text: str) -> list[str]:
    """The sentences of ``text`` of at least ``_SENTENCE_WORDS`` words, each with the
    text's "Speaker: " prefix, when there are two or more of them; else [] (a text of
    one sentence is its own sentence). Sentences end at ".", "!" or "?" before a capital
    or a quote; a trailing photo caption stays with the last sentence."""
    speaker, body = _speaker_of(text)
    parts = [p for p in _SENTENCE_END.split(body) if len(p.split()) >= _SENTENCE_WORDS]
    if len(parts) < 2:
        return []
    return [f"{speaker}: {p}" if speaker else p for p in parts]

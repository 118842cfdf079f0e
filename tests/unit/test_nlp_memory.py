"""mneme.nlp.zone: what parsing adds to a spaCy pipeline (strings, lexemes) is dropped,
so a long-running server does not grow with the text it has seen."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone

from mneme import nlp
from mneme.domain import RetainItem
from services.extraction.offline import OfflineExtractor

NOW = datetime(2024, 5, 1, 12, tzinfo=timezone.utc)


def _novel(n: int) -> list[str]:
    """Texts each with tokens no pipeline has seen (order codes, street names, e-mails)."""
    out = []
    for _ in range(n):
        code = uuid.uuid4().hex[:10].upper()
        out.append(f"Order {code} went to Zorb{code[:6]} Street; mail {code.lower()}@ex.com.")
    return out


def _strings(pipeline: str = "default") -> int:
    return len(nlp.nlp(pipeline).vocab.strings)


def test_parsing_outside_a_zone_keeps_new_strings_and_inside_one_drops_them():
    nlp.parse("warm up")
    before = _strings()
    nlp.parse_many(_novel(20))  # the behaviour the zone exists for
    grown = _strings()
    assert grown > before + 20
    with nlp.zone():
        docs = nlp.parse_many(_novel(50))
        names = [e.text for d in docs for e in d.ents]  # usable inside
        assert _strings() > grown
    assert _strings() == grown
    assert names and all(isinstance(n, str) for n in names)


def test_zones_nest_in_one_thread_and_other_threads_wait_for_the_outer_one():
    entered = threading.Event()
    order: list[str] = []

    def other():
        entered.wait(5)
        with nlp.zone():
            order.append("other")

    t = threading.Thread(target=other)
    t.start()
    with nlp.zone():
        base = _strings()
        with nlp.zone():  # joins the outer zone
            nlp.parse(_novel(1)[0])
        assert _strings() > base  # still there: only the outer zone's end drops them
        entered.set()
        time.sleep(0.2)  # the other thread is waiting for the pipeline meanwhile
        order.append("outer")
    t.join(5)
    assert order == ["outer", "other"]
    assert _strings() == base


def test_extraction_leaves_the_pipeline_as_it_found_it_and_keeps_its_names():
    x = OfflineExtractor()
    x.extract_many("b", [RetainItem(content="warm up", timestamp=NOW)], "w")
    before = _strings()
    texts = _novel(30)
    items = [RetainItem(content=f"Caroline: {t} Melanie sent it from Boston.", timestamp=NOW,
                        document_id=f"d{k}", metadata={"speaker": "Caroline"})
             for k, t in enumerate(texts)]
    facts = x.extract_many("b", items, "s")
    assert _strings() == before
    assert len(facts) == 30
    for f, t in zip(facts, texts):
        code = t.split()[1]
        assert code in f.text  # the text is the item's, intact after the zone
        names = {e.name for e in f.entities}
        assert {"Caroline", "Melanie", "Boston"} <= names


def test_query_analysis_leaves_the_query_pipeline_as_it_found_it():
    qa = nlp.QueryAnalyzer()
    qa.entity_keys("What did Melanie paint?")
    before = _strings("query")
    query = f"What did Melanie order from Zorb{uuid.uuid4().hex[:8]} in Boston?"
    keys = qa.entity_keys(query)
    assert _strings("query") == before
    assert "melanie" in keys and "boston" in keys and all(isinstance(k, str) for k in keys)
    # The query did bring new strings (the zone had something to drop): parsed outside
    # one, it grows the pipeline. Whether NER tags the made-up name varies with its
    # random letters, so the keys are not asked to hold it.
    nlp.nlp("query")(query)
    assert _strings("query") > before

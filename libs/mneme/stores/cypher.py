"""The one Cypher query set of the graph store, shared by the FalkorDB and Neo4j adapters.

Kept to the dialect both speak: parameters (``$name``), ``UNWIND`` batches, ``MERGE`` on
our own ids, epoch-second numbers for times (no ``datetime()``), no ``elementId()``, no
``EXISTS {}`` subqueries (counts via ``OPTIONAL MATCH`` … ``count()`` instead), and an
explicit ``u <> v`` where a pattern could come back to the node it started from, and
``CALL { WITH e … }`` subqueries for a per-row top-k (``ORDER BY … LIMIT`` inside).
Only the index DDL differs per backend, and the subqueries' import: FalkorDB knows only
the importing ``WITH``, which Neo4j's Cypher 25 (the language of 2026.02+ databases)
replaced by ``CALL (e) {``; the Neo4j adapter rewrites it (:func:`scope_clause`).

Model::

    (:Unit {id, bank_id, document_id, fact_type, occurred_start, occurred_end, mentioned_at,
           tags, stub})
    (:Entity {id, bank_id, name, key, label, aliases, split_from})
    (:Unit)-[:MENTIONS]->(:Entity)
    (:Unit)-[:LINK {kind, weight}]->(:Unit)
    (:Bank {bank_id, version})

A ``stub`` Unit is a link target whose fact has not arrived (or was deleted while other
units still link to it); it is never counted or returned. ``Entity.key`` is
``mneme.domain.entity_key`` of the latest name, ``aliases`` every key it has had.
``Unit.tags`` is the fact's tags, sorted, each once ([] for an untagged fact; null on a
stub, and on units projected by a release before the tag-scoped entity reads until a
replay: :func:`unit_tags_condition` never passes those).
``Bank.version`` is a fresh token written by every unit of work that changes the bank's
units or edges, last (see :data:`TOUCH_BANK`): a reader that holds a copy of the bank's
adjacency knows it is current while the token has not changed.
"""

import re

_IMPORTING_WITH = re.compile(r"CALL\s*\{\s*WITH\s+(\w+(?:\s*,\s*\w+)*)[ \t]*\n")


def scope_clause(query: str) -> str:
    """``query`` with each ``CALL {`` subquery that begins with an importing ``WITH a, b``
    (on a line of its own) written as ``CALL (a, b) {``, Neo4j's variable scope clause
    (Neo4j 5.23+; the only form in Cypher 25). Other text is returned unchanged."""
    return _IMPORTING_WITH.sub(lambda m: f"CALL ({m.group(1)}) {{\n", query)


# ---- index DDL, per backend -----------------------------------------------------------------

#: FalkorDB: one range index per property; re-creating one raises "already indexed".
FALKOR_INDEXES = (
    "CREATE INDEX FOR (n:Unit) ON (n.id)",
    "CREATE INDEX FOR (n:Unit) ON (n.bank_id)",
    "CREATE INDEX FOR (e:Entity) ON (e.id)",
    "CREATE INDEX FOR (e:Entity) ON (e.bank_id)",
    "CREATE INDEX FOR (e:Entity) ON (e.key)",
    "CREATE INDEX FOR (e:Entity) ON (e.split_from)",
    "CREATE INDEX FOR (b:Bank) ON (b.bank_id)",
)

#: Neo4j 5+: idempotent (``IF NOT EXISTS``). (bank_id, id) is a composite uniqueness
#: constraint (Community edition has them), which also backs MERGE with an index and
#: keeps two writers from MERGE-ing the same node twice; the rest are range indexes.
NEO4J_INDEXES = (
    "CREATE CONSTRAINT unit_bank_id IF NOT EXISTS "
    "FOR (n:Unit) REQUIRE (n.bank_id, n.id) IS UNIQUE",
    "CREATE CONSTRAINT entity_bank_id IF NOT EXISTS "
    "FOR (e:Entity) REQUIRE (e.bank_id, e.id) IS UNIQUE",
    "CREATE CONSTRAINT bank_id IF NOT EXISTS FOR (b:Bank) REQUIRE b.bank_id IS UNIQUE",
    "CREATE INDEX unit_bank_doc IF NOT EXISTS FOR (n:Unit) ON (n.bank_id, n.document_id)",
    "CREATE INDEX entity_bank_key IF NOT EXISTS FOR (e:Entity) ON (e.bank_id, e.key)",
    "CREATE INDEX entity_bank_split_from IF NOT EXISTS FOR (e:Entity) "
    "ON (e.bank_id, e.split_from)",
)

# ---- writes (all scoped by $bank_id) -----------------------------------------------------

#: $units: [{id, document_id, fact_type, occurred_start, occurred_end, mentioned_at, tags}]
#: (times as epoch seconds or null; tags sorted, each once)
UPSERT_UNITS = """
UNWIND $units AS u
MERGE (n:Unit {bank_id: $bank_id, id: u.id})
SET n.document_id = u.document_id, n.fact_type = u.fact_type,
    n.occurred_start = u.occurred_start, n.occurred_end = u.occurred_end,
    n.mentioned_at = u.mentioned_at, n.tags = u.tags, n.stub = false
"""

#: Before the units $ids lose their edges (a delete, or an upsert that rewrites them):
#: the entities they mention that no other unit mentions and $keep (the entities an
#: upsert's new versions mention) does not name, each with the entity it was split off
#: (``split_from``, null for most) and whether that one exists (1/0). They are deleted
#: before the edges are cleared, decided from the edges as they are: a write cut short
#: after any of its queries and done again (redelivery after a kill) still finds every
#: one (deciding afterwards, from the entities read before the edges were cleared, lost
#: them once the edges were gone). A split's new entity whose origin exists is kept.
ENTITIES_ONLY_THEY_MENTION = """
UNWIND $ids AS uid
MATCH (:Unit {bank_id: $bank_id, id: uid})-[:MENTIONS]->(e:Entity)
WHERE NOT e.id IN $keep
WITH DISTINCT e
OPTIONAL MATCH (e)<-[m:MENTIONS]-(o:Unit)
WHERE NOT o.id IN $ids
WITH e, count(m) AS others
WHERE others = 0
OPTIONAL MATCH (origin:Entity {bank_id: $bank_id, id: e.split_from})
RETURN e.id AS id, e.split_from AS split_from, count(origin) AS origin
"""

#: The entities split off the entities $origins (``split_from``) that no unit but the
#: units $ids mentions and $keep does not name: they go with their origin.
SPLITS_WITHOUT_MENTIONS = """
UNWIND $origins AS oid
MATCH (n:Entity {bank_id: $bank_id, split_from: oid})
WHERE NOT n.id IN $keep
OPTIONAL MATCH (n)<-[m:MENTIONS]-(o:Unit)
WHERE NOT o.id IN $ids
WITH n, count(m) AS mentions
WHERE mentions = 0
RETURN n.id AS id
"""

#: As :data:`ENTITIES_ONLY_THEY_MENTION` (deleting them), for the link stubs the units $ids link
#: to: those nothing else links to and $keep (an upsert's new targets) does not name.
#: (A stub among $ids is one of the units themselves: an upsert fills it in, a delete
#: deals with it as with the others, :data:`DELETE_UNLINKED_UNITS`.)
DELETE_STUBS_ONLY_THEY_LINK = """
UNWIND $ids AS uid
MATCH (:Unit {bank_id: $bank_id, id: uid})-[:LINK]->(s:Unit)
WHERE s.stub = true AND NOT s.id IN $keep AND NOT s.id IN $ids
WITH DISTINCT s
OPTIONAL MATCH (s)<-[l:LINK]-(o:Unit)
WHERE NOT o.id IN $ids
WITH s, count(l) AS links
WHERE links = 0
DETACH DELETE s
"""

#: Drop the outgoing MENTIONS and LINK edges of $ids (an upsert then re-creates them).
CLEAR_UNIT_EDGES = """
UNWIND $ids AS uid
MATCH (n:Unit {bank_id: $bank_id, id: uid})-[r:MENTIONS|LINK]->()
DELETE r
"""

#: $entities: [{entity_id, name, key, label, keys}], each entity once (``keys``: the keys
#: of its mentions, in order). Name, key and label become the last mention's; the keys join
#: the aliases. Written only when something changes: FalkorDB re-indexes a node on every
#: SET, and its entity index scans slowed with each rewrite of the same entities (a
#: 100k-fact replay spent 51 of its 102 s here, per batch 35 -> 150 ms and growing, when
#: every mention rewrote its entity; flat when unchanged entities are left alone).
MERGE_ENTITIES = """
UNWIND $entities AS r
MERGE (e:Entity {bank_id: $bank_id, id: r.entity_id})
WITH e, r, CASE WHEN e.aliases IS NULL THEN r.keys
                ELSE e.aliases + [k IN r.keys WHERE NOT k IN e.aliases] END AS aliases
WHERE e.name IS NULL OR e.name <> r.name OR e.key IS NULL OR e.key <> r.key
   OR e.label IS NULL OR e.label <> r.label OR e.aliases IS NULL
   OR size(aliases) <> size(e.aliases)
SET e.name = r.name, e.key = r.key, e.label = r.label, e.aliases = aliases
"""

#: $rows: [{unit_id, entity_id}], after :data:`MERGE_ENTITIES` made the entities.
MERGE_MENTIONS = """
UNWIND $rows AS r
MATCH (n:Unit {bank_id: $bank_id, id: r.unit_id})
MATCH (e:Entity {bank_id: $bank_id, id: r.entity_id})
MERGE (n)-[:MENTIONS]->(e)
"""

#: $rows: [{source_id, target_id, kind, weight}]; a missing target becomes a stub Unit.
MERGE_LINKS = """
UNWIND $rows AS r
MATCH (n:Unit {bank_id: $bank_id, id: r.source_id})
MERGE (m:Unit {bank_id: $bank_id, id: r.target_id})
ON CREATE SET m.stub = true
MERGE (n)-[l:LINK {kind: r.kind}]->(m)
SET l.weight = r.weight
"""

#: Delete the units $ids (their own edges cleared already) that no unit links to; the
#: others become stubs (:data:`MARK_STUBS`), after this, so a delete cut short between
#: the two still finds them live and does both again.
DELETE_UNLINKED_UNITS = """
UNWIND $ids AS uid
MATCH (n:Unit {bank_id: $bank_id, id: uid})
OPTIONAL MATCH (n)<-[l:LINK]-(:Unit)
WITH n, count(l) AS links
WHERE links = 0
DETACH DELETE n
"""

#: Turn deleted units into stubs (their incoming links stay for a later re-upsert).
MARK_STUBS = """
UNWIND $ids AS uid
MATCH (n:Unit {bank_id: $bank_id, id: uid})
SET n.stub = true, n.document_id = null, n.fact_type = null,
    n.occurred_start = null, n.occurred_end = null, n.mentioned_at = null, n.tags = null
"""

#: How many of the entities $ids exist (before a write that may create them).
EXISTING_ENTITIES = """
UNWIND $ids AS eid
MATCH (e:Entity {bank_id: $bank_id, id: eid})
RETURN count(e) AS existing
"""

#: Ids of the bank's (non-stub) units of $document_id.
UNITS_OF_DOCUMENT = """
MATCH (n:Unit {bank_id: $bank_id, document_id: $document_id})
WHERE n.stub = false
RETURN n.id AS unit_id
"""

#: Bank-wide deletes, at most $limit nodes per query (one bounded transaction each);
#: the caller repeats while ``deleted`` = $limit.
DELETE_BANK_UNITS = """
MATCH (n:Unit {bank_id: $bank_id})
WITH n LIMIT $limit
DETACH DELETE n
RETURN count(*) AS deleted
"""
DELETE_BANK_ENTITIES = """
MATCH (e:Entity {bank_id: $bank_id})
WITH e LIMIT $limit
DETACH DELETE e
RETURN count(*) AS deleted
"""
#: A new $version token for the bank, the last query of every write unit of work.
TOUCH_BANK = """
MERGE (b:Bank {bank_id: $bank_id})
SET b.version = $version
"""

#: Every bank's nodes, $limit per query (Neo4j's reset; FalkorDB drops its graph key).
DELETE_ALL = """
MATCH (n)
WHERE n:Unit OR n:Entity OR n:Bank
WITH n LIMIT $limit
DETACH DELETE n
RETURN count(*) AS deleted
"""

# ---- user corrections of entity resolution (merge, split) ---------------------------------

#: The entities $ids that exist, with what a merge or split rewrites.
ENTITIES_BY_ID = """
UNWIND $ids AS eid
MATCH (e:Entity {bank_id: $bank_id, id: eid})
RETURN e.id AS id, e.name AS name, e.label AS label, e.key AS key, e.aliases AS aliases
"""

#: Write an entity's name, key, label and alias keys (created when missing).
SET_ENTITY = """
MERGE (e:Entity {bank_id: $bank_id, id: $id})
SET e.name = $name, e.key = $key, e.label = $label, e.aliases = $aliases
"""

#: A split's new entity $id remembers the entity $from_id it was split off: without
#: mentions it stays while that one exists (a name the user gave, waiting for its
#: mentions) and goes with it, as a replay that never saw the origin's deleted content
#: would not have made it.
SET_SPLIT_FROM = """
MATCH (n:Entity {bank_id: $bank_id, id: $id})
WHERE n.split_from IS NULL
SET n.split_from = $from_id
"""

#: A merge: the entities split off the merged $ids were split off the survivor from now
#: on (the survivor itself, split off one of them, no longer is). Before the merged go.
REPOINT_SPLITS = """
UNWIND $ids AS mid
MATCH (n:Entity {bank_id: $bank_id, split_from: mid})
SET n.split_from = CASE WHEN n.id = $survivor_id THEN null ELSE $survivor_id END
"""

#: Every unit mentioning $from_id (all of them, or those among $unit_ids) mentions $to_id
#: too; :data:`DROP_MENTIONS` then removes their edges to $from_id (a move in two steps:
#: no MERGE and DELETE of one edge pattern in one query).
ADD_MENTIONS_OF = """
MATCH (f:Entity {bank_id: $bank_id, id: $from_id})<-[:MENTIONS]-(u:Unit)
WHERE $all OR u.id IN $unit_ids
WITH u
MATCH (t:Entity {bank_id: $bank_id, id: $to_id})
MERGE (u)-[:MENTIONS]->(t)
"""
DROP_MENTIONS = """
MATCH (f:Entity {bank_id: $bank_id, id: $from_id})<-[r:MENTIONS]-(u:Unit)
WHERE $all OR u.id IN $unit_ids
DELETE r
"""

#: Delete the entities $ids (merged away) with whatever edges they still have.
DELETE_ENTITIES = """
UNWIND $ids AS eid
MATCH (e:Entity {bank_id: $bank_id, id: eid})
DETACH DELETE e
RETURN count(*) AS deleted
"""

# ---- reads ---------------------------------------------------------------------------------

COUNT_ENTITIES = """
MATCH (e:Entity {bank_id: $bank_id})
RETURN count(e) AS entities
"""

#: One bank with a live unit projected before units kept their tags (no ``tags``), if any
#: (a scan of the units until the first: once, when a store opens).
UNITS_WITHOUT_TAGS = """
MATCH (n:Unit)
WHERE n.stub = false AND n.tags IS NULL
RETURN n.bank_id AS bank_id
LIMIT 1
"""

COUNT_UNITS = """
MATCH (n:Unit {bank_id: $bank_id})
WHERE n.stub = false
RETURN count(n) AS units
"""

#: Entities whose current key or any former key is in $keys.
FIND_ENTITIES = """
MATCH (e:Entity {bank_id: $bank_id})
WHERE e.key IN $keys OR any(a IN coalesce(e.aliases, []) WHERE a IN $keys)
RETURN e.id AS id, e.name AS name, e.label AS label, e.key AS key
"""

#: When a unit was seen, as :data:`LIST_ENTITIES` and :data:`GET_ENTITY` aggregate it: when
#: it was told (mentioned_at), or when it happened (occurred_start) for a unit told at no
#: known time. Epoch seconds; null for a unit with neither.
_SEEN = "coalesce(u.mentioned_at, u.occurred_start)"

#: Where a read of entities restricts the units ``u`` it counts to those passing a tag
#: filter (:func:`tag_scoped`); nothing in the unscoped queries.
_UNIT_TAGS = "<<unit tags>>"

#: Per ``tags_match`` mode (:data:`mneme.domain.TAGS_MATCH_MODES`), the condition that unit
#: ``u``'s tags pass the filter $tags (sorted, each once), pushed down as the vector stores
#: push theirs: the semantics are :func:`mneme.domain.tags_match`'s, which the graph
#: contract suite checks this against for every mode. Only for a filter that filters
#: (:func:`mneme.domain.tags_filter_set`): an empty $tags is no filter but in ``exact``.
_TAGS_MATCH = {
    "any": "(size(u.tags) = 0 OR any(t IN u.tags WHERE t IN $tags))",
    "all": "(size(u.tags) = 0 OR all(t IN $tags WHERE t IN u.tags))",
    "any_strict": "any(t IN u.tags WHERE t IN $tags)",
    "all_strict": "all(t IN $tags WHERE t IN u.tags)",
    # both sides hold each tag once: equal sizes and T within U is U = T
    "exact": "(size(u.tags) = size($tags) AND all(t IN $tags WHERE t IN u.tags))",
}


def unit_tags_condition(mode: str) -> str:
    """The Cypher condition that unit ``u`` passes the tag filter $tags in ``mode``. A unit
    without the ``tags`` property (projected before units kept their tags, until a replay)
    never passes: its tags are unknown, and a scoped read must not show another scope's
    data. ValueError for an unknown mode."""
    if mode not in _TAGS_MATCH:
        raise ValueError(f"unknown tags_match mode {mode!r}; expected one of {tuple(_TAGS_MATCH)}")
    return f"u.tags IS NOT NULL AND {_TAGS_MATCH[mode]}"


def tag_scoped(query: str, mode: str | None) -> str:
    """``query`` (one of the ``*_SCOPED`` templates) counting only the units that pass the
    tag filter $tags in ``mode`` (None: every unit, the unscoped query)."""
    return query.replace(_UNIT_TAGS, "" if mode is None else f" AND {unit_tags_condition(mode)}")


#: A page of the bank's entities in id order after $after, with their live mentions and
#: the earliest and latest time (:data:`_SEEN`) of those (with a tag filter, of the
#: matching ones: an entity none of whose mentions match has 0, still listed, so the
#: caller knows how far the page went).
LIST_ENTITIES_SCOPED = f"""
MATCH (e:Entity {{bank_id: $bank_id}})
WHERE e.id > $after
WITH e ORDER BY e.id LIMIT $limit
OPTIONAL MATCH (e)<-[:MENTIONS]-(u:Unit)
WHERE u.stub = false{_UNIT_TAGS}
RETURN e.id AS id, e.name AS name, e.label AS label, e.aliases AS aliases,
       count(u) AS mentions, min({_SEEN}) AS first_seen, max({_SEEN}) AS last_seen
ORDER BY id
"""
LIST_ENTITIES = tag_scoped(LIST_ENTITIES_SCOPED, None)

#: One entity with its live mentions (and their earliest and latest time, :data:`_SEEN`)
#: and the $limit most recent units mentioning it (a subquery each, as in
#: :data:`ENTITY_UNITS`: a hub's mentions are counted, not held); with a tag filter, of
#: the matching units only.
GET_ENTITY_SCOPED = f"""
MATCH (e:Entity {{bank_id: $bank_id, id: $entity_id}})
CALL {{
  WITH e
  MATCH (e)<-[:MENTIONS]-(u:Unit)
  WHERE u.stub = false{_UNIT_TAGS}
  RETURN count(u) AS mentions, min({_SEEN}) AS first_seen, max({_SEEN}) AS last_seen
}}
CALL {{
  WITH e
  MATCH (e)<-[:MENTIONS]-(u:Unit)
  WHERE u.stub = false{_UNIT_TAGS}
  WITH u ORDER BY coalesce(u.occurred_start, 0) DESC, u.id LIMIT $limit
  RETURN collect(u.id) AS units
}}
RETURN e.id AS id, e.name AS name, e.label AS label, e.aliases AS aliases,
       mentions, units, first_seen, last_seen
"""
GET_ENTITY = tag_scoped(GET_ENTITY_SCOPED, None)

#: The entities sharing a live unit with $entity_id: how many units mention both (with a
#: tag filter, how many matching units). The ``WITH e`` keeps FalkorDB's planner starting
#: from the entity (by its index): with a condition on ``u``'s tags in the one pattern it
#: started from a scan of every bank's units instead.
CO_MENTIONED_SCOPED = f"""
MATCH (e:Entity {{bank_id: $bank_id, id: $entity_id}})
WITH e
MATCH (e)<-[:MENTIONS]-(u:Unit)-[:MENTIONS]->(o:Entity)
WHERE u.stub = false AND o.id <> e.id{_UNIT_TAGS}
RETURN o.id AS id, o.name AS name, o.label AS label, count(DISTINCT u) AS shared
ORDER BY shared DESC, id
LIMIT $limit
"""
CO_MENTIONED = tag_scoped(CO_MENTIONED_SCOPED, None)

#: The bank's version token (no row for a bank no write of this version has touched).
BANK_VERSION = """
MATCH (b:Bank {bank_id: $bank_id})
RETURN b.version AS version
"""

#: The bank's saved entity count and the version token it was counted at (a count is
#: current only while the token is the bank's version).
BANK_ENTITY_COUNT = """
MATCH (b:Bank {bank_id: $bank_id})
RETURN b.version AS version, b.entities AS entities, b.entities_at AS counted_at
"""

#: $rows: [{bank_id, version, entities}]: save each count on its bank, unless the bank
#: was written since (its version is no longer the one counted at).
SAVE_ENTITY_COUNTS = """
UNWIND $rows AS r
MATCH (b:Bank {bank_id: r.bank_id})
WHERE b.version = r.version
SET b.entities = r.entities, b.entities_at = r.version
"""

#: The bank's adjacency, read whole into memory (:class:`mneme.stores.graph_cypher.Adjacency`):
#: its live units, every MENTIONS edge, every LINK edge (targets may be stubs) and its
#: entities.
ADJACENCY_UNITS = """
MATCH (n:Unit {bank_id: $bank_id})
WHERE n.stub = false
RETURN n.id AS unit_id, n.occurred_start AS occurred_start
"""
ADJACENCY_MENTIONS = """
MATCH (n:Unit {bank_id: $bank_id})-[:MENTIONS]->(e:Entity)
RETURN n.id AS unit_id, e.id AS entity_id
"""
ADJACENCY_LINKS = """
MATCH (n:Unit {bank_id: $bank_id})-[l:LINK]->(m:Unit)
RETURN n.id AS source_id, m.id AS target_id, l.weight AS weight
"""
ADJACENCY_ENTITIES = """
MATCH (e:Entity {bank_id: $bank_id})
RETURN e.id AS id, e.name AS name, e.label AS label, e.key AS key, e.aliases AS aliases
"""

#: Which of $ids are live units of the bank (spreading-activation seeds).
EXISTING_UNITS = """
UNWIND $ids AS uid
MATCH (n:Unit {bank_id: $bank_id, id: uid})
WHERE n.stub = false
RETURN n.id AS unit_id
"""

#: Per entity ``e``: ``degree`` (how many units mention it) and ``units``, the $fanout most
#: recent of them (coalesce(occurred_start, 0) DESC, then id).
_MENTIONS_OF_E = """CALL {
  WITH e
  MATCH (e)<-[:MENTIONS]-(v:Unit)
  RETURN count(v) AS degree
}
CALL {
  WITH e
  MATCH (e)<-[:MENTIONS]-(v:Unit)
  WITH v ORDER BY coalesce(v.occurred_start, 0) DESC, v.id LIMIT $fanout
  RETURN collect(v.id) AS units
}"""

#: Units mentioning $entity_ids: per entity its degree (all mentioning units) and the
#: $fanout most recent of them, so a hub entity cannot flood a hop. Each is a subquery of
#: its own: counting keeps no rows, and ORDER BY with LIMIT keeps only the top $fanout,
#: where collecting a hub's mentions sorted in full made FalkorDB hold them all (a
#: 100k-fact bank's first cold recall grew the server by 270 MB, kept after).
ENTITY_UNITS = """
UNWIND $entity_ids AS eid
MATCH (e:Entity {bank_id: $bank_id, id: eid})
""" + _MENTIONS_OF_E + """
WITH e, degree, units WHERE degree > 0
RETURN e.id AS entity_id, degree, units
"""

#: One entity hop from the frontier $ids: per shared entity, which frontier units
#: mention it (sources), its degree and up to $fanout mentioning units (may include
#: the sources themselves; the caller skips those).
ENTITY_NEIGHBOURS = """
UNWIND $ids AS uid
MATCH (u:Unit {bank_id: $bank_id, id: uid})-[:MENTIONS]->(e:Entity)
WITH e, collect(DISTINCT uid) AS sources
""" + _MENTIONS_OF_E + """
RETURN e.id AS entity_id, sources, degree, units
"""

#: One link hop from the frontier $ids, in either direction (a causal or temporal link
#: relates both ends), to live units only.
LINK_NEIGHBOURS = """
UNWIND $ids AS uid
MATCH (u:Unit {bank_id: $bank_id, id: uid})-[l:LINK]-(v:Unit)
WHERE u <> v AND v.stub = false
RETURN uid AS source_id, v.id AS unit_id, l.kind AS kind, l.weight AS weight
"""

"""Crypto-shredding on the log: user content in every event is sealed (AES-256-GCM) with
data keys that deletions destroy (:mod:`mneme.keys`), so a deleted document leaves no
readable trace on the topics, in their backups, or in a replay.

What is sealed (:data:`SEALED`), per submessage, into its ``seal`` field
(``mneme.events.v1.Seal``: key ids, nonce, ciphertext)::

    RetainItem          content, context, metadata     keys: its document's (or retain's)
    Fact                text, context, metadata,        keys: its item's + its own f:<id>
                        entities, embedding
    ResolvedEntity      key, name                       keys: the items' that mention it
    EntityAlias         alias                           keys: the items' that mention it
    Observation         text, evidence, history,        keys: every key of every fact it
                        embedding, entities                   has cited
    ReflectionRecorded  query, answer, evidence         keys: its own q:<id> + its facts'
                                                              (based_on, evidence_memory_ids)
    Opinion             text, entities, history,        keys: those of its evidence facts
                        embedding
    UnitVector          vector                          keys: named by the producer (the
                                                              unit's facts' own f:<id>)
    DirectiveChanged    title, text                     keys: the bank's
    MentalModelChanged  display_name, source_query,     keys: the bank's (+ a refresh's
                        content                               cited facts' own f:<id>, and
                                                              its observations' facts')
    EntityMergeRequested, EntitiesMerged                keys: the bank's
                        display_name
    EntitySplitRequested, EntitySplit                   keys: the bank's
                        aliases, display_name
    BankUpserted        display_name, config.           keys: the bank's
                        retain_mission,
                        observations_mission,
                        reflect_mission

Ids, bank ids, document ids, tags, times, types, links and counters stay in the clear:
routing, ordering, replay and the projections' bookkeeping work on them (so do a bank's
settings other than its name and missions: ``erasure``, traits, modes, ``update_mask``). A sealed
submessage's content fields are empty on the log. The ciphertext is bound to the bank,
the message type and the element's id (AES-GCM associated data), so it cannot be moved.

Producers may name an element's keys beforehand (``seal.keys``): extraction gives a fact
its item's keys, consolidation an observation its facts' keys. The :class:`Sealer` adds
the defaults, creates missing keys, and seals; when a named key is already destroyed (the
document was deleted while its facts were being extracted) the content is sealed with a
key nobody keeps -- erased at birth.

Reading (:meth:`Opener.open`, which :class:`Sealer` inherits; an :class:`Opener` alone
needs only a :class:`~mneme.ports.SealKeys`, e.g. the SDK's keys from the KeyService):
each sealed element is opened and its content restored; ``seal.keys`` stays (so derived
content can name its sources' keys), ``nonce`` and ``ciphertext`` are cleared. An element
whose key is gone is *erased*: a fact, observation, entity or alias is dropped from its
list, a retained item stays as an empty placeholder listed in ``rejected_items`` (reason
``erased``), a BankUpserted keeps its settings with its name and missions empty (its
projections still apply it: the bank's deletion follows it on the log), and a reflection
makes the whole record erased. Such records carry the
header ``mneme-erased`` (the count, or ``record``); consumers skip wholly erased records
and count them (``mneme.erased.contents``) -- never an error, never a dead letter.

Per bank, ``BankConfig.erasure`` "none" leaves the bank's content in plaintext (cheaper;
no erasure on the log); a BankUpserted goes by the ``erasure`` it carries (the bank's
setting once it is applied: the first upsert of a bank precedes any catalog's view).
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
from typing import Callable, Iterable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import Message

from mneme import telemetry
from mneme.bus.codec import message_class
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import KEY_BYTES, Keyring, document_scope, fact_key_id, retain_scope, scope_of
from mneme.ports import OutRecord, Record, SealKeys

#: The content fields sealed, per message type.
SEALED: dict[str, tuple[str, ...]] = {
    "RetainItem": ("content", "context", "metadata"),
    "Fact": ("text", "context", "metadata", "entities", "embedding"),
    "ResolvedEntity": ("key", "name"),
    "EntityAlias": ("alias",),
    "Observation": ("text", "evidence", "history", "embedding", "entities"),
    "ReflectionRecorded": ("query", "answer", "evidence"),
    "Opinion": ("text", "entities", "history", "embedding"),
    "UnitVector": ("vector",),
    "DirectiveChanged": ("title", "text"),
    "MentalModelChanged": ("display_name", "source_query", "content"),
    "EntityMergeRequested": ("display_name",),
    "EntitiesMerged": ("display_name",),
    "EntitySplitRequested": ("aliases", "display_name"),
    "EntitySplit": ("aliases", "display_name"),
    # a field of a submessage by its path (the rest of the config stays in the clear)
    "BankUpserted": ("display_name", "config.retain_mission", "config.observations_mission",
                     "config.reflect_mission"),
}


def _sealed_fields() -> dict[str, frozenset[str]]:
    """Message full name → the names of its fields that are sealed (a submessage's
    included: ``mneme.events.v1.BankConfig`` → its missions)."""
    out: dict[str, set[str]] = {}
    for name, paths in SEALED.items():
        for path in paths:
            d = getattr(ev, name).DESCRIPTOR
            *parents, leaf = path.split(".")
            for p in parents:
                d = d.fields_by_name[p].message_type
            out.setdefault(d.full_name, set()).add(leaf)
    return {k: frozenset(v) for k, v in out.items()}


#: Message full name → its sealed fields' names (of :data:`SEALED`'s paths).
SEALED_FIELDS = _sealed_fields()
#: Events sealed whole under the bank's key (user corrections and curated content).
_BANK_SEALED = (ev.DirectiveChanged, ev.MentalModelChanged, ev.EntityMergeRequested,
                ev.EntitiesMerged, ev.EntitySplitRequested, ev.EntitySplit)
#: Event type → its repeated fields whose elements are sealed one by one.
_ELEMENT_FIELDS: dict[type, tuple[str, ...]] = {
    ev.RetainRequested: ("items",), ev.FactsExtracted: ("facts",),
    ev.EntitiesResolved: ("entities", "claims", "aliases"),
    ev.ObservationsChanged: ("observations",), ev.OpinionsChanged: ("opinions",),
    ev.VectorsReplaced: ("units",),
}
#: The event types that carry sealed content.
SEALING_TYPES = frozenset(f"mneme.events.v1.{n}" for n in (
    "RetainRequested", "FactsExtracted", "EntitiesResolved", "ObservationsChanged",
    "ReflectionRecorded", "DirectiveChanged", "MentalModelChanged", "OpinionsChanged",
    "EntityMergeRequested", "EntitiesMerged", "EntitySplitRequested", "EntitySplit",
    "VectorsReplaced", "BankUpserted"))
_BANK_UPSERTED = "mneme.events.v1.BankUpserted"
#: The header a read record carries when contents of it were erased.
ERASED_HEADER = "mneme-erased"
#: The header of a record read whose seal does not authenticate (its consumer
#: dead-letters it, like any corrupt payload).
SEAL_ERROR_HEADER = "mneme-seal-error"
#: The scope of the keys of content with no finer owner (destroyed with the bank; its keys
#: are ``bank#<gen>``, :meth:`mneme.keys.Keyring.bank_content_key`, or ``bank`` on older logs).
BANK_KEY_ID = "bank"
_NONCE = 12
_ERASED_ITEM = "erased: the key of this item was destroyed (its document or memory was deleted)"


def erased_record(record: Record) -> bool:
    """True when nothing of ``record`` can be read any more (its consumers skip it)."""
    return record.headers.get(ERASED_HEADER) == "record"


def check_opened(record: Record) -> None:
    """Raise ValueError when :class:`SealedLog` could not open ``record`` (a seal that
    does not authenticate: tampered or corrupt)."""
    error = record.headers.get(SEAL_ERROR_HEADER)
    if error:
        raise ValueError(error)


def _element_id(msg: Message) -> str:
    name = msg.DESCRIPTOR.name
    if name == "EntityAlias":
        return msg.entity_id
    if name == "RetainItem":
        return msg.document_id
    return getattr(msg, "id", "")


def _aad(bank_id: str, msg: Message) -> bytes:
    return f"{bank_id}\0{msg.DESCRIPTOR.name}\0{_element_id(msg)}".encode()


@functools.lru_cache(maxsize=None)
def _tree(fields: tuple[str, ...]) -> dict:
    """Field paths ("a", "a.b") as a tree: name → subtree, None for a whole field (cached:
    every sealed element asks; the trees are not modified)."""
    tree: dict = {}
    for path in fields:
        *parents, leaf = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = None
    return tree


def _has_content(msg: Message, fields: tuple[str, ...] | dict) -> bool:
    tree = fields if isinstance(fields, dict) else _tree(fields)
    return any(fd.name in tree and (tree[fd.name] is None or _has_content(v, tree[fd.name]))
               for fd, v in msg.ListFields())


def _keep_only(msg: Message, tree: dict) -> None:
    for fd, v in msg.ListFields():
        if fd.name not in tree:
            msg.ClearField(fd.name)
        elif tree[fd.name] is not None:
            _keep_only(v, tree[fd.name])


def _clear(msg: Message, tree: dict) -> None:
    for name, sub in tree.items():
        if sub is None:
            msg.ClearField(name)
        elif msg.HasField(name):  # a submessage's fields: the submessage stays
            _clear(getattr(msg, name), sub)


def _split(msg: Message, fields: tuple[str, ...]) -> bytes:
    """The content fields of ``msg`` (paths: "name", or "sub.name" for a field of a
    submessage) serialised (as a message of its type) and cleared in ``msg``; merging
    the bytes back into it restores them."""
    tree = _tree(fields)
    part = type(msg)()
    part.CopyFrom(msg)
    _keep_only(part, tree)
    _clear(msg, tree)
    return part.SerializeToString(deterministic=True)


def sealed_key_ids(msg: Message) -> set[str]:
    """The key ids named by the seals still closed in event ``msg`` (what opening it will
    ask its :class:`~mneme.ports.SealKeys` for; to fetch them in one batch). Looks at the
    sealed elements only (:data:`_ELEMENT_FIELDS`, or the message itself), not a walk of
    the whole message: facts carry entities, links and vectors that hold no seal."""
    fields = _ELEMENT_FIELDS.get(type(msg))
    elements = [e for f in fields for e in getattr(msg, f)] if fields else [msg]
    return {k for e in elements if "seal" in e.DESCRIPTOR.fields_by_name and e.seal.ciphertext
            for k in e.seal.keys}


class Opener:
    """Opens the sealed user content of records read, with the keys of ``keys`` (any
    :class:`~mneme.ports.SealKeys`: the services' :class:`~mneme.keys.Keyring`, or the
    SDK's keys fetched from the KeyService); it creates no key and seals nothing."""

    def __init__(self, keys: SealKeys) -> None:
        self.keys = keys

    def open(self, record: Record, msg: Message | None = None) -> Record:
        """``record`` with its sealed content opened (see the module docstring for what
        an erased element becomes). ``msg``: the record's message as :meth:`prefetch`
        decoded it (decoded here when None). Raises ValueError for a ciphertext that does
        not authenticate under live keys (tampered or corrupt: dead-lettered like any
        corrupt payload)."""
        msg = msg if msg is not None else self._decode(record)
        if msg is None:
            return record
        bank = record.headers.get("ce_subject") or record.key
        opened, erased, whole = self._open_event(msg, bank)
        if not (opened or erased):
            return record
        headers = record.headers
        if erased:
            telemetry.count_erased(record.topic, erased)
            headers = {**headers, ERASED_HEADER: "record" if whole else str(erased)}
        return dataclasses.replace(record, value=msg.SerializeToString(), headers=headers)

    @staticmethod
    def _decode(record: Record) -> Message | None:
        """The event of a record that may carry sealed content; None for other types and
        for a value that does not decode (the consumer's decode reports it)."""
        ce_type = record.headers.get("ce_type", "")
        if ce_type not in SEALING_TYPES:
            return None
        try:
            return message_class(ce_type).FromString(record.value)
        except Exception:  # noqa: BLE001 - the consumer's decode reports it
            return None

    def prefetch(self, records: Sequence[Record]) -> list[Message | None]:
        """Decode the sealed records of a batch and ask :attr:`keys` once per bank for
        every key they name (:meth:`~mneme.ports.SealKeys.prefetch`, when the keys have
        it), so that opening them one by one finds their keys loaded. Returns each
        record's message (None when it carries no sealed content) to pass to
        :meth:`open`, which then does not decode it again."""
        msgs = [self._decode(r) for r in records]
        prefetch = getattr(self.keys, "prefetch", None)  # an SDK user's keys may lack it
        if prefetch is not None:
            wanted: dict[str, dict[str, None]] = {}
            for r, m in zip(records, msgs):
                ids = sealed_key_ids(m) if m is not None else ()
                if ids:
                    wanted.setdefault(r.headers.get("ce_subject") or r.key, {}).update(
                        dict.fromkeys(sorted(ids)))
            for bank, ids in wanted.items():
                prefetch(bank, list(ids))
        return msgs

    def _open_event(self, m: Message, bank: str) -> tuple[int, int, bool]:
        opened = erased = 0

        def each(container, field: str) -> None:
            nonlocal opened, erased
            items = getattr(container, field)
            for i in reversed(range(len(items))):
                ok = self._open(items[i], bank)
                if ok is False:
                    erased += 1
                    del items[i]
                elif ok:
                    opened += 1

        if isinstance(m, ev.RetainRequested):
            rejected = {r.item_index for r in m.rejected_items}
            for i, item in enumerate(m.items):
                ok = self._open(item, bank)
                if ok:
                    opened += 1
                elif ok is False:
                    erased += 1
                    if i not in rejected:
                        m.rejected_items.add(item_index=i, error=_ERASED_ITEM,
                                             field=f"items[{i}]", reason="erased")
        elif type(m) in _ELEMENT_FIELDS:
            for f in _ELEMENT_FIELDS[type(m)]:
                each(m, f)
        elif isinstance(m, (ev.ReflectionRecorded, *_BANK_SEALED)):
            ok = self._open(m, bank)
            if ok is False:
                return opened, 1, True
            opened += bool(ok)
        elif isinstance(m, ev.BankUpserted):
            # erased (a deleted bank's, on a replay): the settings stay and apply, with
            # the name and missions empty; the bank's deletion follows on the log
            ok = self._open(m, bank)
            if ok is False:
                return opened, 1, False
            opened += bool(ok)
        return opened, erased, False

    def _open(self, msg: Message, bank: str) -> bool | None:
        """Open one element in place: True opened, False erased (a key is gone), None
        when it was not sealed."""
        seal = msg.seal
        if not seal.ciphertext:
            return None
        key = self.keys.combined(bank, seal.keys)
        if key is None:
            return False
        try:
            plain = AESGCM(key).decrypt(seal.nonce, seal.ciphertext, _aad(bank, msg))
        except InvalidTag:
            raise ValueError(f"sealed {msg.DESCRIPTOR.name} of bank {bank!r} does not "
                             f"authenticate under keys {list(seal.keys)}") from None
        msg.MergeFromString(plain)
        msg.seal.ClearField("nonce")
        msg.seal.ClearField("ciphertext")
        return True


class Sealer(Opener):
    """Seals the user content of outgoing records and opens it in records read, with the
    keys of ``keyring`` (which creates them). ``erasure(bank_id)`` → False leaves a bank's
    content in plaintext (its ``BankConfig.erasure`` is "none"); default True for every
    bank."""

    def __init__(self, keyring: Keyring, erasure: Callable[[str], bool] = lambda bank: True):
        super().__init__(keyring)
        self.keyring, self.erasure = keyring, erasure

    # ---- sealing ----------------------------------------------------------------------

    def seal(self, record: OutRecord) -> OutRecord:
        """``record`` with its content sealed (unchanged when its type carries none, its
        bank keeps plaintext, it is sealed already, or its value does not decode as its
        type: the dead letter of a corrupt record, produced as it was read)."""
        ce_type = record.headers.get("ce_type", "")
        if ce_type not in SEALING_TYPES:
            return record
        bank = record.headers.get("ce_subject") or record.key
        upsert = ce_type == _BANK_UPSERTED
        if not upsert and not self.erasure(bank):
            return record
        cls = message_class(ce_type)
        try:
            msg = cls.FromString(record.value)
        except Exception:  # noqa: BLE001 - not an event (a poison record's dead letter):
            return record  # it goes as it was read, there is no content to seal in it
        if upsert and not (msg.config.erasure != "none" if msg.HasField("config")
                           else self.erasure(bank)):
            # the setting it carries decides (ingest writes the bank's whole config, an
            # update's merged): a new bank is not in any catalog yet
            return record
        if not self._seal_event(msg, bank, record.headers.get("ce_id", "")):
            return record
        return dataclasses.replace(record, value=msg.SerializeToString())

    def _seal_event(self, m: Message, bank: str, event_id: str) -> int:
        kr, n = self.keyring, 0
        if isinstance(m, ev.RetainRequested):
            current: dict[str, str] = {}  # one look-up per document (on Kafka: a catch-up)
            for item in m.items:
                if not item.seal.keys:
                    scope = (document_scope(item.document_id) if item.document_id
                             else retain_scope(m.operation_id))
                    if scope not in current:
                        current[scope] = kr.current(bank, scope)
                    item.seal.keys.append(current[scope])
                n += self._seal(item, bank)
        elif isinstance(m, ev.FactsExtracted):
            scopes: dict[str, str | None] = {}  # item key → its scope (None: destroyed)
            wanted = []
            for f in m.facts:
                if not f.seal.keys:
                    scope = (document_scope(f.document_id) if f.document_id
                             else retain_scope(m.operation_id))
                    f.seal.keys.append(kr.current(bank, scope))
                own = fact_key_id(f.id)
                if own not in f.seal.keys:
                    # The fact's own key lives in its item key's scope (deleting the
                    # document destroys it); none is made once the item key is gone.
                    item = f.seal.keys[0]
                    if item not in scopes:
                        scopes[item] = kr.scope(bank, item)
                    if scopes[item] is not None:
                        wanted.append((own, scopes[item]))
                    f.seal.keys.append(own)
            kr.ensure_many(bank, wanted)  # one durable write for the record's new keys
            for f in m.facts:
                n += self._seal(f, bank)
        elif isinstance(m, ev.EntitiesResolved):
            for e in (*m.entities, *m.claims, *m.aliases):
                n += self._seal(e, bank)
        elif isinstance(m, ev.ObservationsChanged):
            for o in m.observations:
                n += self._seal(o, bank)
        elif isinstance(m, ev.OpinionsChanged):
            for o in m.opinions:
                if not o.seal.keys:  # its evidence facts' own keys (consolidation names them)
                    o.seal.keys.extend(dict.fromkeys(fact_key_id(i) for i in o.evidence_ids))
                n += self._seal(o, bank)
        elif isinstance(m, ev.VectorsReplaced):
            for u in m.units:  # keys named by the producer (else the bank's: _seal)
                n += self._seal(u, bank)
        elif isinstance(m, ev.ReflectionRecorded):
            if not m.seal.keys:
                own = f"q:{event_id or secrets.token_hex(8)}"
                kr.ensure(bank, own, scope_of(own))
                m.seal.keys.append(own)
                _cited_keys(kr, bank, [*m.based_on, *m.evidence_memory_ids], m.seal.keys)
            n += self._seal(m, bank)
        elif isinstance(m, ev.MentalModelChanged) and m.refresh.based_on and not m.seal.keys:
            # A refresh's content is derived from the facts it cites: deleting one (or its
            # document) erases it, as a reflection's. The bank's key keeps it per bank.
            m.seal.keys.append(kr.bank_content_key(bank))
            _cited_keys(kr, bank, [*m.refresh.based_on, *m.refresh.evidence_memory_ids],
                        m.seal.keys)
            n += self._seal(m, bank)
        elif isinstance(m, (*_BANK_SEALED, ev.BankUpserted)):  # the bank's key
            n += self._seal(m, bank)
        return n

    def _seal(self, msg: Message, bank: str) -> int:
        """Seal one element in place: 1 when it was sealed, 0 when it had nothing to seal
        or was sealed already."""
        fields = SEALED[msg.DESCRIPTOR.name]
        if msg.seal.ciphertext or not _has_content(msg, fields):
            return 0
        if not msg.seal.keys:
            msg.seal.keys.append(self.keyring.bank_content_key(bank))
        key = self.keyring.combined(bank, msg.seal.keys)
        plain = _split(msg, fields)
        # A destroyed key: sealed under a key nobody keeps (erased at birth).
        nonce = secrets.token_bytes(_NONCE)
        sealed = AESGCM(key or secrets.token_bytes(KEY_BYTES)).encrypt(nonce, plain,
                                                                      _aad(bank, msg))
        msg.seal.nonce, msg.seal.ciphertext = nonce, sealed
        return 1


def _cited_keys(kr: Keyring, bank: str, ids: Iterable[str], keys) -> None:
    """Append to ``keys`` the own key of every cited id that has one (``ids``: the facts
    an answer cites, and the facts behind the observations it cites): live, or destroyed
    (a fact deleted while the answer citing it was made: sealed under its destroyed key,
    the answer is erased at birth). Ids with no key (observations) add none."""
    for i in ids:
        k = fact_key_id(i)
        if k not in keys and (kr.key(bank, k) is not None or kr.destroyed(bank, k)):
            keys.append(k)


class SealedLog:
    """An :class:`~mneme.ports.EventLog` that seals what is appended or produced with a
    commit and opens what is read (through ``sealer``); every other call goes to
    ``inner``."""

    def __init__(self, inner, sealer: Sealer) -> None:
        self.inner, self.sealer = inner, sealer

    def append(self, records: Iterable[OutRecord]):
        """Append the records sealed: the records as stored (sealed values)."""
        return self.inner.append([self.sealer.seal(r) for r in records])

    def commit(self, group: str, offsets: dict[tuple[str, int], int],
               produce: Sequence[OutRecord] = ()) -> list[Record]:
        """``inner.commit`` with ``produce`` sealed."""
        return self.inner.commit(group, offsets, [self.sealer.seal(r) for r in produce])

    def read(self, topic: str, partition: int, offset: int, limit: int = 100) -> list[Record]:
        """The records of ``inner.read``, opened; one whose seal does not authenticate
        comes as it is, with the reason in its :data:`SEAL_ERROR_HEADER` header
        (:func:`check_opened`)."""
        records = self.inner.read(topic, partition, offset, limit)
        msgs = self.sealer.prefetch(records)  # one key read per bank for the batch
        return [self._open(r, m) for r, m in zip(records, msgs)]

    def _open(self, record: Record, msg: Message | None) -> Record:
        try:
            return self.sealer.open(record, msg)
        except ValueError as e:
            return dataclasses.replace(record, headers={**record.headers,
                                                        SEAL_ERROR_HEADER: str(e)})

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"SealedLog({self.inner!r})"


__all__ = ["BANK_KEY_ID", "ERASED_HEADER", "SEALED", "SEALED_FIELDS", "SEALING_TYPES",
           "SEAL_ERROR_HEADER",
           "Opener", "SealedLog", "Sealer", "check_opened", "erased_record", "sealed_key_ids"]

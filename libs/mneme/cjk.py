"""Text without spaces between words: CJK segmentation for BM25, and script checks.

Chinese and Japanese are written without spaces, and Korean spaces separate phrases
(eojeol) rather than words, so a word tokenizer sees a whole CJK run as one token and a
keyword never matches. :func:`segment` rewrites every CJK run (Han, Hiragana, Katakana,
Hangul) as its overlapping character bigrams, space separated -- "我在北京" → "我在 在北
北京" -- and a run of one character as that character, leaving all other text as it is.
The same function serves indexed text and query text in both text stores, so a 2-4
character keyword matches wherever its bigrams occur. This is the token model of Lucene's
``cjk_bigram`` filter (bigrams within a run, a lone character as a unigram, no bigram
across a space or punctuation), and full-width forms are folded first as Lucene's
``cjk_width`` does, so the OpenSearch adapter's analyzer and the Tantivy adapter agree.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["CJK_CHARS", "segment", "has_cjk", "cjk_bigrams", "has_unspaced_script"]

#: Character class of the CJK scripts that are bigrammed: Han ideographs (with the
#: radicals, the iteration mark 々 and the supplementary planes), Hiragana, Katakana (with
#: the prolonged sound mark ー; half-width forms after folding) and Hangul (syllables and
#: jamo). CJK punctuation (。、「」) is not in it, so it ends a run.
CJK_CHARS = ("\u1100-\u11ff\u2e80-\u2fdf\u3005\u3006\u3007\u3021-\u3029\u3031-\u3035"
             "\u3041-\u309f\u30a0-\u30ff\u3130-\u318f\u31f0-\u31ff\u3400-\u4dbf"
             "\u4e00-\u9fff\ua960-\ua97f\uac00-\ud7af\ud7b0-\ud7ff\uf900-\ufaff"
             "\U00020000-\U0003134f")
_RUN = re.compile(f"[{CJK_CHARS}]+")
_ANY = re.compile(f"[{CJK_CHARS}]")
# Full-width ASCII and half-width Katakana/Hangul (U+FF00-U+FFEF) fold to their usual
# forms (NFKC of that block only: other compatibility characters stay as they are).
_WIDTH = re.compile("[\uff00-\uffef]+")
# Scripts written without spaces between words that nothing here segments (Thai, Lao,
# Myanmar, Khmer) -- plus CJK: a spaCy English pipeline cannot find words in them.
_UNSPACED = re.compile(f"[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff{CJK_CHARS}]")


def _fold_width(text: str) -> str:
    return _WIDTH.sub(lambda m: unicodedata.normalize("NFKC", m.group()), text)


def has_cjk(text: str) -> bool:
    """True when ``text`` holds a character of :data:`CJK_CHARS` (width-folded first)."""
    return bool(_ANY.search(_fold_width(text)))


def has_unspaced_script(text: str) -> bool:
    """True when ``text`` holds a character of a script written without spaces between
    words (CJK, Thai, Lao, Myanmar, Khmer)."""
    return bool(_UNSPACED.search(_fold_width(text)))


def cjk_bigrams(run: str) -> list[str]:
    """A run of CJK characters → its overlapping bigrams ("北京烤鸭" → 北京, 京烤, 烤鸭);
    a run of one character → [that character]; "" → []."""
    if len(run) < 2:
        return [run] if run else []
    return [run[i:i + 2] for i in range(len(run) - 1)]


def segment(text: str) -> str:
    """``text`` with full-width forms folded and every CJK run replaced by its bigrams
    (:func:`cjk_bigrams`), space separated and set off by spaces from what surrounds it.
    Text without CJK characters comes back unchanged (apart from width folding), so
    Latin-script analysis is the same as before."""
    text = _fold_width(text)
    if not _ANY.search(text):
        return text
    return _RUN.sub(lambda m: " " + " ".join(cjk_bigrams(m.group())) + " ", text)

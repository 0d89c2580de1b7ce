"""Step 1 of the data path, the sources the store scores: the corpus's answers and real text, as chats.

EAGLE (Li et al. 2024, Sec. 4) trains its head on a FIXED corpus (ShareGPT) with the target's
features and distribution, not on text the target wrote; this file supplies such a corpus offline.
Every source is real human text from a package the registries here serve, read from where the
package installs it:

    python-docs       the Python 3.11 documentation (reStructuredText sources), Debian package
                      python3.11-doc, /usr/share/doc/python3.11/html/_sources; PSF-2.0
    python-stdlib     the Python standard library's own .py files (no test suites), the running
                      interpreter's lib/python3.X; PSF-2.0
    debian-reference  the Debian Reference (Osamu Aoki) in English, French, German, Spanish, Italian,
                      Debian packages debian-reference-{en,fr,de,es,it}, /usr/share/debian-reference
                      /*.txt.gz; GPL-2+
    chatterbot        the ChatterBot dialogue corpus, 28 languages, PyPI wheel chatterbot-corpus
                      (build-time extra `specref[data]`), chatterbot_corpus/data/*/*.yml; BSD-3-Clause
    distilled         the target's own answers: the committed corpus exported as a distilled folder
                      (`python -m specref corpus export`), or one written by data.distill, when a
                      folder is given (`distilled=`); every committed head trained on these alone

Install (build time only, never a runtime dependency): `apt-get install python3.11-doc debian-reference-en
debian-reference-fr debian-reference-de debian-reference-es debian-reference-it` and `pip install
'specref[data]'`; a missing source raises ValueError with its install line (`load_sources`).

Each document becomes a chat through the target's chat template (`encode`): a user turn written
here (explain / continue / write the code of the document's topic, in the document's language for
the Debian Reference) and an assistant turn that is the real text, so the features are those the
target computes when it serves a chat. Dialogue turns alternate user / assistant. Long texts are cut
at paragraph (code: top-level statement) boundaries into chunks of about `CHUNK_CHARS` characters.

Contamination (contamination.py): `overlap_filter` drops every document sharing a word 13-gram
with the development questions; the counts before and after, and the files checked (by name and
sha256), go to the manifest.
`passage_requests` reuses the same real text as the PASSAGE of a request (summarise /
answer about / extract from / translate it) that the target then answers (data.py's third stage):
the long pasted contexts of summarisation, RAG and translation requests, which the target's own
short answers cannot supply.
Left out: multi-document packing; near-duplicate removal.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .contamination import NGRAM, eval_files, word_ngrams  # noqa: F401 (eval_files: its earlier import path)

CHUNK_CHARS = 2400  # ~600-800 tokens of English prose; the store truncates at max_len anyway


@dataclass(frozen=True)
class Doc:
    """One training conversation: chat messages, or (tests, self-distilled data) tokens as they are."""

    source: str  # the Source's name
    key: str  # stable id within the source (file and chunk); the held-out split hashes it
    messages: Tuple[Tuple[str, str], ...] = ()  # (role, content), roles "user" / "assistant"
    tokens: Optional[Tuple[int, ...]] = None  # pre-tokenised sequence (used as is)
    prompt_len: int = 1  # with tokens: the first labelled token
    text_hint: str = ""  # with tokens: its text, for the overlap check

    def text(self) -> str:
        return "\n".join(c for _, c in self.messages) if self.messages else self.text_hint


@dataclass
class Source:
    """A named list of documents with its provenance, recorded in the store's manifest."""

    name: str
    origin: str  # package + version + where it installs (no path of this machine)
    licence: str
    docs: List[Doc]
    weight: float = 1.0  # share of the interleaved token stream (store/build.py)
    overlap: Dict[str, int] = field(default_factory=dict)  # filled by overlap_filter

    def record(self) -> dict:
        return {"name": self.name, "origin": self.origin, "licence": self.licence,
                "documents": len(self.docs), "weight": self.weight, "overlap_13gram": self.overlap}


def _stable(i: str) -> int:
    return int(hashlib.sha1(i.encode()).hexdigest()[:8], 16)


def _deb_version(pkg: str) -> str:
    try:
        return subprocess.run(["dpkg-query", "-W", "-f", "${Version}", pkg], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not installed"


def chunks(paragraphs: Iterable[str], limit: int = CHUNK_CHARS) -> List[str]:
    """Greedy groups of consecutive paragraphs of at most `limit` characters (a longer one alone)."""
    out, cur = [], ""
    for p in paragraphs:
        if cur and len(cur) + len(p) + 2 > limit:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{p}" if cur else p
    if cur.strip():
        out.append(cur)
    return out


def _pick(templates: Sequence[str], key: str) -> str:
    return templates[_stable(key) % len(templates)]


# ----------------------------------------------------------------------------- python-docs

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`<]*?)(?:\s*<[^>]*>)?`")  # :func:`~os.path.join` -> join
_DROP = re.compile(r"^\.\. (index|module|moduleauthor|sectionauthor|highlight|currentmodule|_[^:]*):")
DOC_PROMPTS = ("Explain {t} in Python.", "What does the Python documentation say about {t}?",
               "Write a section of documentation about {t}.", "How does {t} work in Python? Please explain.")


def _rst_clean(text: str) -> List[str]:
    lines = [ln for ln in text.splitlines()
             if not _DROP.match(ln.strip()) and not re.match(r"\s+(single|pair|triple|see|seealso): ", ln)]
    text = _ROLE.sub(lambda m: f"`{m.group(1).split('.')[-1] if m.group(0).count('~') else m.group(1)}`",
                     "\n".join(lines))
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


_RULE = re.compile(r"[=\-*~^#]{3,}")


def _rst_title(paras: Sequence[str]) -> Optional[str]:
    """The first section title: a text line underlined by a rule of = - * ~ ^ #."""
    for p in paras:
        lines = [ln.strip() for ln in p.splitlines()]
        for a, b in zip(lines, lines[1:]):
            if a and not _RULE.fullmatch(a) and _RULE.fullmatch(b):
                return a
    return None


def python_docs(root: str = "/usr/share/doc/python3.11/html/_sources") -> Source:
    docs = []
    for path in sorted(Path(root).rglob("*.rst.txt")):
        if path.name in ("license.rst.txt", "copyright.rst.txt") or "whatsnew" in path.parts:
            continue
        paras = _rst_clean(path.read_text(encoding="utf-8", errors="replace"))
        title = re.sub(r"[`*]", "", _rst_title(paras) or path.stem.replace(".rst", "")).strip()
        rel = str(path.relative_to(root))
        for i, c in enumerate(chunks(paras)):
            key = f"{rel}#{i}"
            user = _pick(DOC_PROMPTS, key).format(t=title if i == 0 else f"{title} (part {i + 1})")
            docs.append(Doc("python-docs", key, (("user", user), ("assistant", c))))
    return Source("python-docs", f"Debian python3.11-doc {_deb_version('python3.11-doc')}: {root}",
                  "PSF-2.0", docs, weight=3.0)


# ----------------------------------------------------------------------------- python-stdlib

CODE_PROMPTS = ("Write the Python code for {n} in the module `{m}`.",
                "Show me an implementation of {n} as in Python's `{m}` module.",
                "Continue the Python module `{m}`: write {n}.")


def python_stdlib(root: Optional[str] = None) -> Source:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip & set(rel.parts) or path.stat().st_size > 400_000:
            continue
        src = path.read_text(encoding="utf-8", errors="replace")
        blocks = re.split(r"\n(?=(?:def|class|async def|@)\s*\w)", src)  # top-level statements
        mod = ".".join(rel.with_suffix("").parts).replace(".__init__", "")
        for i, c in enumerate(chunks(b.strip("\n") for b in blocks if b.strip())):
            names = re.findall(r"^(?:async )?(?:def|class) (\w+)", c, re.M)
            n = ", ".join(f"`{x}`" for x in names[:3]) if names else "the next part"
            key = f"{rel}#{i}"
            user = _pick(CODE_PROMPTS, key).format(n=n, m=mod)
            docs.append(Doc("python-stdlib", key, (("user", user), ("assistant", f"```python\n{c}\n```"))))
    return Source("python-stdlib", f"Python {sys.version.split()[0]} standard library: <python prefix>/lib/{root.name}", "PSF-2.0",
                  docs, weight=2.0)


# ----------------------------------------------------------------------------- debian-reference

LANG_PROMPTS = {
    "en": ("Explain {t}.", "Tell me about {t} on a Debian system.", "Write a guide section on {t}."),
    "fr": ("Explique {t}.", "Parle-moi de {t} sur un système Debian.", "Explain {t}. Answer in French."),
    "de": ("Erkläre {t}.", "Was muss ich über {t} unter Debian wissen?", "Explain {t}. Answer in German."),
    "es": ("Explica {t}.", "Háblame de {t} en un sistema Debian.", "Explain {t}. Answer in Spanish."),
    "it": ("Spiega {t}.", "Parlami di {t} su un sistema Debian.", "Explain {t}. Answer in Italian."),
}
_HEAD = re.compile(r"^\s*(?:\d+\.)+\d*\.?\s+(\S.*)$")


def debian_reference(root: str = "/usr/share/debian-reference", langs: Sequence[str] = tuple(LANG_PROMPTS)) -> Source:
    docs, versions = [], []
    for lang in langs:
        path = Path(root) / f"debian-reference.{lang}.txt.gz"
        if not path.is_file():
            continue
        versions.append(f"debian-reference-{lang} {_deb_version('debian-reference-' + lang)}")
        text = gzip.open(path, "rt", encoding="utf-8", errors="replace").read()
        body = text[text.find("\n---", 2000) if "\n---" in text[2000:] else 0:]  # past the contents
        paras = ["\n".join(re.sub(r"\s+", " ", ln).strip() for ln in p.replace("\xa0", " ").strip().splitlines())
                 for p in re.split(r"\n\s*\n", body) if p.strip("-\n ")]
        topic = "Debian"
        groups: List[Tuple[str, List[str]]] = []  # (section title, paragraphs)
        for p in paras:
            m = _HEAD.match(p.splitlines()[0]) if len(p) < 120 else None
            if m:
                topic = m.group(1).strip()
                groups.append((topic, [p]))
            elif groups:
                groups[-1][1].append(p)
        for g, (t, ps) in enumerate(groups):
            for i, c in enumerate(chunks(ps, CHUNK_CHARS)):
                key = f"{lang}:{g}#{i}"
                user = _pick(LANG_PROMPTS[lang], key).format(t=t)
                docs.append(Doc("debian-reference", key, (("user", user), ("assistant", c))))
    return Source("debian-reference", "Debian " + ", ".join(versions) + f": {root}/*.txt.gz", "GPL-2+",
                  docs, weight=2.0)


# ----------------------------------------------------------------------------- chatterbot

def chatterbot() -> Source:
    import yaml

    import chatterbot_corpus  # the build-time extra: pip install specref[data]

    root = Path(chatterbot_corpus.__file__).parent / "data"
    docs = []
    for path in sorted(root.rglob("*.yml")):
        rows = (yaml.safe_load(path.read_text(encoding="utf-8", errors="replace")) or {}).get("conversations") or []
        for i, conv in enumerate(rows):
            turns = [str(x).strip() for x in (conv or []) if str(x).strip()]
            if len(turns) < 2:
                continue
            msgs = tuple(("user" if j % 2 == 0 else "assistant", t) for j, t in enumerate(turns))
            docs.append(Doc("chatterbot", f"{path.relative_to(root)}#{i}", msgs))
    ver = importlib.metadata.version("chatterbot-corpus")
    return Source("chatterbot", f"PyPI chatterbot-corpus {ver}: <site-packages>/chatterbot_corpus/data/*/*.yml", "BSD-3-Clause", docs, weight=1.0)


# ----------------------------------------------------------------------------- self-distilled, tokens

def distilled(folder, tokenizer=None) -> Source:
    """The target's own answers (data.distill's folder) as pre-tokenised documents."""
    from .data import iter_sequences, read_manifest

    man = read_manifest(folder)
    docs = []
    for i, s in enumerate(iter_sequences(folder)):
        text = tokenizer.decode(s.tokens.tolist(), skip_special_tokens=True) if tokenizer is not None else ""
        docs.append(Doc("distilled", f"{i}", tokens=tuple(s.tokens.tolist()), prompt_len=s.prompt_len, text_hint=text))
    return Source("distilled", f"specref self-distillation {Path(folder).name} (fingerprint {man.get('model_fingerprint')})",
                  "the target's own output (Apache-2.0 model)", docs, weight=2.0)


def token_source(name: str, rows: Sequence[Tuple[Sequence[int], int]], texts: Optional[Sequence[str]] = None,
                 weight: float = 1.0) -> Source:
    """A source of pre-tokenised (tokens, prompt_len) rows: the tokenizer-free path of the tests."""
    docs = [Doc(name, str(i), tokens=tuple(int(t) for t in toks), prompt_len=int(p),
                text_hint=texts[i] if texts else "") for i, (toks, p) in enumerate(rows)]
    return Source(name, "in memory", "test data", docs, weight=weight)


INSTALL = {"python-docs": "apt-get install python3.11-doc", "python-stdlib": "a CPython with its Lib/ sources",
           "debian-reference": "apt-get install debian-reference-en debian-reference-fr debian-reference-de "
                               "debian-reference-es debian-reference-it",
           "chatterbot": "pip install 'specref[data]' (chatterbot-corpus)"}
SOURCES = {"python-docs": python_docs, "python-stdlib": python_stdlib, "debian-reference": debian_reference,
           "chatterbot": chatterbot}


def load_sources(names: Sequence[str] = tuple(SOURCES), distilled_folder=None, tokenizer=None) -> List[Source]:
    bad = [n for n in names if n not in SOURCES]
    if bad:
        raise ValueError(f"unknown sources {bad}: choose from {sorted(SOURCES)}")
    out = []
    for n in names:
        try:
            src = SOURCES[n]()
        except ImportError as e:
            raise ValueError(f"source {n!r} needs a package: {INSTALL[n]} ({e})") from e
        if not src.docs:
            raise ValueError(f"source {n!r} found no documents in {src.origin}: {INSTALL[n]}")
        out.append(src)
    if distilled_folder:
        out.append(distilled(distilled_folder, tokenizer))
    return out


# ----------------------------------------------------------------------------- real-passage requests

LANG_NAMES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian"}
PASSAGE_REQUESTS = (  # written for specref: (category, passage language, request); {p} a passage, {l} its language
    ("summarization", "en", "Summarize the text below in a few sentences.\n\n{p}"),
    ("rag", "en", "Read the passage, then answer: what problem does it solve, and how?\n\nPassage:\n{p}"),
    ("extraction", "en", "Turn the following text into a bulleted list of its key points.\n\n{p}"),
    ("summarization", "en", "What is this document about? Give a short summary for someone in a hurry."
                            "\n\nDocument:\n{p}"),
    ("translation", "xx", "Translate this {l} text into English.\n\n{p}"),
    ("rag", "en", "{p}\n\nUsing only the text above, explain its main idea to a beginner."),
    ("extraction", "en", "List the names, commands and technical terms that appear in this text, each with "
                         "a few words on what it is.\n\n{p}"),
    ("translation", "xx", "What does this passage say? Give an English translation.\n\n{p}"),
    ("summarization", "en", "Write a TL;DR of the following, then one sentence on who would need it.\n\n{p}"),
    ("translation", "en", "Translate the first paragraph of this text into {t}.\n\n{p}"),
    ("rag", "en", "Here is some documentation.\n\n{p}\n\nQuestion: what should a reader remember after "
                  "reading it? Answer from the documentation."),
    ("translation", "xx", "Please translate into English:\n\n{p}"),
)


def _cut(text: str, limit: int) -> str:
    """The text's leading paragraphs (then sentences) of at most `limit` characters."""
    out = ""
    for para in text.split("\n\n"):
        if len(out) + len(para) + 2 <= limit:
            out = f"{out}\n\n{para}" if out else para
            continue
        if not out:  # a first paragraph too long: its leading sentences
            for sent in re.split(r"(?<=[.!?])\s+", para):
                if len(out) + len(sent) + 1 > limit:
                    break
                out = f"{out} {sent}" if out else sent
        break
    return out.strip()


def passage_requests(sources: Sequence[Source], n: int, seed: int = 0, min_chars: int = 400,
                     max_chars: int = 1600, translate_chars: int = 600,
                     grams: Optional[Set[Tuple[str, ...]]] = None) -> Tuple[List[dict], dict]:
    """n requests that quote REAL text as the passage (summarise it, answer about it, extract from it,
    translate it), PASSAGE_REQUESTS in turn; returns (rows {id, category, instruction}, counts).

    The passages are the assistant turns of `sources`' documents (the Python documentation, the
    Debian Reference in five languages): real prose of a few hundred tokens, as long as a pasted
    article or retrieved passage, which the target's own answers (data.py's second stage) are not.
    "xx" requests translate a non-English passage (cut to translate_chars, at least min_chars // 2)
    into English; the {t} request translates an English one into another of LANG_NAMES. A request
    sharing a word 13-gram with `grams` (corpus.dev_ngrams) is dropped and counted. Deterministic in
    (sources, n, seed); these requests did NOT raise agreement on the development answers
    (docs/experiments/corpus.md, real passages)."""
    import random

    pools: Dict[str, List[Tuple[str, str]]] = {"en": [], "xx": []}  # kind -> [(passage, its language)]
    for src in sources:
        for d in src.docs:
            body = next((c for r, c in d.messages if r == "assistant"), "")
            lang = d.key.split(":")[0] if src.name == "debian-reference" else "en"
            text = _cut(body, max_chars if lang == "en" else translate_chars)
            if len(text) >= (min_chars if lang == "en" else min_chars // 2):
                pools["en" if lang == "en" else "xx"].append((text, lang))
    if n and not (pools["en"] and pools["xx"]):
        raise ValueError(f"passage_requests needs English and non-English passages of >= {min_chars} characters "
                         f"(got {len(pools['en'])} and {len(pools['xx'])}): give python-docs and debian-reference")
    rng = random.Random(seed)
    order = {k: rng.sample(range(len(v)), len(v)) for k, v in pools.items()}
    used = {"en": 0, "xx": 0}
    rows, counts = [], {"requests": 0, "dev_overlap": 0, "per_category": {}}
    i = 0
    while len(rows) < n and i < 4 * n + 16:
        cat, kind, tpl = PASSAGE_REQUESTS[i % len(PASSAGE_REQUESTS)]
        i += 1
        j = order[kind][used[kind] % len(order[kind])]
        used[kind] += 1
        p, lang = pools[kind][j]
        text = tpl.format(p=p, l=LANG_NAMES[lang], t=LANG_NAMES[("fr", "de", "es", "it")[j % 4]])
        if grams is not None and not grams.isdisjoint(word_ngrams(text)):
            counts["dev_overlap"] += 1
            continue
        rows.append({"id": 300000 + len(rows), "category": "real_" + cat, "instruction": text})
        counts["per_category"][cat] = counts["per_category"].get(cat, 0) + 1
    counts["requests"] = len(rows)
    counts["passages_available"] = {k: len(v) for k, v in pools.items()}
    counts["sources"] = [src.record() for src in sources]  # name, origin, licence, documents
    return rows, counts


# ----------------------------------------------------------------------------- chat format

def encode(doc: Doc, tokenizer, label: str = "assistant") -> Tuple[List[int], int]:
    """Doc -> (token ids, prompt_len). label "assistant": labels start at the first assistant turn's
    content (later turns of a dialogue, both roles, are labelled too); "all": every token but the first."""
    if doc.tokens is not None:
        ids, p = list(doc.tokens), doc.prompt_len
    else:
        msgs = [{"role": r, "content": c} for r, c in doc.messages]
        first = next(i for i, (r, _) in enumerate(doc.messages) if r == "assistant")
        ids = list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])
        head = list(tokenizer.apply_chat_template(msgs[:first], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
        p = 0
        while p < min(len(head), len(ids)) and head[p] == ids[p]:  # the template is prefix-stable
            p += 1
    return ids, (1 if label == "all" else max(1, p))


# ----------------------------------------------------------------------------- contamination

def overlap_filter(source: Source, grams: Set[Tuple[str, ...]], n: int = NGRAM) -> Source:
    """Drop the source's documents sharing a word n-gram with `grams`; record counts before/after."""
    def hits(d: Doc) -> bool:
        return not grams.isdisjoint(word_ngrams(d.text(), n))

    before = [d for d in source.docs if hits(d)]
    source.docs = [d for d in source.docs if not hits(d)]
    after = sum(hits(d) for d in source.docs)
    source.overlap = {"n": n, "unit": "word", "documents_before": len(before), "documents_after": after,
                      "removed": [d.key for d in before][:50]}
    return source

"""The documents run as written: every ```python block of README.md and docs/**/*.md executes, and every
relative link of README.md, BENCHMARKS.md and docs/**/*.md points to a path that exists and, for a
Markdown page, to a heading that exists (GitHub's anchors).

The blocks of one file run in order in one namespace (a later block may use an earlier one's names).
`load_default` is swapped for a tiny random Llama with the default model's tokenizer (the fixture
`_tiny_default`): the snippets' code paths run in seconds; their outputs are not the default model's.
Links to pages other work is adding (PENDING) may be skipped while those pages do not exist.
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
PENDING: set = set()  # pages other work adds, skipped while missing (none now)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(text: str) -> list:
    return BLOCK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set:
    """The anchors of a Markdown page's headings (outside code fences; a repeated one gets -1, -2, ...)."""
    out, seen, fence = set(), {}, False
    for line in md.read_text(encoding="utf-8").splitlines():
        fence ^= line.startswith("```")
        m = None if fence else re.match(r"#{1,6} +(.*)", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(md: Path) -> list:
    """Relative links of one Markdown file whose target does not exist, or whose #anchor names no
    heading of the target page."""
    bad = []
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (md.parent / file).resolve() if file else md
        rel = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
        if not path.exists():
            if rel not in PENDING:
                bad.append(f"{md.relative_to(REPO)}: {target}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"{md.relative_to(REPO)}: {target} (no such heading)")
    return bad


@pytest.fixture
def _tiny_default(monkeypatch):
    import specref
    from specref import models
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.cached_folder(models.default_gguf_path()))

    def tiny_default(**kw):
        model = models.tiny_model(vocab_size=len(tok), hidden_size=32, num_layers=2, seed=0)
        for cfg in (model.config, model.generation_config):  # the default model's special tokens
            cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
        return model, tok

    monkeypatch.setattr(specref, "load_default", tiny_default)
    monkeypatch.setattr(models, "load_default", tiny_default)


@pytest.mark.parametrize("md", [d for d in DOCS if python_blocks(d.read_text(encoding="utf-8"))],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_python_snippets_run(md, _tiny_default, capsys):
    ns = {"__name__": "__snippet__"}
    for i, block in enumerate(python_blocks(md.read_text(encoding="utf-8"))):
        exec(compile(block, f"{md.name}[block {i}]", "exec"), ns)


def test_relative_links_exist():
    bad = [b for md in DOCS + [REPO / "BENCHMARKS.md"] for b in broken_links(md)]
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def test_the_checks_themselves(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("# Top: the `x` page\n## Top: the `x` page\n[a](missing.md) [b](https://example.com) "
                  "[c](#top-the-x-page) [d](x.md) [e](x.md#top-the-x-page-1) [f](#nowhere) [g](x.md#top-2)\n"
                  "```python\nx = 1\n# not a heading\n```\n", encoding="utf-8")
    assert [b.split(": ")[1] for b in broken_links_at(md, tmp_path)] == [
        "missing.md", "#nowhere (no such heading)", "x.md#top-2 (no such heading)"]
    assert python_blocks(md.read_text()) == ["x = 1\n# not a heading\n"]
    assert anchors(md) == {"top-the-x-page", "top-the-x-page-1"}


def broken_links_at(md: Path, root: Path) -> list:
    global REPO
    saved, REPO = REPO, root
    try:
        return broken_links(md)
    finally:
        REPO = saved

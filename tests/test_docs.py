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


# The pages that list the code: a module left out of docs/architecture.md, a method left out of
# docs/api.md, or a page naming a path that does not exist fails here.
PKG = REPO / "specref"
ROW = re.compile(r"^\| `([^`]+)` \|", re.M)  # a table row's first cell, in backticks
REPO_PATH = re.compile(r"(?<![\w./-])((?:specref|tests|scripts|notebooks|benchmarks|corpus)/[\w./-]*\w)")


def section(md: Path, title: str) -> str:
    """The text of the '## title' section of a page, up to the next '## ' heading."""
    text = md.read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"{md.relative_to(REPO)} has no '## {title}' section"
    return m.group(1)


def package_modules(pkg: Path) -> set:
    """Every .py file of the package, by its path relative to the package."""
    return {p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py") if "__pycache__" not in p.parts}


def differences(doc: set, code: set, page: str, what: str) -> list:
    return ([f"{page} omits the {what} {x}" for x in sorted(code - doc)]
            + [f"{page} names the {what} {x}, which does not exist" for x in sorted(doc - code)])


def test_architecture_lists_every_module():
    doc = set(ROW.findall(section(REPO / "docs" / "architecture.md", "Every module")))
    bad = differences(doc, package_modules(PKG), "docs/architecture.md", "module")
    assert not bad, "\n".join(bad)


def test_api_lists_every_method():
    from specref.registry import METHODS

    doc = set(ROW.findall(section(REPO / "docs" / "api.md", "Every method by name")))
    bad = differences(doc, set(METHODS), "docs/api.md", "method")
    assert not bad, "\n".join(bad)


def missing_paths(md: Path, root: Path) -> list:
    """Repository paths (specref/..., tests/..., ...) a page names that do not exist; a path with an
    upper-case placeholder (NAME, DIR, FILE) is a pattern, not a path."""
    return [f"{md.name}: {p}" for p in sorted(set(REPO_PATH.findall(md.read_text(encoding="utf-8"))))
            if not re.search(r"(^|/)[A-Z][A-Z_]+(\.|/|$)", p) and not (root / p).exists()]


def test_paths_named_in_the_docs_exist():
    """Every repository path the living pages name exists (docs/experiments/ records what was true
    when each measurement ran, old paths included, and is not checked)."""
    pages = [REPO / "README.md", REPO / "BENCHMARKS.md"] + sorted((REPO / "docs").glob("*.md"))
    bad = [b for md in pages for b in missing_paths(md, REPO)]
    assert not bad, "paths named in the docs that do not exist:\n" + "\n".join(bad)


def test_the_list_checks_themselves(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "sub/__pycache__/b.py"):
        (pkg / f).write_text("")
    assert package_modules(pkg) == {"__init__.py", "a.py", "sub/__init__.py", "sub/b.py"}
    md = tmp_path / "x.md"
    md.write_text("# X\n## Every module\n| file | what |\n|---|---|\n| `a.py` | A |\n| `sub/c.py` | C, `sub/b.py` |\n"
                  "## Next\n| `sub/b.py` | outside the section |\nspecref/NAME.py and specref/nowhere.py\n")
    doc = set(ROW.findall(section(md, "Every module")))
    assert doc == {"a.py", "sub/c.py"}
    assert differences(doc, package_modules(pkg), "x.md", "module") == [
        "x.md omits the module __init__.py", "x.md omits the module sub/__init__.py", "x.md omits the module sub/b.py",
        "x.md names the module sub/c.py, which does not exist"]
    assert missing_paths(md, tmp_path) == ["x.md: specref/nowhere.py"]

"""The documents run as written: every ```python block of README.md and docs/*.md executes, and every
relative link of README.md, BENCHMARKS.md and docs/*.md points to a path that exists.

The blocks of one file run in order in one namespace (a later block may use an earlier one's names).
`load_default` is swapped for a tiny random Llama with the default model's tokenizer (the fixture
`_tiny_default`): the snippets' code paths run in seconds; their outputs are not the default model's.
Links to pages other work is adding (PENDING) may be skipped while those pages do not exist.
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
PENDING: set = set()  # pages other work adds, skipped while missing (none now)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(text: str) -> list:
    return BLOCK.findall(text)


def broken_links(md: Path) -> list:
    """Relative links of one Markdown file whose target does not exist (anchors ignored)."""
    bad = []
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (md.parent / target.split("#")[0]).resolve()
        rel = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
        if not path.exists() and rel not in PENDING:
            bad.append(f"{md.relative_to(REPO)}: {target}")
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
    md.write_text("[a](missing.md) [b](https://example.com) [c](#top) [d](x.md)\n```python\nx = 1\n```\n",
                  encoding="utf-8")
    assert [b.split(": ")[1] for b in broken_links_at(md, tmp_path)] == ["missing.md"]
    assert python_blocks(md.read_text()) == ["x = 1\n"]


def broken_links_at(md: Path, root: Path) -> list:
    global REPO
    saved, REPO = REPO, root
    try:
        return broken_links(md)
    finally:
        REPO = saved

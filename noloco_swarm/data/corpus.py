"""The embedded offline corpus: English prose that ships with every CPython, split into train and validation.

What the corpus is
------------------
About 3.5 MB of natural-language English written by the CPython developers, gathered from the
files of the running interpreter's standard library so that a run needs no download:

* the language-reference topics of `pydoc_data.topics` (what `help("assert")` prints), one
  document per topic;
* for each `.py` file of the standard library (test suites and site-packages excluded), one
  document holding, in source order, its module, class and function docstrings, its own-line
  comment blocks and its message strings (errors, warnings, help texts) that read as prose.
  Docstrings are read with `ast`, never by importing the module, and dedented with
  `inspect.cleandoc`;
* a few packaged prose files: `LICENSE.txt`, `email/architecture.rst` and IDLE's help and notes.

Files are visited in sorted order and every filter is a pure function of the text, so the corpus
is byte-identical on machines with the same Python build; its sha256 is recorded. Distributions
that patch or strip the standard library (some Linux packages drop `idlelib`) can produce a
different corpus from the same version number: compare `Corpus.sha256`, not the version.

A document is in the validation split when the sha256 of its *name* is 0 mod 50 (16 of 787
documents with CPython 3.11, about 1.7% of the characters); keying on the name, not the text,
keeps a document on the same side of the split when a patch release edits its text. The two
splits never share a document, and validation shares no text with training
(`deduplicate_validation`): a validation document whose whole text occurs in the training split
is dropped (pydoc's `topic:else` is byte-identical to the training document `topic:if`), and a
paragraph of at least `_MIN_SHARED_PARAGRAPH` characters that also occurs there (licence lines,
option help repeated across modules) is cut from the validation document that holds it. The
training split is left as it is, so the tokenizer and the training data do not change.

The built corpus is cached as JSON lines under `<cache>/corpus-py<X.Y.Z>-<CORPUS_VERSION>/`.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from noloco_swarm.data.config import resolve_cache_dir

# Bump when any extraction rule changes: it names the cache directory, so old caches are ignored.
CORPUS_VERSION = "stdlib-prose-v1"
VAL_MODULUS = 50

# Directories whose files are code fixtures or third-party packages, not the standard library's prose.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# pydoc_data/topics.py is read as data below; walking it too would add nothing but its header.
_SKIP_FILES = frozenset({"pydoc_data/topics.py"})
_PROSE_FILES = (
    "LICENSE.txt",
    "email/architecture.rst",
    "idlelib/help.html",
    "idlelib/README.txt",
    "idlelib/NEWS.txt",
    "idlelib/NEWS2x.txt",
    "idlelib/HISTORY.txt",
    "idlelib/TODO.txt",
    "idlelib/extend.txt",
    "idlelib/CREDITS.txt",
)
_MIN_DOCSTRING_CHARS = 40
_MIN_COMMENT_CHARS = 40
_MIN_COMMENT_WORDS = 6
_MIN_MESSAGE_CHARS = 30
_MIN_MESSAGE_WORDS = 6
# Share of letters and blanks below which a text is mostly code, numbers or ASCII art. Docstrings
# may hold doctest examples; comments are often commented-out code, which this filters out.
_MIN_LETTER_SHARE = 0.6
_MIN_COMMENT_LETTER_SHARE = 0.7
_MIN_MESSAGE_LETTER_SHARE = 0.8
# Validation paragraphs at least this long that also occur in training are cut (shorter ones are
# common phrases, not leaked text).
_MIN_SHARED_PARAGRAPH = 40


@dataclass(frozen=True)
class Document:
    """One document of the corpus: a stable name (its source) and its text."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The embedded corpus, split; `sha256` identifies its exact content."""

    train: tuple[Document, ...]
    val: tuple[Document, ...]
    sha256: str
    python_version: str
    directory: Path

    @property
    def train_chars(self) -> int:
        return sum(len(d.text) for d in self.train)

    @property
    def val_chars(self) -> int:
        return sum(len(d.text) for d in self.val)


def is_validation(name: str) -> bool:
    """Whether the document with this name belongs to the validation split."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % VAL_MODULUS == 0


def deduplicate_validation(train: tuple[Document, ...], val: tuple[Document, ...]) -> tuple[Document, ...]:
    """`val` without the text that also occurs in `train`: whole documents contained in the training
    text are dropped, shared paragraphs (blank-line separated, >= _MIN_SHARED_PARAGRAPH chars) cut."""
    seen = "\n\n".join(d.text for d in train)
    out = []
    for doc in val:
        if doc.text in seen:
            continue
        paragraphs = doc.text.split("\n\n")
        kept = [p for p in paragraphs if len(p.strip()) < _MIN_SHARED_PARAGRAPH or p.strip() not in seen]
        text = "\n\n".join(kept).strip()
        if text:
            out.append(Document(doc.name, text))
    return tuple(out)


def _letter_share(text: str) -> float:
    return sum(c.isalpha() or c.isspace() for c in text) / max(len(text), 1)


def _looks_like_prose(text: str, min_chars: int, min_share: float, min_words: int = 0) -> bool:
    return len(text) >= min_chars and len(text.split()) >= min_words and _letter_share(text) >= min_share


def _comment_blocks(source: bytes) -> Iterator[tuple[int, str]]:
    """(first line, text) of each run of consecutive own-line comments, '#' markers removed."""
    block: list[str] = []
    start = last = -1
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            # Trailing comments annotate a single line of code and read poorly out of context.
            if tok.type != tokenize.COMMENT or not tok.line.lstrip().startswith("#"):
                continue
            line = tok.start[0]
            if line != last + 1 and block:
                yield start, "\n".join(block).strip()
                block = []
            if not block:
                start = line
            text = tok.string.lstrip("#").strip()
            # Rules such as "# ------" separate sections and carry no words.
            if any(c.isalnum() for c in text):
                block.append(text)
            elif not text and block and block[-1]:
                block.append("")  # a bare "#" line separates paragraphs
            last = line
    except (tokenize.TokenError, SyntaxError):
        # A file tokenize rejects is rejected identically everywhere; its blocks so far stand.
        pass
    if block:
        yield start, "\n".join(block).strip()


_DEFINITIONS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _docstrings(nodes: list[ast.AST]) -> Iterator[tuple[int, str]]:
    """(line, cleaned text) of the module, class and function docstrings among a file's nodes."""
    for node in nodes:
        if isinstance(node, _DEFINITIONS):
            text = ast.get_docstring(node, clean=True)  # clean=True is inspect.cleandoc
            if text and node.body:
                yield node.body[0].lineno, text


def _messages(nodes: list[ast.AST]) -> Iterator[tuple[int, str]]:
    """(line, text) of the string literals that are neither docstrings nor f-string pieces."""
    skip: set[int] = set()
    for node in nodes:
        first = node.body[0] if isinstance(node, _DEFINITIONS) and node.body else None
        if isinstance(first, ast.Expr) and ast.get_docstring(node, clean=False) is not None:
            skip.add(id(first.value))
        elif isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
    seen: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = inspect.cleandoc(node.value)
            # A message raised from several places is one sentence, not several.
            if text not in seen:
                seen.add(text)
                yield node.lineno, text


def source_document(source: bytes) -> str:
    """The prose of one Python source file: docstrings, comment blocks and messages in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    # One walk serves both extractors: walking the tree is most of the build time.
    nodes = list(ast.walk(tree))
    parts = [
        (line, text)
        for line, text in _docstrings(nodes)
        if _looks_like_prose(text, _MIN_DOCSTRING_CHARS, _MIN_LETTER_SHARE)
    ]
    parts += [
        (line, text)
        for line, text in _comment_blocks(source)
        if _looks_like_prose(text, _MIN_COMMENT_CHARS, _MIN_COMMENT_LETTER_SHARE, _MIN_COMMENT_WORDS)
    ]
    parts += [
        (line, text)
        for line, text in _messages(nodes)
        if _looks_like_prose(text, _MIN_MESSAGE_CHARS, _MIN_MESSAGE_LETTER_SHARE, _MIN_MESSAGE_WORDS)
    ]
    # Sorting on (line, text) makes ties (none expected) deterministic too.
    return "\n\n".join(text for _, text in sorted(parts))


class _HTMLText(HTMLParser):
    """Collects the visible text of an HTML page, one line per block element; `<pre>` keeps its lines."""

    _BLOCKS = frozenset({"p", "div", "li", "dt", "dd", "pre", "h1", "h2", "h3", "h4", "br", "tr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.chunks: list[str] = []
        self._hidden = 0
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._hidden += 1
        if tag == "pre":
            self._pre += 1
        if tag in self._BLOCKS:
            self.chunks.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._hidden = max(0, self._hidden - 1)
        if tag == "pre":
            self._pre = max(0, self._pre - 1)
        if tag in self._BLOCKS:
            self.chunks.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            # Outside <pre>, a source line break is just a space, as a browser renders it.
            self.chunks.append(data if self._pre else " ".join(data.split("\n")))


def html_to_text(html: str) -> str:
    """The visible text of `html`, blank runs collapsed, one line per paragraph."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.chunks).split("\n"))
    return "\n".join(line for line in lines if line)


def _stdlib_files(root: Path) -> list[Path]:
    files = [
        p
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
        and p.relative_to(root).as_posix() not in _SKIP_FILES
    ]
    # Path order compares parts, not strings: sort on the posix text so every OS agrees.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def collect_documents(stdlib: Path | None = None) -> list[Document]:
    """Every document of the corpus in its fixed order; pure in the files of `stdlib`."""
    import pydoc_data.topics

    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    topics: dict[str, str] = pydoc_data.topics.topics
    docs = [Document(f"topic:{key}", topics[key].strip()) for key in sorted(topics)]
    for path in _stdlib_files(root):
        text = source_document(path.read_bytes())
        if text:
            docs.append(Document(f"stdlib:{path.relative_to(root).as_posix()}", text))
    for rel in _PROSE_FILES:
        path = root / rel
        if path.is_file():
            raw = path.read_text(encoding="utf-8", errors="replace")
            text = html_to_text(raw) if rel.endswith(".html") else raw.strip()
            docs.append(Document(f"file:{rel}", text))
    # Carriage returns would make the same corpus differ between checkouts with different newlines.
    return [Document(d.name, d.text.replace("\r\n", "\n")) for d in docs if d.text]


def corpus_sha256(docs: list[Document]) -> str:
    """Hash of names and texts in order; equal hashes mean equal corpora."""
    h = hashlib.sha256()
    for doc in docs:
        for field in (doc.name, doc.text):
            data = field.encode("utf-8")
            h.update(len(data).to_bytes(8, "big"))
            h.update(data)
    return h.hexdigest()


def corpus_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory of the embedded corpus for this Python version."""
    version = ".".join(str(v) for v in sys.version_info[:3])
    return resolve_cache_dir(cache_dir) / f"corpus-py{version}-{CORPUS_VERSION}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so peers sharing a cache never read a partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# Corpora this process has read, by their files' identity: a stage-0 peer opens its data stream
# again whenever the shard layout changes (a peer joined or left), and reading and splitting the
# corpus costs over a second, which the whole pipeline would wait for at that step.
_read: dict[tuple[Path, tuple[int, int, int, int]], Corpus] = {}


def build_corpus(cache_dir: str | os.PathLike[str] | None = None) -> Corpus:
    """The embedded corpus, read from the cache or built there (a few seconds) on first use; read
    once per process while its files stay the same."""
    directory = corpus_dir(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    docs_path, meta_path = directory / "documents.jsonl", directory / "meta.json"
    try:
        docs_stat, meta_stat = docs_path.stat(), meta_path.stat()
    except FileNotFoundError:
        return _build_corpus(directory, docs_path, meta_path)
    key = (directory, (docs_stat.st_mtime_ns, docs_stat.st_size, meta_stat.st_mtime_ns, meta_stat.st_size))
    if key not in _read:
        _read.clear()  # one corpus at a time is all a process uses
        _read[key] = _build_corpus(directory, docs_path, meta_path)
    return _read[key]


def _build_corpus(directory: Path, docs_path: Path, meta_path: Path) -> Corpus:
    if docs_path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        docs = [Document(**json.loads(line)) for line in docs_path.read_text("utf-8").splitlines()]
        if corpus_sha256(docs) != meta["sha256"]:
            raise ValueError(f"the cached corpus in {directory} is corrupt; delete that directory")
    else:
        docs = collect_documents()
        if not docs:
            raise ValueError("no standard-library text found; is the Python installation stripped?")
        meta = {
            "sha256": corpus_sha256(docs),
            "corpus_version": CORPUS_VERSION,
            "python_version": sys.version,
            "documents": len(docs),
            "chars": sum(len(d.text) for d in docs),
        }
        lines = "".join(json.dumps({"name": d.name, "text": d.text}) + "\n" for d in docs)
        write_atomic(docs_path, lines.encode("utf-8"))
        # meta.json last: its presence marks a complete build.
        write_atomic(meta_path, json.dumps(meta, indent=1).encode("utf-8"))
    train = tuple(d for d in docs if not is_validation(d.name))
    return Corpus(
        train=train,
        val=deduplicate_validation(train, tuple(d for d in docs if is_validation(d.name))),
        sha256=meta["sha256"],
        python_version=meta["python_version"],
        directory=directory,
    )

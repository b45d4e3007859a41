"""The project's text stays short and true.

- Every error message quoted in a "message" table (the first column of a table whose header
  starts with `| message |`, in README.md or docs/*.md) is one the code prints today: each part
  of it between `...` elisions must be found in a string literal under noloco_swarm/.
- README.md and docs/benchmarks.md stay within their line budgets (issue 34).
- No text refers to numbered work sessions (the word and a number): a date, a commit or an
  issue number says it in a way a reader can resolve.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "noloco_swarm"
TEXT_SUFFIXES = {".md", ".py", ".sh", ".toml", ".txt", ".yml", ".yaml", ".json", ".cfg"}
SESSION = re.compile(r"\bsessions? \d+", re.IGNORECASE)
QUOTE_CHARS = " '\"`:;,."


def normalise(text: str) -> str:
    return " ".join(text.split())


def source_strings() -> list[str]:
    """Every string literal under noloco_swarm/, implicit concatenations joined and each f-string's
    holes replaced by a NUL (so that no quoted fragment can match across one)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(normalise(node.value))
            elif isinstance(node, ast.JoinedStr):
                parts = [
                    v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "\0"
                    for v in node.values
                ]
                out.append(normalise("".join(parts)))
    return out


def quoted_messages(path: Path) -> list[str]:
    """The code spans in the first column of every table headed `| message | ...`."""
    messages = []
    in_table = False
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in stripped.strip("|").split("|")]
        if cells and cells[0].lower() == "message":
            in_table = True
            continue
        if in_table and not set(stripped) <= set("|-: "):
            messages += re.findall(r"`([^`]+)`", cells[0])
    return messages


def fragments(message: str) -> list[str]:
    """The literal parts of a quoted message: split at `...`, trimmed of quotes and punctuation."""
    parts = (normalise(p).strip(QUOTE_CHARS) for p in message.split("..."))
    return [p for p in parts if len(p) >= 4]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_quoted_error_messages_are_printed_by_the_code() -> None:
    strings = source_strings()
    quoted = {path.name: quoted_messages(path) for path in documents()}
    assert quoted["README.md"], "README.md quotes no error messages: was its table's header renamed?"
    missing = [
        f"{name}: `{message}` (no string under noloco_swarm/ contains {fragment!r})"
        for name, messages in quoted.items()
        for message in messages
        for fragment in fragments(message)
        if not any(fragment in s for s in strings)
    ]
    assert not missing, "quoted messages the code no longer prints:\n" + "\n".join(missing)


def test_every_quoted_message_has_a_checkable_part() -> None:
    for path in documents():
        for message in quoted_messages(path):
            assert fragments(message), f"{path.name}: `{message}` has no part long enough to check"


def test_a_reworded_message_is_caught() -> None:
    strings = source_strings()
    message = quoted_messages(ROOT / "README.md")[0]
    longest = max(fragments(message), key=len)
    assert any(longest in s for s in strings)
    words = longest.split()
    reworded = " ".join([*words[1:], words[0]])
    assert not any(reworded in s for s in strings)


def test_line_budgets() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").count("\n")
    assert readme <= 150, f"README.md has {readme} lines; at most 150"
    assert benchmarks <= 400, f"docs/benchmarks.md has {benchmarks} lines; at most 400"


def text_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in ("docs", "bench", "scripts", "tests", "noloco_swarm"):
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return files


def test_no_numbered_session_references() -> None:
    found = []
    for path in text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if SESSION.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "numbered session references (use a date, a commit or an issue):\n" + "\n".join(found)

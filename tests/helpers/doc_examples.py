"""The documentation's shell examples, as data: find them, run them with real curl, compare with what the page shows.

The pages are README.md, every docs/**/*.md and the root files the docs include with pymdownx.snippets
(`--8<-- "SECURITY.md"`): `doc_pages` lists them. Each example keeps its file and line.

An example is a command in a fenced ``bash``/``sh``/``shell``/``console`` block (or one without a
language): a line starting with ``$ `` (console style) or, in a block without ``$`` prompts, with
``curl``; a line ending in ``\\`` continues on the next line. The lines up to the next command are
the output the page shows for it, together with the command's own trailing ``# comment``.

Which server an example needs is said by a marker right above its block, invisible on GitHub:

    <!-- server: make serve -->

Every block holding a curl command must have one (`tests/e2e/test_doc_examples.py` knows the
kinds). A command whose comment says ``# expect 422`` must answer that status; every other one
must answer a status below 400. A block marked ``<!-- setup: KIND -->`` is a script that prepares
what that server needs (files, models); it runs as a whole before the server starts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SNIPPET = re.compile(r'^\s*-+8<-+\s+"(?P<path>[^":]+)(?::[^"]*)?"\s*$')  # `--8<-- "FILE"` or "FILE:section"
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "shell-session"}
MARKER = re.compile(r"^<!--\s*(?P<role>server|setup):\s*(?P<kind>[^>]*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<fence>```+)\s*(?P<lang>[\w-]*)")
EXPECT = re.compile(r"(?:^|#)\s*expect\s+(?P<status>\d{3})\b")
CURL_WORD = re.compile(r"(?<![\w./-])curl(?=\s)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
JSON_KEY = re.compile(r'"(?P<key>[A-Za-z_][\w.-]*)"\s*:')
HEADER_LINE = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9-]*): ")
STATUS_LINE = re.compile(r"^HTTP/[\d.]+ (?P<status>\d{3})", re.MULTILINE)
VERBOSE_STATUS = re.compile(r"^< HTTP/[\d.]+ (?P<status>\d{3})", re.MULTILINE)


@dataclass(frozen=True)
class Example:
    line: int  # 1-based line of the command in its page
    server: str | None  # the marker of its block
    command: str  # as written: `$ ` removed, continuation lines joined, trailing comment kept
    shown: str  # the page's output for it (its trailing comment, then the lines after it)
    expect: int | None  # the status asked for by `# expect NNN`
    assignments: str = ""  # variables set earlier in its block (`S='...'`), run before it
    file: str = ""  # the page, relative to the repository root (`docs/protocols/tgi.md`)

    @property
    def is_curl(self) -> bool:
        return CURL_WORD.search(split_comment(self.command)[0]) is not None

    def __str__(self) -> str:
        return f"{self.file or '<markdown>'}:{self.line}: {self.command}"


@dataclass(frozen=True)
class Setup:
    line: int  # 1-based line of the block's first line in its page
    server: str
    script: str
    file: str = ""  # the page, relative to the repository root

    def __str__(self) -> str:
        return f"{self.file or '<markdown>'}:{self.line}"


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    status: int | None  # the last HTTP status curl received (from its -v trace)
    stdout: str
    stderr: str


def _scan(text: str) -> tuple[int | None, str]:
    """Where a shell comment starts in `text` (a `#` outside quotes after whitespace) and which quote
    is still open at its end ("" for none), with bash's quoting: nothing escapes inside '...', a
    backslash escapes the next character elsewhere."""
    quote = ""
    escaped = False
    for i, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return i, ""
    return None, quote


def split_comment(line: str) -> tuple[str, str]:
    """`(code, comment)`: the comment is what follows the first `#` outside quotes after whitespace."""
    start, _ = _scan(line)
    if start is None:
        return line.rstrip(), ""
    return line[:start].rstrip(), line[start + 1 :].strip()


def doc_pages(root: Path) -> list[str]:
    """The pages whose examples run, relative to `root`: README.md, every docs/**/*.md, then the files
    outside docs/ that a page includes with pymdownx.snippets (`--8<-- "SECURITY.md"`), each once."""
    pages = ["README.md", *sorted(path.relative_to(root).as_posix() for path in (root / "docs").rglob("*.md"))]
    for page in list(pages):
        for line in (root / page).read_text(encoding="utf-8").splitlines():
            found = SNIPPET.match(line)
            if found and found["path"] not in pages and (root / found["path"]).is_file():
                pages.append(found["path"])
    return pages


def parse_examples(markdown: str, file: str = "") -> list[Example]:
    """Every command of every shell block of one page, in order (curl or not: see `Example.is_curl`)."""
    lines = markdown.splitlines()
    examples: list[Example] = []
    for role, kind, start, end in _shell_blocks(lines):
        if role != "setup":
            examples += _block_examples(lines, start, end, kind, file)
    return examples


def parse_setups(markdown: str, file: str = "") -> list[Setup]:
    """The blocks of one page marked `<!-- setup: KIND -->`, in order."""
    lines = markdown.splitlines()
    return [
        Setup(line=start + 1, server=kind, script="\n".join(lines[start:end]), file=file)
        for role, kind, start, end in _shell_blocks(lines)
        if role == "setup" and kind is not None
    ]


def _shell_blocks(lines: list[str]) -> list[tuple[str | None, str | None, int, int]]:
    """`(marker role, marker kind, first line index, end index)` of every shell block."""
    blocks: list[tuple[str | None, str | None, int, int]] = []
    role: str | None = None
    kind: str | None = None
    i = 0
    while i < len(lines):
        if found := MARKER.match(lines[i]):
            role, kind = found["role"], found["kind"]
            i += 1
            continue
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence["fence"]):
            end += 1
        if fence["lang"] in SHELL_LANGUAGES:
            blocks.append((role, kind, i + 1, end))
        role = kind = None  # a marker covers the next block only
        i = end + 1
    return blocks


def _block_examples(lines: list[str], start: int, end: int, server: str | None, file: str) -> list[Example]:
    prompts = any(lines[k].startswith("$ ") for k in range(start, end))
    examples: list[Example] = []
    assignments: list[str] = []  # `S='{...}'` lines: the block's later commands use them
    k = start
    while k < end:
        line = lines[k]
        if prompts and line.startswith("$ "):
            first = line[2:]
        elif not prompts and (line.lstrip().startswith("curl ") or _is_assignment(line)):
            first = line.strip()
        else:
            k += 1
            continue
        command_line = k + 1
        command = first
        while k + 1 < end and (_scan(command)[1] or split_comment(command)[0].endswith("\\")):
            k += 1
            if _scan(command)[1]:  # a quoted string that goes on on the next line
                command += "\n" + lines[k]
            else:
                command = split_comment(command)[0][:-1].rstrip() + " " + lines[k].strip()
        k += 1
        if _is_assignment(command):
            assignments.append(command)
            continue
        comment = split_comment(command)[1]
        shown: list[str] = [EXPECT.sub("", comment).strip()]
        while k < end and not _starts_command(lines[k], prompts):
            shown.append(lines[k])
            k += 1
        expect = EXPECT.search(comment)
        examples.append(
            Example(
                line=command_line,
                server=server,
                command=command,
                shown="\n".join(shown).strip("\n"),
                expect=int(expect["status"]) if expect else None,
                assignments="\n".join(assignments),
                file=file,
            )
        )
    return examples


def _is_assignment(line: str) -> bool:
    """`NAME=value` alone on its line (not `NAME=value command`)."""
    try:
        words = shlex.split(split_comment(line)[0])
    except ValueError:
        return False
    return len(words) == 1 and ASSIGNMENT.match(words[0]) is not None


def _starts_command(line: str, prompts: bool) -> bool:
    return line.startswith("$ ") if prompts else (line.lstrip().startswith("curl ") or _is_assignment(line))


def run_bash(script: str, replacements: Mapping[str, str], cwd: Path, timeout: float = 300.0) -> Outcome:
    """Run a script with bash -e after replacing the page's text with this machine's (no proxy)."""
    for old, new in replacements.items():
        script = script.replace(old, new)
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # python, lmiserve
    proc = subprocess.run(
        ["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    statuses = VERBOSE_STATUS.findall(proc.stderr)
    return Outcome(proc.returncode, int(statuses[-1]) if statuses else None, proc.stdout, proc.stderr)


def run_example(example: Example, replacements: Mapping[str, str], cwd: Path) -> Outcome:
    """Run the command with bash and real curl (`-v` added to read the status, `-m` to bound it,
    no progress meter to keep the `-v` lines apart).
    Without pipefail: `curl ... | head -c 120` is judged by its status, not by curl's exit code."""
    command = CURL_WORD.sub("curl -v --no-progress-meter -m 240", split_comment(example.command)[0])
    return run_bash(f"{example.assignments}\n{command}", replacements, cwd)


def json_shape(value: Any) -> Any:
    """Keys and nesting of a JSON value, not its values: dicts by key, lists by their first item."""
    if isinstance(value, dict):
        return {key: json_shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_shape(value[0])] if value else []
    return "scalar"


def _shown_text(shown: str) -> str:
    """The shown output without bash comment markers (`# {"a": 1}` -> `{"a": 1}`)."""
    return "\n".join(line[2:] if line.startswith("# ") else line for line in shown.splitlines())


def _json_documents(text: str) -> list[Any]:
    """The whole text as one JSON document if it is one, else every line (or SSE `data:`) that is."""
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, (dict, list)):
        return [whole]
    documents = []
    for line in text.splitlines():
        line = line.removeprefix("data: ").strip()
        if line[:1] in ("{", "["):
            try:
                documents.append(json.loads(line))
            except ValueError:
                continue
    return documents


def mismatches(example: Example, outcome: Outcome) -> list[str]:
    """How the output shown on the page disagrees with the real one (shape and keys, not values)."""
    problems: list[str] = []
    shown = _shown_text(example.shown)
    actual = outcome.stdout
    actual_shapes = [json_shape(doc) for doc in _json_documents(actual)]
    for document in _json_documents(shown):
        if json_shape(document) not in actual_shapes:
            problems.append(f"shown JSON {json.dumps(document)[:200]} has another shape than the answer")
    for key in dict.fromkeys(JSON_KEY.findall(shown)):
        if not re.search(rf'"{re.escape(key)}"\s*:', actual):
            problems.append(f"shown key {key!r} is not in the answer")
    shown_status = STATUS_LINE.search(shown)
    if shown_status and shown_status["status"] != str(outcome.status):
        problems.append(f"shown status line {shown_status.group(0)!r}, got HTTP {outcome.status}")
    if shown_status:  # an `-i`/`-D -` example: the headers it shows must be there
        actual_headers = {m["name"].lower() for line in actual.splitlines() if (m := HEADER_LINE.match(line))}
        for line in shown.splitlines():
            header = HEADER_LINE.match(line)
            if header and header["name"].lower() not in actual_headers:
                problems.append(f"shown header {header['name']!r} is not in the answer")
    return problems

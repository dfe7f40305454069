"""How tests/helpers/doc_examples.py finds the documentation's pages, reads their examples and judges
the output they show."""

from __future__ import annotations

from pathlib import Path

from helpers.doc_examples import (
    Example,
    Outcome,
    doc_pages,
    mismatches,
    parse_examples,
    parse_setups,
    split_comment,
)

MARKDOWN = """\
Intro.

<!-- server: make serve -->
```bash
curl -s localhost:8080/generate -H 'Content-Type: application/json' \\
  -d '{"inputs":"a # not a comment"}'
# {"generated_text": "..."}

curl -s localhost:8080/ping                   # 200 {"m": {"status": "Healthy"}}
```

<!-- server: store -->
```console
$ printf 'x\\n' \\
    | curl -s localhost:8080/invocations --data-binary @-
HTTP/1.1 200 OK
content-type: text/csv

1.0
$ curl -s localhost:8080/v2/models/nope/ready    # expect 404
{"error": "Model nope not found"}
```

```bash
curl -s localhost:8080/unmarked
```

```python
print("curl localhost:8080")
```

<!-- setup: store -->
```bash
mkdir -p store/m
```
"""


def test_commands_with_continuations_comments_and_markers():
    examples = parse_examples(MARKDOWN)
    assert [(e.line, e.server, e.expect) for e in examples] == [
        (5, "make serve", None),
        (9, "make serve", None),
        (14, "store", None),
        (20, "store", 404),
        (25, None, None),  # a marker covers the next block only
    ]
    first, ping, pipe, ready, _ = examples
    assert first.command == (
        "curl -s localhost:8080/generate -H 'Content-Type: application/json' -d '{\"inputs\":\"a # not a comment\"}'"
    )
    assert first.shown == '# {"generated_text": "..."}'
    assert ping.shown.startswith('200 {"m":')
    assert pipe.command == "printf 'x\\n' | curl -s localhost:8080/invocations --data-binary @-"
    assert pipe.shown.splitlines()[0] == "HTTP/1.1 200 OK"
    assert ready.shown == '{"error": "Model nope not found"}'
    assert all(e.is_curl for e in examples)


def test_setup_blocks_are_not_examples():
    assert [(s.line, s.server, s.script) for s in parse_setups(MARKDOWN)] == [(34, "store", "mkdir -p store/m")]
    assert not any("mkdir" in e.command for e in parse_examples(MARKDOWN))


def test_examples_and_setups_name_their_page_and_line():
    examples = parse_examples(MARKDOWN, "docs/protocols/tgi.md")
    assert {e.file for e in examples} == {"docs/protocols/tgi.md"}
    assert str(examples[0]).startswith("docs/protocols/tgi.md:5: curl -s localhost:8080/generate ")
    assert str(parse_setups(MARKDOWN, "docs/models.md")[0]) == "docs/models.md:34"
    assert str(parse_examples(MARKDOWN)[0]).startswith("<markdown>:5: curl")


def test_doc_pages_are_the_readme_the_docs_and_the_files_they_include(tmp_path: Path):
    (tmp_path / "docs" / "protocols").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# r\n")
    (tmp_path / "SECURITY.md").write_text("# s\n")
    (tmp_path / "CONTRIBUTING.md").write_text("# c\n")
    (tmp_path / "docs" / "index.md").write_text('--8<-- "README.md:intro"\n')
    (tmp_path / "docs" / "security.md").write_text('--8<-- "SECURITY.md"\n')
    (tmp_path / "docs" / "contributing.md").write_text('  --8<-- "CONTRIBUTING.md"\n--8<-- "missing.md"\n')
    (tmp_path / "docs" / "protocols" / "tgi.md").write_text("# t\n")
    (tmp_path / "docs" / "notes.txt").write_text('--8<-- "notes.md"\n')
    assert doc_pages(tmp_path) == [
        "README.md",
        "docs/contributing.md",
        "docs/index.md",
        "docs/protocols/tgi.md",
        "docs/security.md",
        "CONTRIBUTING.md",
        "SECURITY.md",
    ]


def test_split_comment_ignores_hashes_in_quotes_and_words():
    assert split_comment('curl -d \'{"a": "#x"}\' url#frag  # note') == ('curl -d \'{"a": "#x"}\' url#frag', "note")
    assert split_comment("curl url") == ("curl url", "")


def _example(shown: str) -> Example:
    return Example(line=1, server="make serve", command="curl url", shown=shown, expect=None)


def _outcome(stdout: str, status: int = 200) -> Outcome:
    return Outcome(exit_code=0, status=status, stdout=stdout, stderr="")


def test_shown_json_must_have_the_shape_of_the_answer():
    assert mismatches(_example('# {"generated_text": "x"}'), _outcome('{"generated_text": "y"}')) == []
    assert mismatches(_example('[{"generated_text": "x"}]'), _outcome('{"generated_text": "y"}')) != []
    assert mismatches(_example('{"a": 1, "b": 2}'), _outcome('{"a": 1}')) != []


def test_shown_keys_of_abridged_output_must_be_in_the_answer():
    shown = 'data: {"token": {...}, "generated_text": ...}'
    actual = 'data: {"token": {"id": 1}}\n\ndata: {"token": {"id": 2}, "generated_text": "a"}\n\n'
    assert mismatches(_example(shown), _outcome(actual)) == []
    assert mismatches(_example('{"details": ...}'), _outcome(actual)) == ["shown key 'details' is not in the answer"]


def test_shown_status_line_and_headers_must_match():
    shown = "HTTP/1.1 200 OK\ncontent-type: text/csv\nx-custom: 1\n\n1.0"
    actual = "HTTP/1.1 200 OK\ndate: now\ncontent-type: text/csv\n\n1.0\n"
    assert mismatches(_example(shown), _outcome(actual)) == ["shown header 'x-custom' is not in the answer"]
    assert mismatches(_example("HTTP/1.1 200 OK"), _outcome("HTTP/1.1 404 Not Found\n", 404)) == [
        "shown status line 'HTTP/1.1 200', got HTTP 404"
    ]


def test_scalars_shown_are_not_shapes():
    assert mismatches(_example("200"), _outcome("200\n")) == []


def test_assignments_and_quoted_strings_over_several_lines():
    markdown = """\
<!-- server: make serve -->
```bash
S='{"type":"object"}'
curl -s localhost:8080/generate -d "{\\"inputs\\":\\"a # b\\",
       \\"schema\\":$S}"
# {"generated_text": "x"}
curl -s localhost:8080/info    # expect 401
```
"""
    first, second = parse_examples(markdown)
    assert first.assignments == second.assignments == """S='{"type":"object"}'"""
    assert first.command == 'curl -s localhost:8080/generate -d "{\\"inputs\\":\\"a # b\\",\n       \\"schema\\":$S}"'
    assert first.shown == '# {"generated_text": "x"}'
    assert (second.expect, second.shown) == (401, "")


def test_split_comment_knows_backslash_escapes():
    assert split_comment('curl -d "{\\"a\\": 1}" # c') == ('curl -d "{\\"a\\": 1}"', "c")
    assert split_comment("echo it\\'s # c") == ("echo it\\'s", "c")

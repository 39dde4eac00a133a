"""The docs: generated pages current, links that resolve, nothing outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from compose import cli_reference

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
# Names of files that live outside this repository: nothing here may point at them.
OUTSIDE = (b"DESIGN.md", b"STYLE.md", b"ENVIRONMENT.md", b"../shared")

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _repo_files() -> list[str]:
    """Files git tracks, and new ones it does not ignore (pages not committed yet)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout: {e}")
    return sorted({name for name in out.decode().split("\0") if name})


def _anchor(heading: str) -> str:
    """The anchor a GitHub-style renderer gives a heading."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_anchor(m[1]) for m in _HEADING.finditer(text)}


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_cli_reference_is_current() -> None:
    path = REPO / cli_reference.DOC
    assert path.exists(), f"{cli_reference.DOC} is missing: run {cli_reference.REGENERATE}"
    assert path.read_text(encoding="utf-8") == cli_reference.render(), (
        f"{cli_reference.DOC} is out of date with the ddiloco options: "
        f"run {cli_reference.REGENERATE}"
    )


def test_cli_reference_check_exits_1_when_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "docs").mkdir()
    monkeypatch.setattr(cli_reference, "ROOT", tmp_path)
    assert cli_reference.main(["--check"]) == 1
    assert cli_reference.REGENERATE in capsys.readouterr().err
    assert cli_reference.main(["--write"]) == 0
    assert cli_reference.main(["--check"]) == 0
    stale = tmp_path / cli_reference.DOC
    stale.write_text(stale.read_text(encoding="utf-8") + "edited\n", encoding="utf-8")
    assert cli_reference.main(["--check"]) == 1


def test_cli_reference_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cli_reference.render()
    monkeypatch.setenv("DDILOCO_STEPS", "7")
    monkeypatch.setenv("COLUMNS", "40")
    assert cli_reference.render() == before
    assert "| `--steps` | `DDILOCO_STEPS` | `300` |" in before


def test_cli_reference_covers_every_command() -> None:
    text = cli_reference.render()
    for command in ("init", "syncer", "learner", "evaluator", "local", "report", "chaos"):
        assert f"\n## ddiloco {command}\n" in text
    assert "\n## ddiloco throttle set|show|clear\n" in text
    assert str(REPO) not in text


def test_no_file_refers_outside_the_repository() -> None:
    found = []
    for name in _repo_files():
        path = REPO / name
        if name == "tests/test_docs.py" or not path.is_file():
            continue
        data = path.read_bytes()
        found += [f"{name}: {word.decode()}" for word in OUTSIDE if word in data]
    assert not found, "references to files outside the repository:\n" + "\n".join(found)


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
        elif REPO not in linked.parents and linked != REPO:
            broken.append(f"{target}: outside the repository")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_benchmarks_readme_is_current_tables_then_history() -> None:
    """benchmarks/README.md: before `## History`, every section is one table of current
    figures (measured, figure, command, commit); no table cell anywhere over 200 characters."""
    text = _FENCE.sub("", (REPO / "benchmarks" / "README.md").read_text(encoding="utf-8"))

    def cells(line: str) -> list[str]:
        return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]

    long_cells = [
        f"{len(cell)} characters: {cell[:60]}..."
        for line in text.splitlines()
        if line.startswith("|")
        for cell in cells(line)
        if len(cell) > 200
    ]
    assert not long_cells, "table cells over 200 characters:\n" + "\n".join(long_cells)

    current, history, _ = text.partition("\n## History\n")
    assert history, "no '## History' heading"
    intro, *sections = re.split(r"^## ", current, flags=re.M)
    assert not any(line.startswith("|") for line in intro.splitlines()), "a table in the intro"
    assert sections, "no section of current tables before '## History'"
    for section in sections:
        lines = section.splitlines()
        title = lines[0]
        at = [i for i, line in enumerate(lines) if line.startswith("|")]
        assert at, f"{title}: no table"
        assert at == list(range(at[0], at[0] + len(at))), f"{title}: more than one table"
        header, rule, *rows = (lines[i] for i in at)
        assert cells(header) == ["measured", "figure", "command", "commit"], f"{title}: header"
        assert set(rule) <= set("|-: "), f"{title}: no header rule"
        assert rows, f"{title}: an empty table"
        for row in rows:
            row_cells = cells(row)
            assert len(row_cells) == 4, f"{title}: {row[:60]}: not 4 cells"
            assert all(row_cells), f"{title}: {row[:60]}: an empty cell"
            assert re.search(r"\b[0-9a-f]{7,40}\b", row_cells[3]), f"{title}: {row[:60]}: commit"

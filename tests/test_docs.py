"""The documentation stays readable and current: pages within their length, every relative link pointing at a file
(and heading) that exists, and no line anywhere in the repository that dates itself by stretches of work or tells its
history by this project's issue numbers (history lives in git and CHANGELOG.md; upstream bugs are cited with their
project's name, "DeepSpeed #8061")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if "evidence" not in p.relative_to(ROOT).parts]

DATED = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth"
                   r"|twent[a-z-]*|thirt[a-z-]*|[0-9]+(st|nd|rd|th))[- ]session|\bsession [0-9]+|\bwork[- ]sessions?\b"
                   r"|\bissues? [0-9]+|\bissue[0-9]+", re.I)
UPSTREAM = ("DeepSpeed ", "Megatron-LM ", "PyTorch ", "deepspeed")  # what may stand before an upstream number


def test_readme_and_pages_keep_their_length():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150
    long = {str(p.relative_to(ROOT)): n for p in PAGES if p.name != "README.md"
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^#+ (.+)$", line):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def _tracked_text_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in names.decode().split("\0"):
        if name and not name.startswith("docs/evidence/"):  # program output kept verbatim
            path = ROOT / name
            if path.is_file() and path.suffix not in (".png", ".whl", ".gz"):
                files.append(path)
    return files


def test_nothing_dates_itself_by_work_sessions_or_cites_this_projects_issues():
    found = []
    for path in _tracked_text_files():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(lines, 1):
            bare = [m for m in re.finditer(r"(?<![\w/])#\d+\b", line)
                    if not line[:m.start()].endswith(UPSTREAM) and "still alive at" not in line]
            if DATED.search(line) or bare:
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert found == []


def test_each_number_the_readme_links_to_the_validation_page_is_the_page_s():
    """The README's headline numbers ([1.14×](docs/validation.md#what-it-costs)) are the page's own: a number that
    moved on the page and not in the README fails here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    page = (ROOT / "docs" / "validation.md").read_text(encoding="utf-8")
    linked = re.findall(r"\[([^\]]*\d[^\]]*)\]\(docs/validation\.md[#)]", readme)
    assert len(linked) >= 10, linked
    numbers = {text: re.search(r"\d+(?:\.\d+)?(?:×|/\d+)?", text).group(0) for text in linked}
    assert {text: n for text, n in numbers.items() if n not in page} == {}


def test_every_kept_evidence_file_is_cited_by_a_page():
    """docs/evidence/ keeps only what a page cites (the file itself, or its folder)."""
    evidence = ROOT / "docs" / "evidence"
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    uncited = []
    for path in sorted(p for p in evidence.rglob("*") if p.is_file()):
        named = path.relative_to(ROOT / "docs")
        folders = [f"{p}/" for p in named.parents if p.name and p != Path("evidence")]
        if not any(str(part) in text for part in (named, *folders)):
            uncited.append(str(named))
    assert uncited == []

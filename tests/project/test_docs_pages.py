"""The pages a person reads: short enough to read, and their figures generated, not typed.

- The README is read in five minutes (<= 1,000 words), every page of docs/ is a few thousand words, and
  no line of prose on a page (benchmarks/*.md and benchmarks/*/README.md too) is longer than 400 characters.
- A figure a generated benchmark table shows (docs/hooks/benchmarks.py) is not typed into a page's prose:
  one fact, one value, generated from the JSON; a page points to the table instead.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.project.test_docs import PAGES, ROOT, _hook

README_MAX_WORDS = 1000  # a newcomer reads it in five minutes
PAGE_MAX_WORDS = 4000  # a page by topic
PROSE_LINE_MAX_CHARS = 400
FENCED = re.compile(r"^```.*?^```$", re.M | re.S)


def _words(page: Path) -> int:
    """`wc -w` of the markdown source."""
    return len(page.read_text().split())


def _long_lines(page: Path) -> list[str]:
    """The lines outside fenced code longer than PROSE_LINE_MAX_CHARS, as `file:line (length)`."""
    text = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    return [
        f"{page.relative_to(ROOT)}:{n} ({len(line)} characters)"
        for n, line in enumerate(text.splitlines(), 1)
        if len(line) > PROSE_LINE_MAX_CHARS
    ]


def test_the_readme_is_read_in_five_minutes():
    assert _words(ROOT / "README.md") <= README_MAX_WORDS, f"README.md: {_words(ROOT / 'README.md')} words"


def test_every_page_of_the_docs_is_a_few_thousand_words():
    pages = sorted((ROOT / "docs").glob("*.md"))
    too_long = {str(p.relative_to(ROOT)): _words(p) for p in pages if _words(p) > PAGE_MAX_WORDS}
    assert len(pages) > 20 and not too_long, f"pages over {PAGE_MAX_WORDS} words (split them by topic): {too_long}"


BENCHMARK_PAGES = [*sorted((ROOT / "benchmarks").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*/README.md"))]


def test_no_line_of_prose_is_longer_than_a_paragraph():
    long_lines = [line for page in [*PAGES, *BENCHMARK_PAGES] for line in _long_lines(page)]
    assert not long_lines, f"lines over {PROSE_LINE_MAX_CHARS} characters (wrap or shorten them): {long_lines}"


# ---- figures: one fact, one value, generated --------------------------------------------------------------

MEDIAN = re.compile(r"(?<![\d.])(\d+\.\d{3,4}) \[")  # a generated table's median, before its [range]
TYPED_MEDIAN = re.compile(r"(?<![\d.])\d+\.\d{3,4}(?!\d)")


def _generated_figures() -> dict[str, str]:
    """figure -> the generated table that shows it: every median the hook's tables print (an efficiency, a ratio
    to compute-only), and the 10 Mbit/s tuner's megabytes per round as a sentence writes them. Not the tables of
    replicas of different speeds: hundreds of per-replica ratios, where an unrelated figure matches by chance."""
    hook = _hook()
    tables = {name: table for name, table in hook.TABLES.items() if not name.startswith("heterogeneous")}
    figures = {m: name for name, table in tables.items() for m in MEDIAN.findall(table())}
    tuners = hook._load("throughput/throughput_P4_10mbit_wire_capped.json")["cells"][0]["tuners"].values()
    for megabytes in (t["comm"]["bytes_sent"] / 1e6 for t in tuners):
        figures.update({f"{megabytes:.1f} MB": "wire_tuner", f"{megabytes:.2f} MB": "wire_tuner"})
    return figures


def _typed(line: str, figures: dict[str, str]) -> list[str]:
    megabytes = [f for f in figures if f.endswith(" MB") and f in line]
    return [f for f in TYPED_MEDIAN.findall(line) if f in figures] + megabytes


def test_no_page_types_a_figure_that_a_generated_table_shows():
    figures, readme_table = _generated_figures(), _hook().readme_results()
    typed = []
    for page in PAGES:
        text = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text().replace(readme_table, ""))
        for n, line in enumerate(text.splitlines(), 1):
            typed += [f"{page.relative_to(ROOT)}:{n}: {f} ({figures[f]})" for f in _typed(line, figures)]
    assert len(figures) > 20 and not typed, f"figures typed by hand; point to the generated table instead: {typed}"

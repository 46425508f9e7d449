#!/usr/bin/env python3
"""Render docs/validation.md's table rows from a results file of `pytest -m gpu tests/gpu` (tests/gpu/conftest.py
writes it): one markdown row per validation row, with the page's columns (#, claim, result, hardware and torch, date,
re-run). The claims come from the tests themselves (their modules' CLAIMS), so the page cannot drift from them.

    python scripts/render_validation.py RESULTS.json [RESULTS.json ...] [--row N ...]

Several files (the GPU rows run in slices, or on several hosts at once) render together: each row from the last file
given that has it, with that file's machine and date.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def _gpu(machine: dict, count: int) -> str:
    name = machine.get("gpu_name") or ""
    short = re.search(r"\b[A-Z]\d{2,4}\w*\b", name)
    short = short.group(0) if short else (name or "CPU")
    if not count or not machine.get("gpu_count"):
        return "CPU"
    return short if count == 1 else f"{count}×{short}"


def _value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "/".join(_value(v) for v in value)
    return str(value)


_VERSIONS = ("deepspeed", "megatron-core")


def _result(items: list[dict]) -> str:
    outcomes = [item["outcome"] for item in items]
    name = lambda item: item["nodeid"].rsplit("::", 1)[-1]
    if "failed" in outcomes:
        failed = [item for item in items if item["outcome"] == "failed"]
        return "**failed**: " + "; ".join(f"`{name(i)}`: {i['reason']}" for i in failed)
    ran = [item for item in items if item["outcome"] == "passed"]
    if not ran:
        return "skipped: " + "; ".join(sorted({i["reason"] for i in items}))
    text = "**passed**" if len(ran) == len(items) else f"**passed** ({len(ran)} of {len(items)} items; the rest " \
        f"skipped: {'; '.join(sorted({i['reason'] for i in items if i['outcome'] == 'skipped'}))})"
    numbers = []
    for item in ran:
        shown = {k: v for k, v in item["numbers"].items() if k not in _VERSIONS}
        if shown:
            numbers.append((f"`{name(item)}`: " if len(ran) > 1 else "")
                           + ", ".join(f"{k} {_value(v)}" for k, v in shown.items()))
    return (text + (": " + "; ".join(numbers) if numbers else "")).replace("|", "\\|")  # a table cell's pipes


def _hardware(machine: dict, items: list[dict]) -> str:
    ran = [i for i in items if i["outcome"] != "skipped"] or items
    text = f"{_gpu(machine, max(i.get('gpus', 0) for i in ran))}, {machine.get('torch')}"
    frameworks = {}
    for item in ran:
        for key in _VERSIONS:
            if key in item["numbers"]:
                frameworks.setdefault(key, set()).add(str(item["numbers"][key]))
    for key, versions in frameworks.items():
        text += f"; {'DeepSpeed' if key == 'deepspeed' else key} {' and '.join(sorted(versions))}"
    return text


def rows(results: list[dict], only: list[int] | None = None) -> list[str]:
    """The table's rows; a row that several results files hold comes from the last of them."""
    by_row: dict[int, tuple[dict, list[dict]]] = {}
    for data in results:
        mine: dict[int, list[dict]] = {}
        for item in data["items"]:
            for row in item["rows"]:
                mine.setdefault(int(row), []).append(item)
        by_row.update({row: (data["machine"], items) for row, items in mine.items()})
    out = []
    for row in sorted(by_row):
        if only and row not in only:
            continue
        machine, items = by_row[row]
        claim = next((i["claims"][str(row)] for i in items if str(row) in i.get("claims", {})), "(no claim recorded)")
        out.append(f"| {row} | {claim} | {_result(items)} | {_hardware(machine, items)} | {machine.get('date')} | "
                   f"`pytest -m gpu tests/gpu --validates {row}` |")
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="render_validation.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results files of `pytest -m gpu tests/gpu` (gpu-results.json); "
                        "a row in several comes from the last")
    parser.add_argument("--row", type=int, action="append", help="render only row N (repeatable)")
    args = parser.parse_args(argv)
    results = []
    for path in args.results:
        try:
            with open(path, encoding="utf-8") as f:
                results.append(json.load(f))
            rows(results[-1:])
        except OSError as exc:
            print(f"render_validation.py: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            print(f"render_validation.py: {path} is not a results file of tests/gpu ({exc!r})", file=sys.stderr)
            return 2
    table = rows(results, args.row)
    print("| # | claim | result | hardware, torch | date | re-run |")
    print("|---|---|---|---|---|---|")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

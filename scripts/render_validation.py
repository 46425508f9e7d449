#!/usr/bin/env python3
"""Render docs/validation.md's table rows from a results file of `pytest -m gpu tests/gpu` (tests/gpu/conftest.py
writes it): one markdown row per validation row, with the page's columns (#, claim, result, hardware and torch, date,
re-run). The claims come from the tests themselves (their modules' CLAIMS), so the page cannot drift from them.

    python scripts/render_validation.py RESULTS.json [RESULTS.json ...] [--row N ...]

Several files (the GPU rows run in slices, or on several hosts at once) render together: a row's items each from the
last file that ran it (an item another file only skipped, say for want of GPUs, does not replace one that ran), its
hardware and date those of the files its items came from.
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
    return "; ".join(str(value).splitlines())  # a table cell is one line


_VERSIONS = ("deepspeed", "megatron-core")


def _short(text: str) -> str:
    """A recorded line without the host's install folders: `deepspeed/comm/torch.py:290`, not its full path."""
    return re.sub(r"(?:/[\w.+-]+)+/(?:site-packages|dist-packages|streamrace-sites/[\w.+-]+)/", "", text)


def _numbers(item: dict, leave: dict | None = None) -> str:
    """The item's numbers, less the versions (the hardware column's) and those in `leave` (said once for the row)."""
    shown = {k: v for k, v in item["numbers"].items()
             if k not in _VERSIONS and v not in (None, "", [], {}) and (leave or {}).get(k, object()) != v}
    return _short(", ".join(f"{k} {_value(v)}" for k, v in shown.items()))


def _said(item: dict, form: str, leave: dict | None = None) -> str:
    """The item's numbers (less `leave`) in `form`, or nothing where it has none."""
    numbers = _numbers(item, leave)
    return form.format(numbers) if numbers else ""


def _result(items: list[dict]) -> str:
    tests = {item["nodeid"].split("[", 1)[0] for item in items}
    # the items of one parametrized test by their parameters (`zero_overlap`), others by their test's name
    def name(item: dict) -> str:
        test = item["nodeid"].rsplit("::", 1)[-1]
        return test.split("[", 1)[1][:-1] if len(tests) == 1 and "[" in test else test
    failed = [item for item in items if item["outcome"] in ("failed", "unfinished")]  # unfinished: interrupted
    ran = [item for item in items if item["outcome"] == "passed"]
    skipped = sorted({i["reason"] for i in items if i["outcome"] == "skipped"})
    if failed:
        word = "**failed**" if any(i["outcome"] == "failed" for i in failed) else "**did not finish**"
        text = f"{word}: " + "; ".join(f"`{name(i)}`: {_short(i['reason'])}" + _said(i, " ({})") for i in failed)
        if ran:
            text += "; passed: " + "; ".join(f"`{name(i)}`" + _said(i, ": {}") for i in ran)
        return text.replace("|", "\\|")  # a table cell's pipes
    if not ran:
        return "skipped: " + "; ".join(skipped)
    text = "**passed**" if len(ran) == len(items) else f"**passed** ({len(ran)} of {len(items)} items; the rest " \
        f"skipped: {'; '.join(skipped)})"
    if len(ran) == 1:
        numbers = [own] if (own := _numbers(ran[0])) else []
    else:  # a number every item recorded alike (the runs per variant, the tests' source) is said once, first
        shared = {k: v for k, v in ran[0]["numbers"].items() if all(i["numbers"].get(k) == v for i in ran[1:])}
        numbers = [once] if (once := _numbers({"numbers": shared})) else []
        numbers += [f"`{name(i)}`" + _said(i, ": {}", shared) for i in ran if shared or _numbers(i)]
    return (text + (": " + "; ".join(numbers) if numbers else "")).replace("|", "\\|")


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
    """The table's rows: each row's items, each from the last file that ran it; its claim as the last file that ran
    one of its items states it (a claim that grew with a new item, run alone, is the row's claim from then on)."""
    by_row: dict[int, dict[str, tuple[dict, dict]]] = {}
    claims: dict[int, str] = {}
    for data in results:
        for item in data["items"]:
            for row in item["rows"]:
                mine = by_row.setdefault(int(row), {})
                before = mine.get(item["nodeid"])
                if before is None or item["outcome"] != "skipped" or before[1]["outcome"] == "skipped":
                    mine[item["nodeid"]] = (data["machine"], item)
                if str(row) in item.get("claims", {}) and (item["outcome"] != "skipped" or int(row) not in claims):
                    claims[int(row)] = item["claims"][str(row)]
    out = []
    for row in sorted(by_row):
        if only and row not in only:
            continue
        pairs = [by_row[row][nodeid] for nodeid in sorted(by_row[row])]
        items = [item for _, item in pairs]
        ran = [machine for machine, item in pairs if item["outcome"] != "skipped"] or [m for m, _ in pairs]
        machine = max(ran, key=lambda m: (m.get("gpu_count") or 0, str(m.get("date"))))
        dates = " and ".join(sorted({str(m.get("date")) for m in ran}))
        claim = claims.get(row, "(no claim recorded)")
        out.append(f"| {row} | {claim} | {_result(items)} | {_hardware(machine, items)} | {dates} | "
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

"""Table of the race corpus's verdicts: expected, ours (pytest --streamrace junit XML), PyTorch's sanitizer's
(junit XML of the same file run under TORCH_CUDA_SANITIZER=1 without --streamrace).

    python scripts/device/corpus_table.py ours.xml [sanitizer.xml]
"""

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "corpus" / "corpus_cases.py"


def expected() -> dict[str, str]:
    source = CORPUS.read_text()
    return {name: verdict for verdict, name in re.findall(r"^@(race|clean)\ndef (test_\w+)", source, re.M)}


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None:
            result[case.get("name")] = ("skipped", "")
        elif problem is None:
            result[case.get("name")] = ("passed", "")
        else:
            result[case.get("name")] = ("failed", (problem.get("message") or "")[:60])
    return result


def main(ours_xml: str, sanitizer_xml: str | None = None) -> int:
    want, ours = expected(), outcomes(ours_xml)
    theirs = outcomes(sanitizer_xml) if sanitizer_xml else None
    flip = {"race": "clean", "clean": "race"}
    print("| case | expected | pytest --streamrace (cuda) |" + (" TORCH_CUDA_SANITIZER=1 |" if theirs else ""))
    print("|---|---|---|" + ("---|" if theirs else ""))
    right = {"ours": 0, "sanitizer": 0}
    for name, verdict in want.items():
        outcome, _ = ours.get(name, ("missing", ""))
        mine = verdict if outcome == "passed" else (flip[verdict] if outcome == "failed" else outcome)
        right["ours"] += mine == verdict
        if theirs is None:
            print(f"| {name[5:]} | {verdict} | {mine} |")
            continue
        outcome, message = theirs.get(name, ("missing", ""))
        if outcome == "failed":
            san = "race" if ("CUDASanitizer" in message or "data race" in message.lower()) else f"error: {message}"
        else:
            san = "clean" if outcome == "passed" else outcome
        right["sanitizer"] += san == verdict
        print(f"| {name[5:]} | {verdict} | {mine} | {san} |")
    theirs_right = f", sanitizer {right['sanitizer']}/{len(want)}" if theirs else ""
    print(f"\nright verdicts: ours {right['ours']}/{len(want)}{theirs_right}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))

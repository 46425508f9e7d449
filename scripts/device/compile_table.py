"""The table closing scripts/device/compile.sh: per compiled case, its racy and clean twins' outcomes under the cuda
backend and the ops whose writes raced.

    python scripts/device/compile_table.py ours.xml races.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET


def main(junit: str, races_json: str) -> int:
    cases: dict = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        name = tc.get("name")  # test_racy[functional]
        if "[" not in name:
            continue
        kind, case = name.split("[")[0].replace("test_", ""), name.split("[")[1].rstrip("]")
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        outcome = "skip" if tc.find("skipped") is not None else ("FAIL" if bad is not None else "ok")
        cases.setdefault(case, {})[kind] = outcome
        if bad is not None:
            cases[case][kind + " why"] = (bad.get("message") or "")[:100].replace("\n", " ")
    try:
        with open(races_json, encoding="utf-8") as f:
            races = json.load(f)["races"]
    except (OSError, ValueError, KeyError):
        races = []
    writers: dict = {}
    for race in races:
        case = race["test"].split("[")[-1].rstrip("]")
        writers.setdefault(case, set()).add(race["earlier"]["op"])
    print("| case | racy twin | clean twin | racing earlier ops |")
    print("|---|---|---|---|")
    for case, got in cases.items():
        ops = ", ".join(sorted(writers.get(case, ())))[:90]
        print(f"| {case} | {got.get('racy', '-')} | {got.get('clean', '-')} | {ops} |")
        for key in ("racy why", "clean why"):
            if key in got:
                print(f"|   {key}: {got[key]} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

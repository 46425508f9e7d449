"""The collective verdict of a torchrun session: each phase's outcome from every rank's summary of it.

All ranks agree → the local report stands; any rank failed → the phase fails on every rank and the report shows each
failing rank's own traceback under "rank N"; outcomes differ otherwise (e.g. a skip on some ranks) → the phase fails
naming each rank's outcome and skip reason. Exit codes therefore agree across ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


class RankFailures:
    """The longrepr of a phase that failed collectively: each part is a titled traceback (object or text)."""

    def __init__(self, parts: list[tuple[str, object]], crash: str):
        self.parts = parts
        self.reprcrash = SimpleNamespace(message=crash, path="", lineno=0)

    def toterminal(self, tw) -> None:
        for title, body in self.parts:
            tw.sep("-", title)
            if hasattr(body, "toterminal"):
                body.toterminal(tw)
            else:
                tw.line(str(body).rstrip("\n"))

    def __str__(self) -> str:
        from _pytest._io import TerminalWriter  # the public API offers no string rendering of a longrepr
        import io

        out = io.StringIO()
        self.toterminal(TerminalWriter(out))
        return out.getvalue()


def summarize(report: pytest.TestReport) -> dict:
    """What a rank tells the others about one phase: its outcome label, skip/xfail reason, failure text."""
    xfail = hasattr(report, "wasxfail")
    label = report.outcome
    if xfail and not report.failed:
        label = "xpassed" if report.passed else "xfailed"
    reason = report.wasxfail if xfail else ""
    if report.skipped and not xfail and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
    crash = ""
    if report.failed:
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or report.longreprtext[-200:]
    return {"label": label, "reason": reason, "text": report.longreprtext if report.failed else "", "crash": crash}


def ranks_text(ranks) -> str:
    """'rank 3' or 'ranks 0, 2'."""
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def disagreement(local: pytest.TestReport, rank: int, phases: dict[int, dict | None]) -> RankFailures | None:
    """The collective failure of one phase, given every live rank's summary of it; None when the ranks agree."""
    labels = {r: (p["label"] if p else "not run") for r, p in phases.items()}
    if len(set(labels.values())) == 1 and "failed" not in labels.values():
        return None
    parts: list[tuple[str, object]] = []
    crash = ""
    by_text: dict[str, list[int]] = {}
    for r in sorted(r for r, lab in labels.items() if lab == "failed"):
        text = local.longreprtext if r == rank else phases[r]["text"]
        by_text.setdefault(text, []).append(r)
    for text, ranks in by_text.items():
        parts.append((ranks_text(ranks), local.longrepr if rank in ranks else text))
        crash = crash or f"{ranks_text(ranks)}: {phases[ranks[0]]['crash']}"
    # Besides failures, ranks that merely passed say nothing; any other outcome (a skip, an xfail) is listed.
    others = {r: lab for r, lab in labels.items() if lab != "failed" and (lab != "passed" or not by_text)}
    if len(set(labels.values())) > 1 and others:
        lines = []
        for lab in sorted(set(others.values())):
            ranks = [r for r in sorted(others) if others[r] == lab]
            reasons = {phases[r]["reason"] for r in ranks if phases[r] and phases[r]["reason"]}
            lines.append(f"{lab} on {ranks_text(ranks)}" + (": " + "; ".join(sorted(reasons)) if reasons else ""))
        parts.append(("outcomes differ across ranks", "\n".join(lines)))
        crash = crash or "outcomes differ across ranks: " + "; ".join(lines)
    return RankFailures(parts, crash)


def fail(report: pytest.TestReport, failure: RankFailures) -> None:
    """Turn a local report into the collective failure."""
    if isinstance(report.longrepr, RankFailures) and report.failed:
        report.longrepr.parts.extend(failure.parts)
        return
    report.outcome = "failed"
    report.longrepr = failure
    if hasattr(report, "wasxfail"):
        del report.wasxfail

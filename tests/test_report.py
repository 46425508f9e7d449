"""Race reports: the failure text, the JSON schema and its round trip, the Chrome trace — from real detector runs."""

import json
import os

import pytest

from pytest_streamrace.races import record as report
from pytest_streamrace.races import trace
from pytest_streamrace.detector.hb import FREE, RAW, WAR, WAW, HappensBefore, Site, TensorInfo

BUCKET = TensorInfo((1024,), "torch.float32", "ipg bucket")
SLICE = TensorInfo((512,), "torch.float32", "ipg bucket")
CWD = os.getcwd()


def frames(*lines, file="stage_1_and_2.py"):
    return tuple((f"{CWD}/{file}", line, f"fn{line}") for line in lines)


def bucket_run(steps=3, trace_ops=False):
    """A double-buffer bug: the reduction reads on the comm stream, the next copy writes on a side stream."""
    hb = HappensBefore(trace=trace_ops)
    hb.add_stream("comm", "communication stream of all_reduce")
    hb.add_stream("side", "stream created at test_x.py:12")
    hb.alloc("bucket", 4096, "side", Site("aten::empty", frames(88, file="engine.py")), BUCKET)
    for _ in range(steps):
        op = hb.launch("comm", Site("aten::div_", frames(1234, 1100, 900, 800)))
        hb.access(op, "bucket", 0, 4096, False, BUCKET)
        op = hb.launch("side", Site("aten::copy_", frames(1020)))
        hb.access(op, "bucket", 0, 2048, True, SLICE)
    return hb


def race_of(kind):
    hb = HappensBefore()
    hb.add_stream("a", "default stream")
    hb.add_stream("b", "stream created at test_x.py:12")
    hb.alloc("t", 64, "a", Site("aten::empty", frames(5, file="model.py")), TensorInfo((4, 4), "torch.float32"))
    t = TensorInfo((4, 4), "torch.float32")
    first_write = kind in (RAW, WAW)
    first_stream = "b" if kind == FREE else "a"  # a free races with use on a stream other than the allocation's
    hb.access(hb.launch(first_stream, Site("aten::mul_", frames(10, 11))), "t", 0, 64, first_write, t)
    if kind == FREE:
        hb.free("t", Site("free", frames(30)))
        (race,) = hb.alloc("next", 64, "a", Site("aten::empty", frames(31)))  # the block may be reused here
    else:
        (race,) = hb.access(hb.launch("b", Site("aten::add_", frames(20))), "t", 0, 64, kind != RAW, t)
    return race, hb.stream_name


# text


def test_text_names_kind_tensor_allocation_both_accesses_and_count():
    hb = bucket_run()
    war = next(r for r in hb.races if r.kind == WAR)
    text = report.format_race(war, hb.stream_name)
    lines = text.splitlines()
    assert lines[0] == ("stream race: write-after-read on tensor 'ipg bucket' float32[512] "
                        "(allocated at engine.py:88)")
    assert lines[1].split()[:4] == ["earlier", "read", "aten::div_", "on"]
    assert "on communication stream of all_reduce" in lines[1] and "at stage_1_and_2.py:1234 (fn1234)" in lines[1]
    assert "[tensor 'ipg bucket' float32[1024]]" in lines[1]  # the earlier access touched another view
    assert lines[2].split() == ["from", "stage_1_and_2.py:1100", "(fn1100)"]
    assert lines[3].split() == ["from", "stage_1_and_2.py:900", "(fn900)"]
    assert "stage_1_and_2.py:800" not in text  # frames beyond FRAMES_SHOWN are left out
    assert lines[4].split()[:4] == ["later", "write", "aten::copy_", "on"]
    assert "on stream created at test_x.py:12" in lines[4] and lines[4].endswith("at stage_1_and_2.py:1020 (fn1020)")
    hint = " ".join(text.split())
    assert ("make 'stream created at test_x.py:12' wait for 'communication stream of all_reduce' "
            "(stream.wait_stream / event.wait, or work.wait() on an async collective's work) before this write") in hint
    assert lines[-1] == "  (seen 3 times)"


def test_count_is_shown_only_when_seen_more_than_once():
    race, names = race_of(RAW)
    assert "seen" not in report.format_race(race, names)


@pytest.mark.parametrize("kind, hint", [
    (RAW, "make 'stream created at test_x.py:12' wait for 'default stream' (stream.wait_stream / event.wait) "
          "before this read"),
    (WAR, "make 'stream created at test_x.py:12' wait for 'default stream' (stream.wait_stream / event.wait) "
          "before this write"),
    (WAW, "make 'stream created at test_x.py:12' wait for 'default stream' (stream.wait_stream / event.wait) "
          "before this write"),
])
def test_each_kind_gets_its_hint(kind, hint):
    race, names = race_of(kind)
    text = report.format_race(race, names)
    assert text.startswith(f"stream race: {kind} on tensor float32[4, 4] (allocated at model.py:5)")
    assert hint in " ".join(text.split())
    assert "work.wait()" not in text  # no collective involved


def test_free_while_in_use_suggests_record_stream_or_wait():
    hb = HappensBefore()
    hb.add_stream("a", "default stream")
    hb.add_stream("b", "stream created at test_x.py:12")
    hb.alloc("t", 64, "a", Site("aten::empty", frames(5, file="model.py")), TensorInfo((16,), "float32", "x"))
    hb.access(hb.launch("b", Site("aten::sum", frames(20))), "t", 0, 64, False, TensorInfo((16,), "float32", "x"))
    hb.free("t", Site("free", frames(30)))
    (race,) = hb.alloc("next", 64, "a", Site("aten::empty", frames(31)))
    text = report.format_race(race, hb.stream_name)
    lines = text.splitlines()
    assert lines[0] == "stream race: free-while-in-use on tensor 'x' float32[16] (allocated at model.py:5)"
    assert lines[1].split()[:3] == ["earlier", "read", "aten::sum"]
    assert lines[2].split()[:2] == ["later", "free"] and "on default stream" in lines[2]
    hint = " ".join(text.split())
    assert "freed while 'stream created at test_x.py:12' may still read it" in hint
    assert "tensor.record_stream(<stream created at test_x.py:12>)" in hint
    assert "make 'default stream' wait for 'stream created at test_x.py:12'" in hint


def test_a_free_at_the_end_of_the_test_says_so(pytester):
    """The test's last reference goes away as it returns (no line of the test is on the stack): the free is named
    as the end of the test, not '<unknown>'. The fixture's teardown then allocates on the allocation stream."""
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.fixture
        def side():
            s = torch.cuda.Stream()
            yield s
            torch.zeros(64)  # reuse

        def test_dropped_while_in_use(side):
            x = torch.ones(64)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.mul_(2)
        """)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*stream race: free-while-in-use on tensor float32[[]64[]]*",
        "*earlier*write*aten::mul_*at test_a_free_at_the_end_of_the_test_says_so.py:*",
        "*later*free*on default stream*at the end of the test (its last reference went away outside the test's "
        "code)"])
    assert "<unknown>" not in result.stdout.str()


def test_a_backward_access_with_no_line_of_its_own_names_the_forward_op(pytester):
    """The backward runs from a finalizer (no line of the test on the stack, as on a GPU's engine threads): its access
    is named after the node and the forward op that created it, at the forward's line, not '<unknown>'."""
    pytester.makepyfile(
        """
        import torch

        def test_backward_in_teardown(request):
            x = torch.ones(4)
            w = torch.ones(4, requires_grad=True)
            side = torch.cuda.Stream()
            other = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            other.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                y = (w * x).sum()
            with torch.cuda.stream(other):
                x.data.add_(1)  # unordered with the backward, which reads x
            request.addfinalizer(y.backward)
        """)
    result = pytester.runpytest_subprocess("--streamrace", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, errors=1)  # the forward's read in the call, the backward's in the teardown
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_backward_in_teardown*",
        "stream race: read-after-write on tensor float32[[]4[]]*",
        "  earlier  write  aten::add_  on stream created at *:7  at *:13 (test_backward_in_teardown)",
        "  later    read   aten::mul   on stream created at *:6  at *:11 (backward of MulBackward0, created by aten::mul "
        "in test_backward_in_teardown)"])
    assert "<unknown>" not in result.stdout.str()


def test_races_merged_across_ranks_grouped_and_labelled():
    hb0, hb1 = bucket_run(steps=2), bucket_run(steps=3)
    one_only = next(r for r in hb1.races if r.kind == RAW)
    shared = next(r for r in hb0.races if r.kind == WAR)
    ranked = [(0, shared), (1, next(r for r in hb1.races if r.kind == WAR)), (1, one_only)]
    text = report.format_races(ranked, hb0.stream_name)
    assert text.splitlines()[0].startswith("2 stream races")
    blocks = text.split("\n\n")[1:]
    assert blocks[0].startswith("stream race on ranks 0, 1: write-after-read")
    assert "(seen 5 times)" in blocks[0]  # 2 on rank 0 + 3 on rank 1
    assert blocks[1].startswith("stream race on rank 1: read-after-write")


def test_single_process_races_carry_no_rank_label():
    hb = bucket_run()
    text = report.format_races([(None, r) for r in hb.races], hb.stream_name)
    assert "rank" not in text and text.count("stream race: ") == len(hb.races) == 2
    assert report.format_races([]) == "no stream races"


def test_short_path():
    assert report.short_path(f"{CWD}/tests/test_x.py") == "tests/test_x.py"
    assert report.short_path("/venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py") == \
        "deepspeed/runtime/engine.py"
    assert report.short_path("/elsewhere/x.py") == "/elsewhere/x.py"
    assert report.short_path("<string>") == "<string>"


# JSON


def test_json_schema():
    hb = bucket_run()
    doc = json.loads(json.dumps(report.document([report.from_race(r, hb.stream_name, 1) for r in hb.races])))
    assert doc["version"] == report.SCHEMA_VERSION
    war = next(r for r in doc["races"] if r["kind"] == WAR)
    assert war["rank"] == 1 and war["count"] == 3
    assert war["tensor"] == {"name": "ipg bucket", "shape": [512], "dtype": "torch.float32"}
    assert war["alloc"] == {"op": "aten::empty", "frames": [{"file": f"{CWD}/engine.py", "line": 88,
                                                             "function": "fn88"}]}
    assert war["earlier"]["op"] == "aten::div_" and war["earlier"]["rw"] == "read"
    assert war["earlier"]["stream"] == "communication stream of all_reduce"
    assert [f["line"] for f in war["earlier"]["frames"]] == [1234, 1100, 900, 800]
    assert war["later"]["rw"] == "write" and war["later"]["stream"] == "stream created at test_x.py:12"
    assert (war["later"]["start"], war["later"]["end"]) == (0, 2048)


@pytest.mark.parametrize("kind", [RAW, WAR, WAW, FREE])
def test_to_dict_from_dict_round_trip_renders_the_same(kind):
    race, names = race_of(kind)
    data = json.loads(json.dumps(report.from_race(race, names, rank=3)))
    rebuilt = report.to_race(data)
    assert report.from_race(rebuilt, rank=3) == data
    assert report.format_race(rebuilt) == report.format_race(race, names)
    assert rebuilt.key() == race.key()


def test_free_is_marked_in_json():
    race, names = race_of(FREE)
    data = report.from_race(race, names)
    assert data["later"]["rw"] == "free" and data["later"]["op"] == "free" and data["rank"] is None


def test_write_and_load_json(tmp_path):
    hb = bucket_run()
    path = tmp_path / "races.json"
    report.write_document(path, [report.from_race(r, hb.stream_name, 0) for r in hb.races])
    loaded = report.load_document(json.loads(path.read_text()))
    assert [(rank, r.kind, r.count) for rank, r in loaded] == [(0, r.kind, r.count) for r in hb.races]
    assert report.format_races(loaded) == report.format_races([(0, r) for r in hb.races], hb.stream_name)


@pytest.mark.parametrize("doc", [{"version": 99, "races": []}, {"races": []}, [], {"version": 1, "races": {}}])
def test_load_document_rejects_other_shapes(doc):
    with pytest.raises(ValueError, match="not a streamrace JSON document of version 1"):
        report.load_document(doc)


def test_from_dict_rejects_malformed_records_with_one_line():
    with pytest.raises(ValueError, match=r"^not a streamrace race record: KeyError: 'earlier'$"):
        report.to_race({"kind": RAW})


# Chrome trace


def _check_trace(doc):
    """Structural rules Perfetto relies on; returns the slices and flows for further checks."""
    doc = json.loads(json.dumps(doc))
    events = doc["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    by_track = {}
    for s in slices:
        by_track.setdefault((s["pid"], s["tid"]), []).append(s)
    for track in by_track.values():
        track.sort(key=lambda s: s["ts"])
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"], "slices on one track overlap"
    names = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(by_track) <= names, "every stream track is named"
    flows = {}
    for e in (e for e in events if e["ph"] in ("s", "f")):
        assert (e["ph"], e["id"]) not in {(f["ph"], f["id"]) for f in flows.get(e["id"], [])}, "flow ids unique"
        flows.setdefault(e["id"], []).append(e)
        inside = [s for s in by_track.get((e["pid"], e["tid"]), []) if s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
        assert len(inside) == 1, "a flow end lies inside exactly one slice"
        e["slice"] = inside[0]
    for pair in flows.values():
        assert sorted(e["ph"] for e in pair) == ["f", "s"]
        (finish,) = [e for e in pair if e["ph"] == "f"]
        assert finish["bp"] == "e"
    return events, slices, flows


def test_trace_has_a_slice_per_op_named_tracks_and_a_flow_per_race():
    hb = bucket_run(trace_ops=True)
    events, slices, flows = _check_trace(trace.chrome_trace([trace.trace_events(hb.timeline, hb.races,
                                                                                 hb.stream_name, rank=2)]))
    assert len(slices) == len(hb.timeline) == 6
    meta = {(e["name"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", 0)] == {"name": "rank 2"}
    assert {a["name"] for (kind, _), a in meta.items() if kind == "thread_name"} == {
        "communication stream of all_reduce", "stream created at test_x.py:12"}
    assert len(flows) == len(hb.races) == 2
    for race in hb.races:
        (pair,) = [p for p in flows.values() if p[0]["name"] == race.kind]
        start = next(e for e in pair if e["ph"] == "s")["slice"]
        finish = next(e for e in pair if e["ph"] == "f")["slice"]
        assert (start["args"]["seq"], finish["args"]["seq"]) == (race.earlier.op.seq, race.later.op.seq)
        assert start["args"]["stream"] == hb.stream_name(race.earlier.op.stream)
        assert any(race.kind in text for text in finish["args"]["races"])
    first = next(s for s in slices if s["args"]["seq"] == 1)
    assert first["name"] == "aten::div_" and first["args"]["location"] == "stage_1_and_2.py:1234 (fn1234)"


def test_trace_of_a_free_race_and_a_clean_run():
    race_hb = HappensBefore(trace=True)
    race_hb.alloc("t", 64, "a", Site("aten::empty"), TensorInfo((16,), "float32"))
    race_hb.access(race_hb.launch("b", Site("aten::sum")), "t", 0, 64, False, TensorInfo((16,), "float32"))
    race_hb.free("t", Site("free"))
    race_hb.alloc("next", 64, "a", Site("aten::empty"))
    _, slices, flows = _check_trace(trace.chrome_trace([trace.trace_events(race_hb.timeline, race_hb.races)]))
    (pair,) = flows.values()
    assert next(e for e in pair if e["ph"] == "f")["slice"]["name"] == "free"
    clean = HappensBefore(trace=True)
    for _ in range(3):
        clean.launch("a", Site("aten::add"))
    events, slices, flows = _check_trace(trace.chrome_trace([trace.trace_events(clean.timeline, clean.races)]))
    assert len(slices) == 3 and not flows
    assert next(e for e in events if e["name"] == "process_name")["args"] == {"name": "pytest"}


def test_ranks_merge_into_one_trace_with_unique_flow_ids(tmp_path):
    parts = []
    for rank in range(3):
        hb = bucket_run(trace_ops=True)
        parts.append(json.loads(json.dumps(trace.trace_events(hb.timeline, hb.races, hb.stream_name, rank))))
    path = tmp_path / "trace.json"
    trace.write_trace(path, parts)
    events, slices, flows = _check_trace(json.loads(path.read_text()))
    assert len(flows) == 6 and {e["pid"] for e in slices} == {0, 1, 2}
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1", "rank 2"}
    for pair in flows.values():
        assert len({e["pid"] for e in pair}) == 1  # an arrow stays within its rank

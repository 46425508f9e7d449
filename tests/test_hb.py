"""The happens-before rules, each with a racy and a clean twin, on synthetic stream/storage ids (no torch).

Every test runs against both cores: hb.py and the C++ one (hb_native, where the extension builds)."""

import pytest

from pytest_streamrace.detector.hb import FREE, RAW, WAR, WAW, HappensBefore, Site, TensorInfo, happens_before


def native_core():
    """NativeHappensBefore, or a skip saying why the extension is not there."""
    from pytest_streamrace.detector import capture
    from pytest_streamrace.detector.hb_native import NativeHappensBefore

    if capture.load() is None:
        pytest.skip(f"the C++ extension is not available here: {capture.failure()}")
    return NativeHappensBefore


@pytest.fixture(autouse=True, params=["python", "native"])
def core(request, monkeypatch):
    """The tests below build `HappensBefore()`: each runs once with hb.py's class, once with the C++ core's."""
    if request.param == "native":
        monkeypatch.setitem(globals(), "HappensBefore", native_core())
    return request.param

T = TensorInfo((256,), "float32", "buf")
BUF = "buf"  # a storage key
OTHER = "other"  # another storage, allocated after a free


def site(line, op="aten::op"):
    return Site(op, (("test_x.py", line, "step"),))


def write(hb, stream, line, start=0, end=1024, storage=BUF):
    return hb.access(hb.launch(stream, site(line, "aten::copy_")), storage, start, end, True, T)


def read(hb, stream, line, start=0, end=1024, storage=BUF):
    return hb.access(hb.launch(stream, site(line, "aten::add")), storage, start, end, False, T)


def kinds(hb):
    return [r.kind for r in hb.races]


@pytest.mark.parametrize("first, second, kind", [(write, read, RAW), (read, write, WAR), (write, write, WAW)])
def test_unordered_cross_stream_conflict_races(first, second, kind):
    hb = HappensBefore()
    assert first(hb, "s1", 10) == []
    (race,) = second(hb, "s2", 20)
    assert race.kind == kind
    assert (race.earlier.op.stream, race.later.op.stream) == ("s1", "s2")
    assert race.earlier.op.site.location() == "test_x.py:10"
    assert race.later.op.site.location() == "test_x.py:20"
    assert race.earlier.tensor == T and race.count == 1


@pytest.mark.parametrize("first, second", [(write, read), (read, write), (write, write)])
def test_conflict_ordered_by_wait_stream_is_clean(first, second):
    hb = HappensBefore()
    first(hb, "s1", 10)
    hb.wait_stream("s2", "s1")
    assert second(hb, "s2", 20) == []
    assert hb.races == []


def test_two_reads_never_race():
    hb = HappensBefore()
    read(hb, "s1", 10)
    assert read(hb, "s2", 20) == []


@pytest.mark.parametrize("first, second", [(write, read), (read, write), (write, write)])
def test_same_stream_never_races(first, second):
    hb = HappensBefore()
    first(hb, "s1", 10)
    assert second(hb, "s1", 20) == []


def test_overlapping_ranges_race_disjoint_ranges_do_not():
    hb = HappensBefore()
    write(hb, "s1", 10, 0, 512)
    assert read(hb, "s2", 20, 512, 1024) == []  # adjacent, disjoint
    assert [r.kind for r in read(hb, "s2", 30, 511, 600)] == [RAW]  # one byte in common


def test_other_storage_never_races():
    hb = HappensBefore()
    write(hb, "s1", 10, storage="a")
    assert read(hb, "s2", 20, storage="b") == []


def test_event_recorded_before_the_write_does_not_order_it():
    hb = HappensBefore()
    hb.record_event("e", "s1")
    write(hb, "s1", 10)
    hb.wait_event("s2", "e")
    assert [r.kind for r in read(hb, "s2", 20)] == [RAW]


def test_event_recorded_after_the_write_orders_it():
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.record_event("e", "s1")
    hb.wait_event("s2", "e")
    assert read(hb, "s2", 20) == []


def test_wait_on_the_wrong_stream_races():
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.wait_stream("s3", "s1")  # s3 waits, but s2 reads
    assert [r.kind for r in read(hb, "s2", 20)] == [RAW]


def test_wait_only_orders_later_work():
    hb = HappensBefore()
    write(hb, "s1", 10)
    op = hb.launch("s2", site(20))
    hb.wait_stream("s2", "s1")  # too late for op
    assert [r.kind for r in hb.access(op, BUF, 0, 1024, False, T)] == [RAW]


def test_ordering_is_transitive_through_a_third_stream():
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.wait_stream("s2", "s1")
    hb.launch("s2", site(15))
    hb.record_event("e2", "s2")
    hb.wait_event("s3", "e2")
    assert read(hb, "s3", 20) == []


def test_third_stream_event_recorded_before_its_wait_does_not_order():
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.record_event("e2", "s2")  # recorded before s2 waited on s1
    hb.wait_stream("s2", "s1")
    hb.wait_event("s3", "e2")
    assert [r.kind for r in read(hb, "s3", 20)] == [RAW]


@pytest.mark.parametrize("sync", [
    lambda hb: hb.synchronize_stream("s1"),
    lambda hb: (hb.record_event("e", "s1"), hb.synchronize_event("e")),
    lambda hb: hb.synchronize_device(),
])
def test_host_sync_orders_work_launched_later_on_any_stream(sync):
    hb = HappensBefore()
    write(hb, "s1", 10)
    sync(hb)
    assert read(hb, "s2", 20) == []


@pytest.mark.parametrize("sync", [
    lambda hb: hb.synchronize_stream("s3"),  # the wrong stream
    lambda hb: (hb.record_event("e", "s1"), write(hb, "s1", 11), hb.synchronize_event("e")),  # event too early
    lambda hb: hb.synchronize_event("never recorded"),
])
def test_host_sync_on_something_else_does_not_order(sync):
    hb = HappensBefore()
    write(hb, "s1", 10)
    sync(hb)
    assert RAW in [r.kind for r in read(hb, "s2", 20)]


SYNCS = {
    "stream": lambda hb: hb.synchronize_stream("s1"),
    "event": lambda hb: (hb.record_event("e", "s1"), hb.synchronize_event("e")),
    "device": lambda hb: hb.synchronize_device(),
}
WORKER = 7  # a synthetic thread ident


def on_worker(hb, step):
    """`step(hb)` on thread WORKER, which has a host clock of its own (as a thread the session follows)."""
    with hb.acting_for(WORKER):
        hb.own_host()
        return step(hb)


@pytest.mark.parametrize("sync", SYNCS.values(), ids=SYNCS)
def test_another_threads_sync_does_not_order_this_threads_work(sync):
    hb = HappensBefore()
    write(hb, "s1", 10)
    on_worker(hb, sync)
    assert [r.kind for r in read(hb, "s2", 20)] == [RAW]


@pytest.mark.parametrize("sync", SYNCS.values(), ids=SYNCS)
def test_another_threads_sync_orders_this_thread_after_a_handoff(sync):
    hb = HappensBefore()
    write(hb, "s1", 10)
    on_worker(hb, lambda hb: (sync(hb), hb.release("queue")))
    hb.acquire("queue")
    assert read(hb, "s2", 20) == []


def test_a_handoff_carries_only_what_was_known_when_it_was_released():
    hb = HappensBefore()
    write(hb, "s1", 10)
    on_worker(hb, lambda hb: hb.release("lock"))
    on_worker(hb, lambda hb: hb.synchronize_stream("s1"))  # after the release: not carried
    hb.acquire("lock")
    assert [r.kind for r in read(hb, "s2", 20)] == [RAW]


def test_a_handoff_merges_every_release_into_it():
    hb = HappensBefore()
    write(hb, "s1", 10)
    write(hb, "s2", 11, storage=OTHER)
    on_worker(hb, lambda hb: (hb.synchronize_stream("s1"), hb.release("queue")))
    with hb.acting_for(8):
        hb.own_host()
        hb.synchronize_stream("s2")
        hb.release("queue")
    hb.acquire("queue")
    assert read(hb, "s3", 20) == [] and read(hb, "s3", 21, storage=OTHER) == []


def test_a_thread_orders_its_own_later_launches_after_its_sync():
    hb = HappensBefore()
    write(hb, "s1", 10)
    assert on_worker(hb, lambda hb: (hb.synchronize_stream("s1"), read(hb, "s2", 20))[1]) == []


def test_threads_without_a_host_of_their_own_share_the_main_one():
    hb = HappensBefore()
    write(hb, "s1", 10)
    with hb.acting_for(9):
        hb.synchronize_stream("s1")
    assert read(hb, "s2", 20) == []


def test_a_dropped_host_goes_back_to_the_shared_one():
    hb = HappensBefore()
    write(hb, "s1", 10)
    on_worker(hb, lambda hb: hb.synchronize_stream("s1"))
    with hb.acting_for(WORKER):
        hb.drop_host()
    assert [r.kind for r in read(hb, "s2", 20)] == [RAW]  # what the worker knew went with its host
    with hb.acting_for(WORKER):
        hb.synchronize_stream("s1")
    assert read(hb, "s3", 21) == []


def test_a_handoff_of_an_implicit_sync_stays_latent():
    hb = HappensBefore()
    write(hb, "s1", 10)
    on_worker(hb, lambda hb: (hb.synchronize_stream("s1", implicit=site(15, "aten::item")), hb.release("q")))
    hb.acquire("q")
    assert read(hb, "s2", 20) == []
    (latent,) = hb.latent_races
    assert latent.hidden_by.location() == "test_x.py:15"


def test_a_free_is_judged_by_the_freeing_threads_host():
    hb = HappensBefore()
    hb.alloc(BUF, 1024, "s1", site(1))
    read(hb, "s2", 10)
    on_worker(hb, lambda hb: (hb.synchronize_stream("s2"), hb.free(BUF, site(11, "free"))))
    assert hb.alloc(OTHER, 1024, "s1", site(12)) == []
    hb2 = HappensBefore()
    hb2.alloc(BUF, 1024, "s1", site(1))
    read(hb2, "s2", 10)
    on_worker(hb2, lambda hb: hb.synchronize_stream("s2"))
    hb2.free(BUF, site(11, "free"))  # on the main thread, which never synchronized
    assert [r.kind for r in hb2.alloc(OTHER, 1024, "s1", site(12))] == [FREE]


def test_host_sync_does_not_order_work_launched_before_it():
    hb = HappensBefore()
    write(hb, "s1", 10)
    op = hb.launch("s2", site(20))
    hb.synchronize_device()
    assert [r.kind for r in hb.access(op, BUF, 0, 1024, False, T)] == [RAW]


def test_waiting_on_an_unrecorded_event_is_a_no_op():
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.wait_event("s2", "never recorded")
    assert [r.kind for r in read(hb, "s2", 20)] == [RAW]
    hb.record_event("late", "s1")  # recording it later does not reach back to the earlier wait
    assert [r.kind for r in read(hb, "s2", 20)] == [] and hb.races[0].count == 2


def test_happens_before_on_ops():
    hb = HappensBefore()
    a = hb.launch("s1", site(1))
    b = hb.launch("s1", site(2))
    c = hb.launch("s2", site(3))
    hb.wait_stream("s2", "s1")
    d = hb.launch("s2", site(4))
    assert happens_before(a, b) and not happens_before(b, a)
    assert not happens_before(a, c) and happens_before(a, d) and happens_before(b, d)


# free / reuse


def test_free_while_another_stream_reads_races():
    hb = HappensBefore()
    alloc_site = Site("empty", (("engine.py", 88, "init"),))
    hb.alloc(BUF, 1024, "s1", alloc_site, T)
    write(hb, "s1", 10)
    hb.wait_stream("s2", "s1")
    read(hb, "s2", 20)
    assert hb.free(BUF, Site("free", (("test_x.py", 30, "step"),))) == []  # judged when the block may be reused
    (race,) = hb.alloc(OTHER, 512, "s1", site(31, "empty"), T)
    assert race.kind == FREE
    assert race.earlier.op.stream == "s2" and race.earlier.op.site.location() == "test_x.py:20"
    assert race.later.op.site.op == "free" and race.later.op.stream == "s1"
    assert (race.later.start, race.later.end) == (0, 1024)
    assert race.alloc_site == alloc_site


@pytest.mark.parametrize("protect", [
    lambda hb: hb.record_stream(BUF, "s2"),
    lambda hb: hb.wait_stream("s1", "s2"),
    lambda hb: hb.synchronize_stream("s2"),
    lambda hb: hb.synchronize_device(),
])
def test_free_after_record_stream_wait_or_sync_is_clean(protect):
    hb = HappensBefore()
    hb.alloc(BUF, 1024, "s1", site(1, "empty"), T)
    write(hb, "s1", 10)
    hb.wait_stream("s2", "s1")
    read(hb, "s2", 20)
    protect(hb)
    hb.free(BUF, site(30, "free"))
    assert hb.alloc(OTHER, 512, "s1", site(31, "empty"), T) == []
    assert hb.races == []


def test_free_is_clean_when_the_allocation_stream_waits_before_it_allocates_again():
    """DeepSpeed's reduction stream: its buffer is read on the default stream and freed; the reduction stream
    waits on the default stream before its next allocation, so the block cannot be reused under the read."""
    hb = HappensBefore()
    hb.alloc(BUF, 1024, "reduction", site(1, "empty"), T)
    hb.wait_stream("default", "reduction")
    read(hb, "default", 20)
    hb.free(BUF, site(30, "free"))
    hb.wait_stream("reduction", "default")
    assert hb.alloc(OTHER, 1024, "reduction", site(40, "empty"), T) == []
    assert hb.races == []


def test_free_hazard_is_judged_once():
    hb = HappensBefore()
    hb.alloc(BUF, 1024, "s1", site(1, "empty"), T)
    read(hb, "s2", 20)
    hb.free(BUF, site(30, "free"))
    assert [r.kind for r in hb.alloc(OTHER, 8, "s1", site(31, "empty"), T)] == [FREE]
    assert hb.alloc("third", 8, "s1", site(32, "empty"), T) == []
    assert len(hb.races) == 1


def test_record_stream_for_another_stream_does_not_protect():
    hb = HappensBefore()
    hb.alloc(BUF, 1024, "s1", site(1, "empty"), T)
    read(hb, "s2", 20)
    hb.record_stream(BUF, "s3")
    hb.free(BUF, site(30, "free"))
    assert [r.kind for r in hb.alloc(OTHER, 8, "s1", site(31, "empty"), T)] == [FREE]


def test_free_forgets_history():
    hb = HappensBefore()
    hb.alloc(BUF, 1024, "s1", site(1, "empty"), T)
    write(hb, "s1", 10)
    hb.synchronize_device()
    hb.free(BUF, site(30, "free"))
    assert hb.history_size(BUF) == 0
    hb.alloc(BUF, 1024, "s2", site(31, "empty"), T)  # the same block handed out again
    assert read(hb, "s2", 40) == []


# dedup and pruning


def test_same_location_pair_is_one_race_counted():
    hb = HappensBefore()
    for _ in range(2):
        write(hb, "s1", 10)
        read(hb, "s2", 20)
        hb.synchronize_device()
    (race,) = hb.races
    assert race.kind == RAW and race.count == 2


def test_new_races_are_returned_once():
    hb = HappensBefore()
    write(hb, "s1", 10)
    assert len(read(hb, "s2", 20)) == 1
    assert read(hb, "s2", 20) == []  # same pair again: counted, not new
    assert len(read(hb, "s2", 21)) == 1  # another later location: a new race
    assert [r.count for r in hb.races] == [2, 1]


def test_all_races_are_collected_not_only_the_first():
    hb = HappensBefore()
    write(hb, "s1", 10, storage="a")
    write(hb, "s1", 11, storage="b")
    read(hb, "s2", 20, storage="a")
    write(hb, "s3", 30, storage="b")
    assert sorted(kinds(hb)) == [RAW, WAW]


def test_reads_from_several_streams_each_race_with_a_later_write():
    hb = HappensBefore()
    read(hb, "s1", 10)
    read(hb, "s2", 20)
    found = write(hb, "s3", 30)
    assert sorted(r.earlier.op.stream for r in found) == ["s1", "s2"]


def test_long_loop_of_ordered_accesses_keeps_history_small():
    hb = HappensBefore()
    for step in range(500):
        write(hb, "s1", 10)
        hb.wait_stream("s2", "s1")
        read(hb, "s2", 20)
        read(hb, "s2", 21, 0, 512)
        hb.wait_stream("s1", "s2")
    assert hb.races == []
    assert hb.history_size(BUF) <= 3


def test_pruning_keeps_detection_right():
    hb = HappensBefore()
    for _ in range(100):
        write(hb, "s1", 10)
        hb.wait_stream("s2", "s1")
        read(hb, "s2", 20)
        hb.wait_stream("s1", "s2")
    assert hb.history_size(BUF) <= 2
    # the next write forgets to wait for the reader
    read(hb, "s2", 30)
    (race,) = write(hb, "s1", 40)
    assert race.kind == WAR and race.earlier.op.site.location() == "test_x.py:30"


def test_racy_access_is_not_pruned_by_an_unordered_covering_write():
    hb = HappensBefore()
    read(hb, "s1", 10)
    write(hb, "s2", 20)  # WAR with the read, which stays
    hb.wait_stream("s3", "s2")
    (race,) = write(hb, "s3", 30)  # ordered after s2's write, not after s1's read
    assert race.kind == WAR and race.earlier.op.stream == "s1"


def test_stream_names_default_and_rename():
    hb = HappensBefore()
    assert hb.stream_name(7) == "7"
    hb.launch(7, site(1))
    assert hb.stream_name(7) == "7"
    hb.add_stream(7, "default stream")
    hb.add_stream(7, "stream created at x.py:3")
    assert hb.stream_name(7) == "stream created at x.py:3"


def test_timeline_only_with_trace():
    hb = HappensBefore()
    hb.launch("s1", site(1))
    assert hb.timeline == []
    hb = HappensBefore(trace=True)
    ops = [hb.launch("s1", site(1)), hb.launch("s2", site(2))]
    assert hb.timeline == ops and [op.seq for op in ops] == [1, 2]


def test_site_location():
    assert Site("free").location() == "<unknown>"
    assert Site("x", (("a.py", 3, "f"), ("b.py", 4, "g"))).location() == "a.py:3"


def test_free_of_a_storage_allocated_before_tracking_reports_nothing():
    hb = HappensBefore()
    read(hb, "s2", 20)  # no alloc seen: which stream reuses the block is unknown
    assert hb.free(BUF, site(30, "free")) == []
    assert hb.history_size(BUF) == 0


def test_free_after_the_allocation_stream_waited_on_the_wrong_stream_races():
    hb = HappensBefore()
    hb.alloc(BUF, 1024, "s1", site(1, "empty"), T)
    read(hb, "s2", 20)
    hb.wait_stream("s1", "s3")
    hb.free(BUF, site(30, "free"))
    assert [r.kind for r in hb.alloc(OTHER, 8, "s1", site(31, "empty"), T)] == [FREE]


def test_event_objects_are_not_kept_alive():
    import gc
    import weakref

    class Event:
        pass

    hb = HappensBefore()
    write(hb, "s1", 10)
    event = Event()
    hb.record_event(event, "s1")
    hb.wait_event("s2", event)
    gone = weakref.ref(event)
    del event
    gc.collect()
    assert gone() is None
    assert read(hb, "s2", 20) == []  # the wait it gave still orders s2


def test_partly_covering_ordered_writes_trim_history():
    hb = HappensBefore()
    write(hb, "s1", 10, 0, 1024)
    write(hb, "s1", 11, 0, 512)  # covers the first half of the first write
    assert hb.history_size(BUF) == 2
    write(hb, "s1", 12, 512, 1024)  # and now the rest
    assert hb.history_size(BUF) == 2
    # detection and attribution of the remaining bytes stay right
    (race,) = read(hb, "s2", 20, 600, 700)
    assert race.earlier.op.site.location() == "test_x.py:12"


def test_trimmed_record_still_races_on_its_uncovered_bytes():
    hb = HappensBefore()
    write(hb, "s1", 10, 0, 1024)
    hb.wait_stream("s2", "s1")
    write(hb, "s2", 20, 256, 768)  # ordered after s1's write: trims it to [0, 256) and [768, 1024)
    assert read(hb, "s3", 30, 900, 1000)[0].earlier.op.site.location() == "test_x.py:10"
    assert read(hb, "s3", 31, 300, 400)[0].earlier.op.site.location() == "test_x.py:20"



def test_site_frames_may_come_lazily_and_are_named_once():
    class Captured:
        calls = 0

        def resolve(self):
            Captured.calls += 1
            return [("test_x.py", 7, "step")]

    lazy = Site("aten::add", Captured())
    assert Captured.calls == 0  # capturing costs nothing until something reads the frames
    assert lazy.location() == "test_x.py:7" and lazy.frames == (("test_x.py", 7, "step"),)
    assert Captured.calls == 1
    assert lazy == site(7, "aten::add") and hash(lazy) == hash(site(7, "aten::add"))


def test_raw_tensor_descriptions_become_tensor_info_in_races():
    hb = HappensBefore()
    hb.access(hb.launch("s1", site(10)), BUF, 0, 64, True, ((16,), "torch.float32", "x"))
    (race,) = hb.access(hb.launch("s2", site(20)), BUF, 0, 64, False, ((16,), "torch.float32", "x"))
    assert race.earlier.tensor == race.later.tensor == TensorInfo((16,), "float32", "x")


# The latent view: orderings through an implicit host sync (a value read back) do not count there.

def readback(line):
    return site(line, "aten::_local_scalar_dense")


@pytest.mark.parametrize("first, second, kind", [(write, read, RAW), (read, write, WAR), (write, write, WAW)])
def test_pair_ordered_only_by_an_implicit_sync_is_latent(first, second, kind):
    hb = HappensBefore()
    first(hb, "s1", 10)
    hb.synchronize_stream("s1", implicit=readback(15))
    assert second(hb, "s2", 20) == []
    assert hb.races == []
    (latent,) = hb.latent_races
    assert latent.kind == kind and latent.latent
    assert latent.hidden_by == readback(15)
    assert (latent.earlier.op.site.location(), latent.later.op.site.location()) == ("test_x.py:10", "test_x.py:20")


@pytest.mark.parametrize("order", ["wait_stream", "event", "synchronize", "event_synchronize", "device"])
def test_explicit_ordering_leaves_no_latent_race(order):
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.synchronize_stream("s1", implicit=readback(12))  # the read-back is there too, but not what orders the pair
    if order == "wait_stream":
        hb.wait_stream("s2", "s1")
    elif order == "event":
        hb.record_event("e", "s1")
        hb.wait_event("s2", "e")
    elif order == "synchronize":
        hb.synchronize_stream("s1")
    elif order == "event_synchronize":
        hb.record_event("e", "s1")
        hb.synchronize_event("e")
    else:
        hb.synchronize_device()
    read(hb, "s2", 20)
    assert hb.races == [] and hb.latent_races == []


def test_latent_ordering_is_carried_through_a_later_wait():
    """s2 learns s1's write only from the host's read-back; s3 waits on s2 explicitly: still latent on s3."""
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.synchronize_stream("s1", implicit=readback(11))
    read(hb, "s2", 12, storage=OTHER)  # s2's first launch after the read-back picks up the host's knowledge
    hb.wait_stream("s3", "s2")
    read(hb, "s3", 20)
    assert hb.races == []
    assert [r.later.op.site.location() for r in hb.latent_races] == ["test_x.py:20"]


def test_a_real_race_is_not_also_latent():
    hb = HappensBefore()
    write(hb, "s1", 10)
    read(hb, "s2", 20)  # before any read-back: a race
    hb.synchronize_stream("s1", implicit=readback(25))
    assert kinds(hb) == [RAW] and hb.latent_races == []


def test_views_share_clocks_until_the_first_implicit_sync():
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.synchronize_stream("s1")
    hb.record_event("e", "s1")
    hb.wait_event("s2", "e")
    op = hb.launch("s2", site(20))
    assert op.strict is op.clock  # no second view to check: one identity test per access
    write(hb, "s1", 25)
    hb.synchronize_stream("s1", implicit=readback(30))
    op = hb.launch("s3", site(40))
    assert op.strict is not op.clock


def test_latent_races_repeat_in_a_loop_as_one_report_and_history_stays_bounded():
    hb = HappensBefore()
    for step in range(50):
        hb.wait_stream("s1", "s2")  # the next write waits for the last read: no WAR
        write(hb, "s1", 10)
        hb.synchronize_stream("s1", implicit=readback(11))
        read(hb, "s2", 20)
    (latent,) = hb.latent_races
    assert latent.count == 50 and hb.races == []
    assert hb.history_size(BUF) <= 4


def test_forget_races_forgets_latent_ones():
    hb = HappensBefore()
    write(hb, "s1", 10)
    hb.synchronize_stream("s1", implicit=readback(11))
    read(hb, "s2", 20)
    hb.forget_races()
    assert hb.latent_races == []

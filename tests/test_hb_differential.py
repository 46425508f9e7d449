"""hb.py and the C++ core (hb_native) run the same random programs and must agree on everything they report.

A program (seeded) mixes launches with several accesses over overlapping byte ranges, allocations in the same op,
accesses by ops launched earlier, stream waits, events (names, ints, weakly referenced objects that die), host
syncs explicit and implicit (stream, event, device), allocs, frees and record_stream, on a few streams and storages,
each step on one of a few host threads, which own a clock of their own or share the main one and hand off what they
know through a few sync objects.
After every call the two cores must have returned the same new races; at the end the same races and latent races
(kind, both accesses, counts, hiding sync, allocation site), the same history sizes (pruning), stream counts and
timeline.
"""

import gc
import os
import random
import subprocess
import sys

import pytest

from pytest_streamrace.detector.hb import HappensBefore, Site, where


class Event:  # weakly referenceable, as virtual and CUDA events are
    pass


def native_factory():
    from pytest_streamrace.detector import capture
    from pytest_streamrace.detector.hb_native import NativeHappensBefore

    extension = capture.load()
    if extension is None:
        pytest.skip(f"the C++ extension is not available here: {capture.failure()}")
    return lambda trace: NativeHappensBefore(trace=trace, extension=extension)


def site_of(rng, op):
    if rng.random() < 0.1:
        return Site(op)  # no frames: told apart by the op
    return Site(op, (("prog.py", rng.randrange(1, 9), "step"), ("caller.py", 3, "main")))


def describe_access(access):
    op = access.op
    return (op.stream, op.epoch, op.seq, op.site.op, op.site.frames, op.clock, op.strict, access.storage,
            access.start, access.end, access.write, access.tensor)


def describe(race):
    hidden = race.hidden_by
    alloc = race.alloc_site
    return (race.kind, race.count, race.key(), describe_access(race.earlier), describe_access(race.later),
            None if alloc is None else (alloc.op, alloc.frames),
            None if hidden is None else (hidden.op, hidden.frames))


def run_program(seed: int, steps: int, make_native, trace: bool = False):
    """Run one random program on both cores in lockstep; assert they agree. Returns (races, latent) found."""
    rng = random.Random(seed)
    python, native = HappensBefore(trace=trace), make_native(trace)
    cores = (python, native)
    streams = ["s0", "s1", "s2", 7, 11][: rng.randrange(3, 6)]
    storages = [1000, 2000, 3000, "named", "other", 4000]
    events = ["e0", "e1", 42] + [Event() for _ in range(3)]
    ops = ([], [])  # ops each core launched, for accesses made later by an old op
    fresh = iter(range(10_000, 10**9, 8))  # storages allocated inside ops
    live_fresh: list = []

    def tensor():
        shape = (rng.choice([4, 16, 64]),)
        return rng.choice([(shape, "torch.float32", rng.choice([None, "w", "grad"])), (shape, "float16", None)])

    def span():
        start = rng.randrange(0, 256, 16)
        return start, start + rng.choice([0, 16, 32, 64, 128, 256])

    thread = None  # the thread each step acts for (None: the calling one, the main host's)

    def both(name, *args, **kwargs):
        results = []
        for core in cores:
            with core.acting_for(thread):
                results.append(getattr(core, name)(*args, **kwargs))
        return results

    def same_new(results, what):
        a, b = ([describe(r) for r in found] for found in results)
        assert a == b, f"seed {seed}: {what}: new races differ"

    for step in range(steps):
        thread = rng.choice([None, None, 101, 102])
        if rng.random() < 0.08:  # a host thread's own clock, and handoffs between threads
            what, key = rng.random(), rng.choice(["queue", "lock", 5])
            if what < 0.2:
                both("own_host")
            elif what < 0.3:
                both("drop_host")
            elif what < 0.65:
                both("release", key)
            else:
                both("acquire", key)
            continue
        roll = rng.random()
        stream = rng.choice(streams)
        if roll < 0.52:
            site = site_of(rng, rng.choice(["aten::add_", "aten::mm", "aten::copy_", "all_reduce"]))
            accesses = []
            for _ in range(rng.randrange(0, 4)):
                storage = rng.choice(storages + live_fresh[-3:])
                start, end = span()
                accesses.append((storage, start, end, rng.random() < 0.5, tensor()))
            allocs = []
            if rng.random() < 0.2:
                key = next(fresh)
                live_fresh.append(key)
                desc = tensor()
                allocs.append((key, 256, desc))
                accesses.append((key, 0, 256, True, desc))
            results = both("record", stream, site, accesses, allocs)
            for mine, (op, _) in zip(ops, results):
                mine.append(op)
            a, b = (op for op, _ in results)
            assert (a.stream, a.epoch, a.seq, a.clock, a.strict, a.strict is a.clock) == \
                (b.stream, b.epoch, b.seq, b.clock, b.strict, b.strict is b.clock), f"seed {seed}: step {step} op"
            same_new([r[1] for r in results], f"step {step} record")
        elif roll < 0.57 and ops[0]:
            i = rng.randrange(max(0, len(ops[0]) - 20), len(ops[0]))  # an op launched a while ago
            storage = rng.choice(storages)
            start, end = span()
            write, desc = rng.random() < 0.5, tensor()
            results = [core.access(mine[i], storage, start, end, write, desc) for core, mine in zip(cores, ops)]
            same_new(results, f"step {step} access")
        elif roll < 0.62:
            both("wait_stream", stream, rng.choice(streams))
        elif roll < 0.68:
            both("record_event", rng.choice(events), stream)
        elif roll < 0.73:
            both("wait_event", stream, rng.choice(events))
        elif roll < 0.78:
            implicit = site_of(rng, "aten::_local_scalar_dense") if rng.random() < 0.6 else None
            what = rng.random()
            if what < 0.5:
                both("synchronize_stream", stream, implicit=implicit)
            elif what < 0.8:
                both("synchronize_event", rng.choice(events), implicit=implicit)
            else:
                both("synchronize_device", implicit=implicit)
        elif roll < 0.84:
            storage = rng.choice(storages)
            results = both("alloc", storage, rng.choice([128, 256]), stream, site_of(rng, "aten::empty"),
                           rng.choice([tensor(), None]))
            same_new(results, f"step {step} alloc")
        elif roll < 0.90:
            storage = rng.choice(storages + live_fresh)
            if storage in live_fresh:
                live_fresh.remove(storage)
            results = both("free", storage, site_of(rng, "free"))
            assert results == [[], []]
        elif roll < 0.94:
            both("record_stream", rng.choice(storages + live_fresh[-3:]), stream)
        elif roll < 0.96:
            site = site_of(rng, "aten::relu")
            for mine, op in zip(ops, both("launch", stream, site)):
                mine.append(op)
        elif roll < 0.97:
            both("add_stream", stream, f"stream {stream} renamed at step {step}")
        elif roll < 0.98:
            if isinstance(events[-1], Event):
                events[-1] = rng.choice(["e0", 42])  # the last event object dies: its snapshots go with it
                gc.collect()
        elif roll < 0.9805 and step < steps // 2:
            both("forget_races")
        else:
            assert python.history_size() == native.history_size(), f"seed {seed}: step {step}: history"
        assert python.stream_count == native.stream_count
        assert python.frees_can_race == native.frees_can_race

    races = [describe(r) for r in python.races]
    assert races == [describe(r) for r in native.races], f"seed {seed}: races differ"
    latent = [describe(r) for r in python.latent_races]
    assert latent == [describe(r) for r in native.latent_races], f"seed {seed}: latent races differ"
    for storage in storages + live_fresh:
        assert python.history_size(storage) == native.history_size(storage), f"seed {seed}: history of {storage}"
        assert python.alloc_site(storage) == native.alloc_site(storage)
    assert python.history_size() == native.history_size()
    for stream in streams + ["never seen"]:
        assert python.stream_name(stream) == native.stream_name(stream)
    timeline = [(op.stream, op.epoch, op.seq, op.site.op, where(op.site), op.clock, op.strict)
                for op in python.timeline]
    assert timeline == [(op.stream, op.epoch, op.seq, op.site.op, where(op.site), op.clock, op.strict)
                        for op in native.timeline], f"seed {seed}: timeline"
    return races, latent


@pytest.mark.parametrize("seed", range(12))
def test_both_cores_agree_on_random_programs(seed):
    make_native = native_factory()
    races, latent = run_program(seed, 3000, make_native, trace=seed % 3 == 0)
    # the programs exercise what they must: races of every kind, counted repeats, latent races with their sync
    assert races and latent


def test_random_programs_cover_every_kind_and_repeats():
    make_native = native_factory()
    kinds, latent_kinds, counted, named_syncs = set(), set(), False, False
    for seed in range(100, 106):
        races, latent = run_program(seed, 3000, make_native)
        kinds |= {r[0] for r in races}
        latent_kinds |= {r[0] for r in latent}
        counted = counted or any(r[1] > 1 for r in races + latent)
        named_syncs = named_syncs or any(r[6][0] == "aten::_local_scalar_dense" for r in latent)
    assert kinds == {"read-after-write", "write-after-read", "write-after-write", "free-while-in-use"}
    assert latent_kinds == {"read-after-write", "write-after-read", "write-after-write"}
    assert counted and named_syncs


@pytest.mark.parametrize("native", ["1", "0"])
def test_detector_takes_the_native_core_unless_turned_off(native):
    if native == "1":
        native_factory()  # skips where the extension does not build
    script = "from pytest_streamrace.detector.session import Detector; print(type(Detector().hb).__name__)"
    env = {**os.environ, "STREAMRACE_NATIVE": native}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.split() == ["NativeHappensBefore" if native == "1" else "HappensBefore"], out.stderr[-2000:]


def test_both_cores_keep_the_same_bounded_record_of_implicit_syncs():
    """hb.py remembers the newest 4096 implicit syncs: a latent race whose sync is older is named after the oldest
    one kept. The C++ core must keep the same bound (its memory stays flat in a long test), hence the same name."""
    make_native = native_factory()
    hidden = []
    for hb in (HappensBefore(), make_native(False)):
        hb.access(hb.launch("s1", Site("aten::copy_", (("t.py", 1, "f"),))), "x", 0, 8, True, ((2,), "f32", None))
        for i in range(5000):
            hb.launch("s1", Site("aten::add", (("t.py", 2, "f"),)))
            hb.synchronize_stream("s1", implicit=Site("aten::item", (("t.py", 10_000 + i, "f"),)))
        hb.access(hb.launch("s2", Site("aten::mul", (("t.py", 3, "f"),))), "x", 0, 8, False, ((2,), "f32", None))
        (latent,) = hb.latent_races
        hidden.append(latent.hidden_by)
    assert hidden[0] == hidden[1] == Site("aten::item", (("t.py", 10_000 + 5000 - 4096, "f"),))


def test_native_core_state_stays_flat_over_10000_steps():
    """What the C++ core keeps (payload references: every op, access and sync it remembers holds one) stops growing
    in a long loop of allocations, accesses on two streams, events, implicit syncs, record_stream and frees."""
    hb = native_factory()(False)
    site, sync, desc = Site("aten::mm", (("a.py", 1, "f"),)), Site("aten::item", (("a.py", 2, "f"),)), ((8,), "f", None)

    def steps(n):
        for i in range(n):
            key = 10**6 + (i % 64) * 4096
            hb.alloc(key, 2048, "s1", site, desc)
            hb.record("s1", site, [(key, 0, 2048, True, desc), (5, 0, 64, False, desc)])
            hb.record("s2", site, [(key, 0, 1024, False, desc), (5, 0, 64, True, desc)])
            event = Event()
            hb.record_event(event, "s2")
            hb.wait_event("s1", event)
            if i % 2 == 0:
                hb.synchronize_stream("s2", implicit=sync)
            hb.record_stream(key, "s2")
            hb.free(key, site)

    steps(1000)
    gc.collect()
    held = (sys.getrefcount(site), sys.getrefcount(desc), hb.history_size())
    steps(10_000)
    gc.collect()
    assert (sys.getrefcount(site), sys.getrefcount(desc), hb.history_size()) == held
    assert sys.getrefcount(sync) <= 4096 + 10  # the implicit syncs remembered: hb.py's bound

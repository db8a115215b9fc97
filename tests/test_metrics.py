"""shmq.metrics: the Prometheus exposition, the collector, and the read-only helpers."""

import math
import os
import re
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shmq
from shmq import metrics as M
from shmq.errors import SpoolFormatError
from conftest import bound, join_all

SAMPLE = re.compile(r'^([a-z_]+)\{((?:[a-z_]+="(?:[^"\\]|\\.)*",?)*)\} (\S+)$')


def _parse(text):
    """``({name: (type, help)}, [(name, {label: value}, value)])``, checking the syntax."""
    meta, samples = {}, []
    lines = text.split("\n")
    assert lines[-1] == ""
    for line in lines[:-1]:
        if line.startswith("# HELP "):
            name, help_ = line[7:].split(" ", 1)
            meta.setdefault(name, [None, None])[1] = help_
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("gauge", "counter")
            meta.setdefault(name, [None, None])[0] = kind
        else:
            m = SAMPLE.match(line)
            assert m, line
            labels = dict(re.findall(r'([a-z_]+)="((?:[^"\\]|\\.)*)"', m.group(2)))
            samples.append((m.group(1), labels, float(m.group(3))))
    for name, (kind, help_) in meta.items():
        assert kind and help_, name
        assert name.endswith("_total") == (kind == "counter"), name
    return meta, samples


@pytest.fixture
def busy(make_spool):
    sp = make_spool(capacity="64KiB", name="busy")
    r = sp.reader("indexer")
    sp.reader("workers", group=True).close()
    sp.put_many([b"x" * 100] * 10)
    r.get_many(4)
    r.commit()
    yield sp
    r.close()


def test_prometheus_text_has_every_metric_with_its_value(busy):
    st_ = busy.stats()
    meta, samples = _parse(M.prometheus_text([st_]))
    names = [n for n, *_ in M.SPOOL_METRICS] + [n for n, *_ in M.READER_METRICS] + ["shmq_info"]
    assert sorted(meta) == sorted(names)
    by = {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples}
    for name, _k, _h, get in M.SPOOL_METRICS:
        assert by[(name, (("spool", busy.path),))] == pytest.approx(float(get(st_)))
    for r in st_.readers:
        key = tuple(sorted({"spool": busy.path, "reader": r.name, "kind": r.kind}.items()))
        for name, _k, _h, get in M.READER_METRICS:
            assert by[(name, key)] == pytest.approx(float(get(r)))
    assert by[("shmq_puts_total", (("spool", busy.path),))] == 10
    idx = tuple(sorted({"spool": busy.path, "reader": "indexer", "kind": "reader"}.items()))
    assert by[("shmq_reader_position", idx)] == 4 and by[("shmq_reader_lag", idx)] == 6


def test_prometheus_text_of_nothing_is_only_metadata():
    meta, samples = _parse(M.prometheus_text([]))
    assert samples == [] and "shmq_capacity_bytes" in meta


def test_prometheus_client_parses_our_text(busy):
    parser = pytest.importorskip("prometheus_client.parser")
    fams = {f.name: f for f in parser.text_string_to_metric_families(M.prometheus_text([busy.stats()]))}
    assert fams["shmq_puts"].type == "counter"  # the client strips _total from counter names
    assert fams["shmq_capacity_bytes"].samples[0].value == busy.capacity


@given(st.text(max_size=40))
def test_label_values_are_escaped(value):
    text = M._labels([("spool", value)])
    assert "\n" not in text
    inner = text[len('{spool="'):-2]
    unescaped = re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), inner)
    assert unescaped == value


@pytest.mark.parametrize("v, text", [(3, "3"), (True, "1"), (0.5, "0.5"), (float("inf"), "inf"),
                                     (float("-inf"), "-inf")])
def test_numbers(v, text):
    assert M._num(v) == text
    assert math.isnan(float(M._num(float("nan"))))


def test_workqueue_prometheus_text(spool_dir):
    with shmq.WorkQueue(os.path.join(spool_dir, "wq"), capacity="64KiB",
                        dead_capacity="16KiB") as wq:
        wq.put("a")
        wq.put("b")
        wq.get(timeout=bound(5)).ack()
        meta, samples = _parse(M.workqueue_prometheus_text(wq.path, wq.stats()))
    vals = {n: v for n, _lab, v in samples}
    assert set(meta) == {f"shmq_workqueue_{f}" for f, _h in M.WORKQUEUE_METRICS}
    assert vals["shmq_workqueue_acked"] == 1 and vals["shmq_workqueue_ready"] == 1


# --- finding spools and peeking ------------------------------------------------------------


def test_spool_paths_keeps_only_spools(spool_dir, make_spool):
    a = make_spool(name="a")
    make_spool(name=".hidden")
    with open(os.path.join(spool_dir, "notes.txt"), "w") as f:
        f.write("not a spool" * 1000)
    with open(os.path.join(spool_dir, "tiny"), "wb") as f:
        f.write(b"SHMQSPL\x00")
    os.symlink(a.path, os.path.join(spool_dir, "link"))
    os.mkdir(os.path.join(spool_dir, "sub"))
    assert M.spool_paths([spool_dir]) == [a.path]
    # a file named explicitly is kept as given (the caller asked for it)
    assert M.spool_paths([os.path.join(spool_dir, "notes.txt")]) == [os.path.join(spool_dir, "notes.txt")]
    assert M.spool_paths([os.path.join(spool_dir, "missing")]) == [os.path.join(spool_dir, "missing")]


def test_peek_agrees_with_stats(busy):
    p = M.peek(busy.path)
    s = busy.stats()
    for key in ("capacity", "first_seq", "next_seq", "frames", "used_bytes", "put_bytes",
                "on_full", "checksum"):
        assert p[key] == getattr(s, key), key
    assert p["slots"] >= 2 and p["lock_pid"] == 0
    now = int(time.time())
    assert sum(n for sec, n in p["write_rate"] if sec >= now - 2) == 10


def test_peek_errors(spool_dir):
    with pytest.raises(FileNotFoundError):
        M.peek(os.path.join(spool_dir, "missing"))
    foreign = os.path.join(spool_dir, "foreign")
    with open(foreign, "wb") as f:
        f.write(b"\x7fELF" + bytes(8192))
    with pytest.raises(SpoolFormatError, match="bad magic"):
        M.peek(foreign)
    fifo = os.path.join(spool_dir, "fifo")
    os.mkfifo(fifo, 0o600)
    try:
        with pytest.raises(SpoolFormatError):
            M.peek(fifo)  # regression: used to wait for a writer forever
    finally:
        os.unlink(fifo)


def test_collector_marks_unreadable_spools_down(busy, spool_dir):
    pytest.importorskip("prometheus_client")
    foreign = os.path.join(spool_dir, "foreign")
    with open(foreign, "wb") as f:
        f.write(bytes(8192))
    fams = {f.name: f for f in M.ShmqCollector([busy.path, foreign]).collect()}
    up = {s.labels["spool"]: s.value for s in fams["shmq_up"].samples}
    assert up == {busy.path: 1, foreign: 0}
    assert M.ShmqCollector(busy.path).paths == [busy.path]
    assert M.ShmqCollector(busy.path).describe() == []


@given(st.dictionaries(st.integers(1000, 1100), st.integers(0, 10**6)), st.integers(1, 60))
def test_rate_helpers(counts, seconds):
    series = sorted(counts.items())
    for sec in range(995, 1105):
        assert M.rate_at(series, sec) == counts.get(sec, 0)
    w = M.series_window(series, seconds, now=1100)
    assert w == [counts.get(s, 0) for s in range(1100 - seconds, 1100)]


# --- peeking at a spool another process writes ---------------------------------------------


def _put_n(path, n):
    sp = shmq.Spool.open(path)
    try:
        for i in range(n):
            sp.put(b"%08d" % i)
    finally:
        sp.close()


def test_peek_while_another_process_writes(ctx, make_spool):
    sp = make_spool(capacity="1MiB", name="live")
    n = 3000
    p = ctx.Process(target=_put_n, args=(sp.path, n))
    p.start()
    seen = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            snap = M.peek(sp.path)
            seen.append(snap["next_seq"])
            assert snap["frames"] == snap["next_seq"] - snap["first_seq"]
            if snap["next_seq"] == n:
                break
    finally:
        assert join_all([p]) == [0]
    assert seen == sorted(seen) and seen[-1] == n  # a racy snapshot, but never backwards
    final = M.peek(sp.path)
    assert final["put_bytes"] == 8 * n and final["next_seq"] == n

"""The values codec (codec 8, shmq/core/values.c): shmq.Queue items of exact builtin
types without pickle, with the same semantics.

* every builtin type round-trips with its exact type, alone and nested, through
  the codec and through a Queue (the C put and get, the Python slow paths,
  put_many/get_many, a child of every start method);
* subclasses (a dict subclass, an OrderedDict, a bool, an IntEnum ...), shared
  or cyclic containers, big ints and lone surrogates are pickled as before;
* frames the old codec wrote (pickles, codec 1) are still read;
* a forged values frame is refused by the trust rules as a pickle is, and a
  damaged one raises ValueError (never reads past the payload: property tests
  here, and this file runs under AddressSanitizer in stress/sanitize.py).
"""

import collections
import enum
import math
import os
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmq
from shmq import _core, codec
from shmq import _format as F
from shmq.cli import main

from conftest import bound

dumps, loads = _core.values_dumps, _core.values_loads


def same(a, b):
    """Equal, with the same type at every level (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b)) and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k1, k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b))
    return a == b


def nested(depth):
    v = "leaf"
    for _ in range(depth):
        v = [v]
    return v


EXACT = {
    "None": None, "True": True, "False": False,
    "int 0": 0, "int -1": -1, "int8 edge": 127, "int8 past": 128, "int8 low": -129,
    "int32 edge": 2**31 - 1, "int32 past": 2**31, "int32 low": -2**31 - 1,
    "int64 edge": 2**63 - 1, "int64 low": -2**63,
    "float": 1.5, "float -0.0": -0.0, "float inf": math.inf, "float nan": math.nan,
    "complex": 1 - 2.5j,
    "str empty": "", "str ascii": "sensor-7", "str utf-8": "é€😀", "str 255": "x" * 255,
    "str 256": "y" * 256, "str 5000 utf-8": "ü" * 5000,
    "bytes empty": b"", "bytes": b"\x00\xff" * 10, "bytes 2000": b"z" * 2000,
    "bytearray": bytearray(b"ab\x00"),
    "list": [1, "a", None], "list empty": [], "tuple": (1, (2.5, "x")), "tuple empty": (),
    "dict": {"a": 1, 2: "b", (1, 2): None, None: 1.5, 1.5: 2, frozenset({1}): 3, b"k": 4, True: "t"},
    "dict empty": {}, "set": {1, "a", (2, 3)}, "set empty": set(), "frozenset": frozenset({"a", 1}),
    "frozenset empty": frozenset(),
    "the benchmark's dict": {"id": 12345, "name": "sensor-7", "value": 3.25, "ok": True, "tags": ["a", "b"]},
    "64 deep": nested(64),
    "10000 ints": list(range(-5000, 5000)),
    "many dicts": [{"k": i, "key-%d" % (i % 40): str(i)} for i in range(300)],
}


class D(dict):
    pass


class L(list):
    pass


class S(str):
    pass


class I(int):
    pass


class Color(enum.IntEnum):
    RED = 1


Point = collections.namedtuple("Point", "x y")

NOT_EXACT = {
    "dict subclass": D(a=1), "OrderedDict": collections.OrderedDict(a=1),
    "defaultdict": collections.defaultdict(int, a=1), "Counter": collections.Counter("aab"),
    "list subclass": L([1]), "str subclass": S("s"), "int subclass": I(3), "IntEnum": Color.RED,
    "namedtuple": Point(1, 2), "in a dict": {"a": D(b=1)}, "in a list": [1, collections.OrderedDict()],
    "big int": 2**64, "big negative int": -2**63 - 1, "lone surrogate": "a\udc80",
    "65 deep": nested(65), "a range": range(3),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_every_builtin_type_round_trips_through_the_codec(name):
    obj = EXACT[name]
    data = dumps(obj)
    assert data is not None and data[0] == 1
    assert same(loads(data), obj)
    assert same(loads(memoryview(bytearray(data))), obj)  # any buffer


@pytest.mark.parametrize("name", list(NOT_EXACT))
def test_what_is_not_exact_is_left_to_pickle(name):
    assert dumps(NOT_EXACT[name]) is None


def test_bool_and_small_ints_keep_their_identity():
    got = loads(dumps([True, False, None, 1, 256]))
    assert got[0] is True and got[1] is False and got[2] is None and got[3] is 1  # noqa: F632


def test_shared_and_cyclic_containers_are_pickled_with_their_identity(spool_dir):
    a = [1]
    shared = [a, a]
    cyc = []
    cyc.append(cyc)
    d = {}
    d["self"] = d
    for obj in (shared, cyc, d, {"x": a, "y": a}, (bytearray(b"b"),) * 2):
        assert dumps(obj) is None
    same_tuple = ("t",)
    assert dumps([same_tuple, same_tuple]) is not None  # immutable: identity is not observable
    q = shmq.Queue(path=os.path.join(spool_dir, "q"))
    try:
        for obj in (shared, cyc):
            q.put(obj)
        out = q.get(timeout=bound(10))
        assert out == [[1], [1]] and out[0] is out[1]
        out = q.get(timeout=bound(10))
        assert out[0] is out
    finally:
        q.close()
        shmq.Spool.destroy(os.path.join(spool_dir, "q"))


# -- through a Queue --------------------------------------------------------------------


def _codecs(q, n):
    """The codec tags of the first ``n`` frames of queue ``q``'s spool."""
    r = q._spool.reader(start="earliest")
    try:
        return [r.get(timeout=bound(10)).codec for _ in range(n)]
    finally:
        r.close()


@pytest.fixture
def queue(spool_dir):
    path = os.path.join(spool_dir, "q")
    q = shmq.Queue(path=path)
    yield q
    q.close()
    shmq.Spool.destroy(path)


def test_queue_items_round_trip_with_their_types(queue):
    items = list(EXACT.values()) + list(NOT_EXACT.values())
    for obj in items:
        queue.put(obj)  # the C put
    codecs = _codecs(queue, len(items))
    raw = [type(obj) is bytes for obj in EXACT.values()]  # bytes are raw frames, as they always were
    assert codecs == [F.CODEC_RAW if b else F.CODEC_VALUES for b in raw] + [F.CODEC_PICKLE] * len(NOT_EXACT)
    for obj in items:
        got = queue.get(timeout=bound(10))  # the C get
        assert same(got, obj) or (isinstance(obj, range) and got == obj)


def test_queue_slow_paths_and_batches_use_the_codec(queue):
    obj = EXACT["the benchmark's dict"]
    queue.put(obj, block=False)  # the Python put (shmq.codec.encode)
    queue.put_many([obj, EXACT["tuple"], EXACT["set"]])  # one batch, all values
    queue.put_many([obj, D(a=1)])  # one item needs pickle: the batch is pickled whole
    assert _codecs(queue, 6) == [F.CODEC_VALUES] * 4 + [F.CODEC_PICKLE] * 2
    assert same(queue.get(block=True, timeout=5.5), obj)  # (a float timeout: C)
    got = queue.get_many(5, timeout=bound(10))
    assert same(got[:3], [obj, EXACT["tuple"], EXACT["set"]])
    assert same(got[3], obj) and type(got[4]) is D and got[4] == {"a": 1}


def test_values_from_a_child_of_every_start_method(spool_dir, ctx):
    path = os.path.join(spool_dir, "q")
    q = shmq.Queue(path=path)
    try:
        p = ctx.Process(target=_put_items, args=(q,))
        p.start()
        p.join(bound(60))
        assert p.exitcode == 0
        assert same(q.get(timeout=bound(10)), EXACT["the benchmark's dict"])
        assert type(q.get(timeout=bound(10))) is collections.OrderedDict
        assert same(q.get_many(10, timeout=bound(10)), [EXACT["dict"], EXACT["many dicts"]])
    finally:
        q.close()
        shmq.Spool.destroy(path)


def _put_items(q):
    q.put(EXACT["the benchmark's dict"])
    q.put(collections.OrderedDict(a=1))
    q.put_many([EXACT["dict"], EXACT["many dicts"]])


def test_dict_keys_from_the_key_cache_are_the_right_keys():
    # The decoder keeps the str keys it made (256 slots, by a hash of the bytes):
    # keys of every length, many colliding in a slot, always come back as written.
    keys = [("k" * n) for n in range(0, 40)] + [f"key-{i}" for i in range(2000)] + ["é" * 16, "ü" * 17]
    for _ in range(2):
        for i in range(0, len(keys), 7):
            d = {k: j for j, k in enumerate(keys[i:i + 7])}
            assert same(loads(dumps(d)), d)


# -- frames of the old codec -------------------------------------------------------------


def test_frames_the_old_codec_wrote_are_still_read(queue):
    # What shmq.Queue wrote before the values codec: pickle protocol 5, codec 1.
    old = [{"id": 1, "tags": ["a"]}, (1, 2.5), "text", 7, [None, True]]
    for obj in old:
        queue._spool.put(pickle.dumps(obj, 5), codec=F.CODEC_PICKLE)
    queue._spool.put_many([pickle.dumps(o, 5) for o in old], codec=F.CODEC_PICKLE)
    queue.put(old[0])  # and a new one after them
    assert [queue.get(timeout=bound(10)) for _ in old] == old  # the C get
    assert queue.get_many(len(old), timeout=bound(10)) == old  # the C batch take
    assert queue.get(block=True, timeout=bound(10)) == old[0]
    assert codec.decode_item(pickle.dumps(old[0], 5), F.CODEC_PICKLE) == old[0]


# -- trust and damage -------------------------------------------------------------------


def test_a_forged_values_frame_is_refused_as_a_pickle_would_be(spool_dir, capsys):
    path = os.path.join(spool_dir, "shared")
    sp = shmq.Spool.create(path, capacity=65536, on_full="block", mode=0o666)  # others can write it
    payload = dumps({"planted": [1, 2]})
    sp.put(payload, codec=F.CODEC_VALUES)  # what another user could plant
    untrusted = codec.trust_of(sp)
    sp.close()
    assert not untrusted.ok
    with pytest.raises(shmq.UntrustedSpool):
        codec.decode(payload, F.CODEC_VALUES, untrusted)
    with pytest.raises(shmq.UntrustedSpool, match="writable by group and others"):
        shmq.Queue(path=path)
    main(["tail", path, "-n", "1"])
    out = capsys.readouterr().out
    assert "<values: " in out and "pass --unsafe-pickle to decode" in out and "planted" not in out
    assert main(["tail", path, "-n", "1", "--unsafe-pickle"]) == 0
    assert "{'planted': [1, 2]}" in capsys.readouterr().out
    assert codec.decode(payload, F.CODEC_VALUES, codec.TRUSTED) == {"planted": [1, 2]}
    q = shmq.Queue(path=path, trusted=True)  # the caller vouches for the other writers
    assert q.get(timeout=bound(10)) == {"planted": [1, 2]}
    q.close()
    shmq.Spool.destroy(path)


DAMAGED = {
    "empty": b"",
    "newer version": b"\x02N",
    "no value": b"\x01",
    "unknown tag": b"\x01?",
    "trailing bytes": b"\x01NN",
    "truncated int64": b"\x01i\x01\x02",
    "truncated int32": b"\x01j\x01",
    "truncated float": b"\x01f" + bytes(7),
    "short str past the end": b"\x01s\x05ab",
    "long str past the end": b"\x01S\xff\xff\xff\x7fab",
    "bytes past the end": b"\x01y\x09\x00\x00\x00abc",
    "list count past the end": b"\x01l\xff\xff\xff\xffN",
    "dict count past the end": b"\x01d\x02\x00\x00\x00NN",
    "invalid utf-8": b"\x01s\x02\xc3\x28",
    "invalid utf-8 key": b"\x01d\x01\x00\x00\x00s\x02\xc3\x28N",
    "unhashable key": b"\x01d\x01\x00\x00\x00l\x00\x00\x00\x00N",
    "unhashable set item": b"\x01e\x01\x00\x00\x00d\x00\x00\x00\x00",
    "too deep": b"\x01" + b"l\x01\x00\x00\x00" * 70 + b"N",
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_payload_raises_and_reads_nothing_past_it(name):
    with pytest.raises((ValueError, TypeError)) as ei:
        loads(DAMAGED[name])
    if name == "newer version":
        assert "newer shmq" in str(ei.value)
    elif not name.startswith(("invalid utf-8", "unhashable")):
        assert "damaged shmq values payload" in str(ei.value)


def test_a_damaged_values_frame_fails_its_get_and_the_queue_goes_on(queue):
    queue._spool.put(b"\x01l\xff\xff\xff\xff", codec=F.CODEC_VALUES)
    queue.put("next")
    with pytest.raises(ValueError, match="damaged"):
        queue.get(timeout=bound(10))
    assert queue.get(timeout=bound(10)) == "next"


int64 = st.integers(-2**63, 2**63 - 1)
values = st.recursive(
    st.none() | st.booleans() | int64 | st.floats() | st.complex_numbers()
    | st.text() | st.binary() | st.binary().map(bytearray),
    lambda inner: st.lists(inner) | st.lists(inner).map(tuple)
    | st.dictionaries(st.text() | int64 | st.floats(allow_nan=False), inner)
    | st.frozensets(int64 | st.text()) | st.sets(int64 | st.text()),
    max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_property_any_exact_value_round_trips(obj):
    data = dumps(obj)
    assert data is not None
    assert same(loads(data), obj) or obj != obj  # (NaN inside a container compares unequal)


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=64))
def test_property_random_payloads_decode_or_raise(tail):
    for data in (b"\x01" + tail, tail):
        try:
            loads(data)
        except (ValueError, TypeError):
            pass


@settings(max_examples=800, deadline=None)
@given(values, st.data())
def test_property_corrupted_payloads_decode_or_raise(obj, data):
    raw = bytearray(dumps(obj))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for payload in (bytes(raw), bytes(raw[:cut])):
        try:
            loads(payload)
        except (ValueError, TypeError):
            pass


def test_seeded_mutations_decode_or_raise():
    # 20,000 payloads mutated from real ones (bytes changed, cut, inserted): each
    # decodes or raises; under stress/sanitize.py none may read out of bounds.
    import random

    rng = random.Random(7)
    seeds = [EXACT["the benchmark's dict"], EXACT["dict"], EXACT["many dicts"][:20], EXACT["str 5000 utf-8"],
             [EXACT["complex"], EXACT["bytearray"], EXACT["set"], EXACT["frozenset"], EXACT["int64 low"]]]
    payloads = [dumps(s) for s in seeds]
    decoded = 0
    for _ in range(20000):
        raw = bytearray(rng.choice(payloads))
        for _ in range(rng.randint(1, 6)):
            i, op = rng.randrange(len(raw)), rng.random()
            if op < 0.6:
                raw[i] = rng.randrange(256)
            elif op < 0.8:
                del raw[i:i + rng.randint(1, 8)]
            else:
                raw[i:i] = rng.randbytes(rng.randint(1, 8))
            raw = raw or bytearray(b"\x01")
        try:
            loads(bytes(raw[:rng.randrange(len(raw) + 1)] if rng.random() < 0.3 else raw))
            decoded += 1
        except (ValueError, TypeError):
            pass
    assert 0 < decoded < 20000  # both outcomes were exercised

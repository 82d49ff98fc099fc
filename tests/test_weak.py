"""guard._weak: identity-keyed maps that hold their keys weakly (the checks' per-optimizer state)."""
import gc

import torch

from guard._weak import WeakIdMap, WeakIdSet


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


class _Obj:
    pass


def test_an_entry_goes_with_its_object_and_a_reused_id_finds_nothing():
    m = WeakIdMap()
    ids = set()
    for _ in range(200):  # CPython reuses a freed object's id at once: a stale entry would be found
        o = _Obj()
        ids.add(id(o))
        assert m.get(o) is None and o not in m and id(o) not in m.data
        m[o] = "state"
        assert m.get(o) == "state" and m.data[id(o)] == "state"
        del o  # freed here (no cycle)
    assert len(ids) < 200  # ids were reused, and no new object found the old one's state
    assert len(m) == 0 and not m._refs


def test_the_map_does_not_keep_its_keys_alive():
    m, s = WeakIdMap(), WeakIdSet()
    o = _opt()
    m[o] = 1
    s.add(o)
    import weakref
    r = weakref.ref(o)
    del o
    gc.collect()
    assert r() is None and not m and not s


def test_mapping_api_as_used_by_the_checks():
    m = WeakIdMap()
    a, b = _opt(), _opt()
    assert m.setdefault(a, []) == [] and a in m
    m[b] = 2
    assert dict((id(k), v) for k, v in m.items()) == {id(a): [], id(b): 2}
    assert set(map(id, m)) == {id(a), id(b)} and list(m.values()).count(2) == 1
    assert m.pop(a) == [] and a not in m and m.pop(a, "gone") == "gone"
    del m[b]
    assert not m and not m._refs
    m[a] = 3
    m.clear()
    assert len(m) == 0
    s = WeakIdSet()
    s.add(a)
    s.add(a)
    assert a in s and len(s) == 1 and list(s) == [a]
    s.discard(a)
    assert a not in s and not s

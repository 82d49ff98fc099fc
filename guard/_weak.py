"""Maps and sets keyed by object identity that do not keep their keys alive.

`weakref.WeakKeyDictionary` and `WeakSet` cost a Python call and a weak reference per lookup; the
checks look up optimizers and models several times a step. Here the entries live in a plain dict keyed
by ``id(obj)`` (``data``), which the hot paths read directly (``m.data.get(id(opt))``), and each key's
weak reference drops its entry when the object dies. CPython runs that callback before the object's
memory is freed, so an id is never found for a later object that reuses it.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterator, Tuple


def _dropper(owner: "weakref.ReferenceType[Any]", key: int) -> Callable[[Any], None]:
    def drop(_: Any) -> None:
        m = owner()
        if m is not None:
            m.data.pop(key, None)
            m._refs.pop(key, None)
    return drop


class WeakIdMap:
    """``obj -> value`` for objects compared by identity (optimizers, modules, loaders), held weakly."""

    __slots__ = ("data", "_refs", "__weakref__")

    def __init__(self) -> None:
        self.data: Dict[int, Any] = {}  # id(obj) -> value
        self._refs: Dict[int, "weakref.ReferenceType[Any]"] = {}  # id(obj) -> weak reference to obj

    def __setitem__(self, obj: Any, value: Any) -> None:
        k = id(obj)
        if k not in self._refs:
            self._refs[k] = weakref.ref(obj, _dropper(weakref.ref(self), k))
        self.data[k] = value

    def __getitem__(self, obj: Any) -> Any:
        return self.data[id(obj)]

    def __delitem__(self, obj: Any) -> None:
        k = id(obj)
        del self.data[k]
        self._refs.pop(k, None)  # the reference goes, and with it its callback

    def __contains__(self, obj: Any) -> bool:
        return id(obj) in self.data

    def __len__(self) -> int:
        return len(self.data)

    def __bool__(self) -> bool:
        return bool(self.data)

    def get(self, obj: Any, default: Any = None) -> Any:
        return self.data.get(id(obj), default)

    def setdefault(self, obj: Any, default: Any = None) -> Any:
        k = id(obj)
        if k in self.data:
            return self.data[k]
        self[obj] = default
        return default

    def pop(self, obj: Any, *default: Any) -> Any:
        k = id(obj)
        self._refs.pop(k, None)
        return self.data.pop(k, *default)

    def clear(self) -> None:
        self.data.clear()
        self._refs.clear()

    def items(self) -> Iterator[Tuple[Any, Any]]:
        """Live ``(obj, value)`` pairs (a snapshot: the map may change while they are used)."""
        for k, r in list(self._refs.items()):
            obj = r()
            if obj is not None and k in self.data:
                yield obj, self.data[k]

    def keys(self) -> Iterator[Any]:
        for obj, _ in self.items():
            yield obj

    __iter__ = keys

    def values(self) -> Iterator[Any]:
        for _, v in self.items():
            yield v


class WeakIdSet:
    """A set of objects compared by identity, held weakly (``id(obj) in s.data`` on hot paths)."""

    __slots__ = ("_map", "data")

    def __init__(self) -> None:
        self._map = WeakIdMap()
        self.data: Dict[int, Any] = self._map.data  # the same dict, for the hot paths

    def add(self, obj: Any) -> None:
        if id(obj) not in self._map.data:
            self._map[obj] = True

    def discard(self, obj: Any) -> None:
        self._map.pop(obj, None)

    def __contains__(self, obj: Any) -> bool:
        return id(obj) in self._map.data

    def __len__(self) -> int:
        return len(self._map.data)

    def __bool__(self) -> bool:
        return bool(self._map.data)

    def __iter__(self) -> Iterator[Any]:
        return self._map.keys()

    def clear(self) -> None:
        self._map.clear()

"""``Registry[T]``: things of one kind by name — the one plug-in mechanism of the testbed.

Backends, schedules (their declarations in testbed.schedules and each backend's
implementations), cost models, acceptance oracles, lookahead policies, draft kinds and the real
backend's layout runners are each a ``Registry``. An entry is either registered (``register``,
also as a decorator) or *declared* by the module that registers it when imported
(``declare(name, module)``): the name is known at once — for validation, ``--help`` and error
messages — and the module is imported on the first ``get``. A name neither registered nor
declared may still be found by the registry's ``loader`` (e.g. a backend's schedule registry
asks the schedule's declaration which module implements it).

``get`` of an unknown name raises ``UnknownName`` (a ``KeyError``) with one line: the kind, the
name, what is allowed and the closest match ("did you mean …").
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")


def did_you_mean(name: str, names: list[str] | tuple[str, ...]) -> str:
    """``; did you mean X?`` for the closest of ``names``, else ''."""
    close = difflib.get_close_matches(name, list(names), n=1)
    return f"; did you mean {close[0]}?" if close else ""


class UnknownName(KeyError):
    """A name a registry does not have; ``str()`` is the one-line message."""

    def __init__(self, kind: str, name: str, names: tuple[str, ...], why: str = "") -> None:
        self.kind, self.name, self.names = kind, name, names
        allowed = "one of " + ", ".join(names) if names else "none is registered"
        self.message = why or f"{kind} {name!r} is not known: {allowed}{did_you_mean(name, names)}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class Registry(Generic[T]):
    """Entries of one ``kind`` by name, in the order they were declared or registered."""

    def __init__(self, kind: str, *, loader: Callable[[str], None] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._declared: dict[str, str] = {}  # name -> module that registers it on import
        self._order: list[str] = []
        self._loader = loader

    # ----------------------------------------------------------------------------- filling
    @overload
    def register(self, name: str) -> Callable[[T], T]: ...
    @overload
    def register(self, name: str, entry: T) -> T: ...

    def register(self, name: str, entry: T | None = None):  # type: ignore[no-untyped-def]
        """``register(name, entry)`` -> entry, or ``@register(name)`` as a decorator. Registering
        a name again replaces its entry (a module imported twice, a plug-in's own version)."""
        if entry is None:
            def deco(e: T) -> T:
                self.register(name, e)
                return e
            return deco
        if name not in self._entries and name not in self._declared:
            self._order.append(name)
        self._entries[name] = entry
        return entry

    def declare(self, name: str, module: str) -> None:
        """``name`` exists and ``module`` registers it when imported (on the first ``get``)."""
        if name not in self._entries and name not in self._declared:
            self._order.append(name)
        self._declared.setdefault(name, module)

    # ----------------------------------------------------------------------------- reading
    def get(self, name: str) -> T:
        if name not in self._entries:
            module = self._declared.get(name)
            if module is not None:
                importlib.import_module(module)
            elif self._loader is not None:
                self._loader(name)
        try:
            return self._entries[name]
        except KeyError:
            if name in self._declared:
                raise UnknownName(self.kind, name, self.names(),
                                  f"{self.kind} {name!r}: {self._declared[name]} did not register it") from None
            raise UnknownName(self.kind, name, self.names()) from None

    def find(self, name: str) -> T | None:
        """The entry, or None when the name is unknown (no error)."""
        try:
            return self.get(name)
        except UnknownName:
            return None

    @property
    def entries(self) -> dict[str, T]:
        """The registered entries by name (a test may patch one, e.g. with pytest's
        ``monkeypatch.setitem``)."""
        return self._entries

    def names(self) -> tuple[str, ...]:
        """Every registered or declared name, in declaration order."""
        return tuple(self._order)

    def loaded(self) -> list[T]:
        """The entries registered so far (nothing is imported)."""
        return [self._entries[n] for n in self._order if n in self._entries]

    def items(self) -> list[tuple[str, T]]:
        """Every entry by name, importing the declared ones."""
        return [(n, self.get(n)) for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._declared

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"

"""One config cache for the many Hydra compositions of the pre-run check.

Hydra composes every configuration from scratch: for each composition it deep-copies its config
repository and loads and parses again every YAML file and structured config the defaults list
names (~40 % of a ~0.15 s composition here). The pre-run check of a sweep over config groups
composes once per combination of group choices (`+sweep=gpu_split`: 27), all from the same
search path. Inside ``shared_config_cache()`` those compositions share one repository copy and
one cache of loaded configs — the cache Hydra keeps for a single composition, kept for all.

Hydra merges a loaded config into the composed one without copying its nodes
(``no_deepcopy_set_nodes``), and later merges change those nodes in place: a config loaded to be
merged is therefore handed out as a copy, while one read only for its defaults list and header
(most reads) is not. tests/testbed/app/test_compose_cache.py composes every job of the shipped sweeps with
and without the cache and compares them. Hydra's internals may change: if they are not as
expected, composition goes on uncached.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def shared_config_cache() -> Iterator[None]:
    try:
        from hydra._internal import config_loader_impl
        from hydra._internal.config_repository import CachingConfigRepository
    except ImportError:  # another Hydra: compose uncached
        yield
        return
    if getattr(config_loader_impl, "CachingConfigRepository", None) is not CachingConfigRepository or \
            not hasattr(config_loader_impl.ConfigLoaderImpl, "_load_single_config"):
        yield  # nested, or Hydra's loader no longer builds its cache this way
        return
    shared: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(repository) -> (its copy, loaded configs)

    class SharedCachingRepository(CachingConfigRepository):  # type: ignore[misc]
        def __init__(self, delegate: Any) -> None:
            entry = shared.get(id(delegate))
            if entry is None:
                super().__init__(delegate)
                shared[id(delegate)] = (self.delegate, self.cache)
            else:
                self.delegate, self.cache = entry

        def load_config(self, config_path: str) -> Any:
            ret = super().load_config(config_path)
            if ret is None or sys._getframe(1).f_code.co_name != "_load_single_config":
                return ret  # read for its defaults list and header only
            # loaded to be merged: Hydra merges without copying nodes (no_deepcopy_set_nodes),
            # and later merges change them in place, so every composition merges its own copy
            out = copy.copy(ret)
            out.config = copy.deepcopy(ret.config)
            return out

    config_loader_impl.CachingConfigRepository = SharedCachingRepository
    try:
        yield
    finally:
        config_loader_impl.CachingConfigRepository = CachingConfigRepository

"""The real backend: real models executed on this machine's devices."""

import testbed  # noqa: F401  (torch's allocator on huge pages: set before torch is imported)

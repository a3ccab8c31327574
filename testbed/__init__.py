"""Speculative decoding testbed: backend-neutral core (config, algorithms, results, reports)."""

import os

# A forward streams every weight from memory. On 4 KB pages the bundled draft's forward took
# 1.3-1.45x its time on huge pages, by an amount that differed from process to process (so a
# probe in one process did not predict a run in another). torch's CPU allocator puts
# allocations of >= 2 MB on transparent huge pages (madvise) when this is set; it reads it once,
# at its first allocation, so it is set before torch is imported. THP_MEM_ALLOC_ENABLE=0 opts out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

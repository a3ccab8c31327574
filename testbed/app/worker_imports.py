"""Imported by the joblib workers' fork server (`testbed.app.worker_pool`): what a job of the
backend named in ``SPECBED_WORKER_BACKEND`` and the sweep report import, once, so that every
worker forked from the server starts with them."""

import atexit
import gc
import os

from testbed.app.worker_pool import BACKEND_ENV, SERVER_PARENT_ENV, THREADS_ENV, import_job_modules

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # as loky's spawned workers
    os.environ.setdefault(var, os.environ.get(THREADS_ENV, "1"))
if os.environ.get(BACKEND_ENV, "sim") == "sim":
    # simulated jobs use torch on the CPU only: skip loading out-of-tree device backends through
    # package entry points (~0.08 s of the import every job waits for)
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
import_job_modules(os.environ.get(BACKEND_ENV, "sim"))
# Everything imported so far lives as long as the workers: out of the collector's sight, a
# worker's full collections no longer walk it, and do not write to (so copy) the pages it
# shares with the server. Jobs in workers ran ~10 % slower without (`+sweep=wan`, 2 cores).
gc.collect()
gc.freeze()

if os.environ.get(SERVER_PARENT_ENV) == str(os.getppid()):  # in the fork server itself
    # The server holds these imports only for its children. Tearing them down at exit (~0.8 s,
    # torch included) kept the sweep's stdout open that long after the sweep had ended; its
    # children (forked workers) leave through os._exit and never run this.
    atexit.register(os._exit, 0)

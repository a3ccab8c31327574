"""Entry point: `python -m testbed [overrides...]` — preflight checks, then the Hydra app."""

import sys

from testbed.preflight import main_guard, normalize_args

if __name__ == "__main__":
    sys.argv[1:] = normalize_args(sys.argv[1:])
    # argparse stops collecting overrides at a flag: move -m/--multirun in front of them
    flags = [a for a in sys.argv[1:] if a in ("-m", "--multirun")]
    sys.argv[1:] = flags + [a for a in sys.argv[1:] if a not in ("-m", "--multirun")]
    if not any(a in ("--help", "-h", "--cfg", "-c", "--info", "--hydra-help") or a.startswith("--cfg")
               for a in sys.argv[1:]):
        main_guard(sys.argv[1:])
    from testbed.app import main

    main()

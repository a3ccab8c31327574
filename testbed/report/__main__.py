"""`python -m testbed.report DIR... [--out DIR]`: rebuild a report from saved runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from testbed.report import ReportError, build_report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.report",
                                 description="Build report.md/html + figures from run or sweep directories.")
    ap.add_argument("dirs", nargs="+", type=Path, help="run directories or sweep directories")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: the single given directory, else reports/report)")
    args = ap.parse_args(argv)
    out = args.out or (args.dirs[0] if len(args.dirs) == 1 else Path("reports/report"))
    try:
        path = build_report(args.dirs, out)
    except (FileNotFoundError, ReportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Entry point: `python -m testbed [overrides...]` — pre-run check, then the Hydra app.

`--help` is ours (config groups and their options, then every setting with its type and
default, read from conf/ and the schema without composing anything); `--hydra-help`, `--cfg`,
`--info` go to Hydra.
"""

import os
import sys

HYDRA_FLAGS = ("--cfg", "-c", "--info", "--hydra-help", "--resolve", "--package", "-p")


def main() -> None:
    if "hydra/launcher=joblib" in sys.argv[1:] and "--help" not in sys.argv:
        from testbed.app.worker_pool import start_fork_server_for

        start_fork_server_for(sys.argv[1:])
    from testbed.app.preflight import normalize_args

    args = normalize_args(sys.argv[1:])
    from testbed.config_docs import renamed_setting

    renamed = renamed_setting(args)
    if renamed:
        print(f"error: {renamed}", file=sys.stderr)
        raise SystemExit(2)
    if any(a in ("--help", "-h") for a in args):
        from testbed.app.cli_help import print_help

        print_help()
        return
    # argparse stops collecting overrides at a flag: move -m/--multirun in front of them
    flags = [a for a in args if a in ("-m", "--multirun")]
    sys.argv[1:] = flags + [a for a in args if a not in ("-m", "--multirun")]
    from testbed.app.preflight import command_pairs, main_guard

    sweep = False
    if not any(a.split("=")[0] in HYDRA_FLAGS for a in args):
        composed: dict = {}
        jobs = main_guard(sys.argv[1:], composed)
        if "cfg" in composed:  # a single run: composed once, by the check
            from testbed.app.main import run_single

            run_single(composed["cfg"])
            return
        sweep = True
        os.environ["SPECBED_SWEEP_JOBS"] = str(jobs)  # the sweep's progress line
        from testbed.app.preflight import MAX_JOBS_CHECKED

        if jobs < MAX_JOBS_CHECKED:  # the sweeper need not compose every job again
            os.environ["SPECBED_SWEEP_CHECKED"] = "1"
    else:
        from testbed.compose import register_configs

        register_configs(command_pairs(args))
    from testbed.app.main import main as app_main

    app_main()
    if sweep:
        # A sweep has ended: every result and the report are written and closed, its workers
        # are gone. Tearing down what it imported (torch, pandas, matplotlib) took ~0.35 s of
        # the user's wait for nothing. The exit handlers still run: they flush the log files and
        # remove joblib's shared-memory folders (left behind, loky's resource tracker warns).
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

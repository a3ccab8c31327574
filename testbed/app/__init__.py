"""The application around the testbed: the Hydra app (`python -m testbed`), the pre-run check,
--help, sweeps and their launchers, worker pools and the host lock."""

"""Hydra plugins of specbed (Hydra loads sweepers only from the hydra_plugins namespace)."""

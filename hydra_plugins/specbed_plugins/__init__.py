"""Hydra plugins of specbed's schedule plug-ins (Hydra discovers plugins only in hydra_plugins)."""

"""Hydra's config search path gets the conf directory of every schedule plug-in loaded
(``ScheduleSpec.conf_dir``; plug-ins are named in ``SPECBED_PLUGINS``, testbed.schedules), so a
plug-in's ``schedule/NAME.yaml`` composes like a built-in schedule's. The repository's conf/
stays first: a plug-in cannot replace a built-in preset."""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class SpecbedPluginConf(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from testbed.config import ConfigError
        from testbed.schedules import plugin_conf_dirs

        try:
            dirs = plugin_conf_dirs()
        except ConfigError:  # a plug-in that cannot be imported: the pre-run check names it
            return
        for conf_dir in dirs:
            search_path.append(provider="specbed-plugin", path=f"file://{conf_dir}")

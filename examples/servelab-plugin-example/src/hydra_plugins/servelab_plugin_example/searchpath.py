"""Hydra searchpath plugin: puts this package's ``conf/`` (``scheduler/lifo.yaml``, ...) on servelab's
config search path, so ``python run.py scheduler=lifo`` finds it without copying files."""

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ServelabPluginExampleSearchPath(SearchPathPlugin):
    """Adds ``pkg://servelab_plugin_example.conf`` before Hydra's ConfigStore (so these files win over
    servelab's auto-generated ``{name, params: {}}`` nodes)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.prepend(provider="servelab-plugin-example", path="pkg://servelab_plugin_example.conf",
                            anchor=SearchPathQuery(provider="schema"))

"""A codec package outside ``hvd_gradcomp``: tests/external_randomk.py's random-k under its own name,
declared as an entry point (pyproject.toml), so ``HVDGC_COMPRESSION=randomk-plugin`` and
``hvdgc-launch --compression randomk-plugin`` find it once the package is installed."""
from tests.external_randomk import RandomK


class PluginRandomK(RandomK):
    """RandomK, registered by the entry point ``randomk-plugin``."""

    codec_name = "randomk-plugin"

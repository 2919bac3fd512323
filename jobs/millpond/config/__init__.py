"""Configuration: deployment settings (``conf/millpond.yaml`` + environment) and pipeline files."""

from millpond.config.settings import DEFAULT_CONF_DIR, PROJECT_ROOT, Settings, load_settings

__all__ = ["DEFAULT_CONF_DIR", "PROJECT_ROOT", "Settings", "load_settings"]

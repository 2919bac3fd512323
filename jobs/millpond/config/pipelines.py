"""Pipeline files (``conf/pipelines/*.yaml``) read into validated specs."""

from __future__ import annotations

from pathlib import Path

import yaml

from millpond.config.settings import DEFAULT_CONF_DIR
from millpond.model.spec import PipelineSpec, pipeline_from_dict


def load_pipeline(path: str | Path) -> PipelineSpec:
    path = Path(path)
    try:
        return pipeline_from_dict(yaml.safe_load(path.read_text()) or {})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path.name}: {exc}") from exc


def load_pipelines(conf_dir: Path | None = None) -> dict[str, PipelineSpec]:
    folder = (conf_dir or DEFAULT_CONF_DIR) / "pipelines"
    specs = [load_pipeline(p) for p in sorted(folder.glob("*.yaml"))]
    return {s.name: s for s in specs}

"""Pipeline files (``conf/pipelines/*.yaml``) read into validated specs, and the stage graph they form
(a pipeline reading another's panes, ``model.stages``) checked: upstreams exist, can be read, no cycle."""

from __future__ import annotations

from pathlib import Path

import yaml

from millpond.config.settings import DEFAULT_CONF_DIR
from millpond.model.spec import PipelineSpec, pipeline_from_dict
from millpond.model.stages import check_graph, upstream_first
from millpond.model.versions import semantic_spec


def load_pipeline(path: str | Path) -> PipelineSpec:
    path = Path(path)
    try:
        return pipeline_from_dict(yaml.safe_load(path.read_text()) or {})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path.name}: {exc}") from exc


def pipeline_named(conf_dir: Path, name_or_path: str) -> PipelineSpec:
    """A pipeline by its name in ``conf_dir``/pipelines, or from a YAML path (what the commands accept)."""
    if Path(name_or_path).suffix in (".yaml", ".yml"):
        return load_pipeline(name_or_path)
    specs = load_pipelines(conf_dir)
    if name_or_path not in specs:
        from millpond.errors import MillpondError

        raise MillpondError(f"unknown pipeline {name_or_path}: have {', '.join(specs)}")
    return specs[name_or_path]


def load_pipelines(conf_dir: Path | None = None) -> dict[str, PipelineSpec]:
    """The pipelines by name, each after the upstreams it reads (``model.stages.upstream_first``)."""
    folder = (conf_dir or DEFAULT_CONF_DIR) / "pipelines"
    specs = [load_pipeline(p) for p in sorted(folder.glob("*.yaml"))]
    by_name = {s.name: s for s in specs}
    check_stages(by_name)
    return {n: by_name[n] for n in upstream_first({n: s.upstream.pipelines if s.upstream else ()
                                                   for n, s in by_name.items()})}


def check_stages(specs: dict[str, PipelineSpec]) -> None:
    """The stage graph of these pipelines: every upstream exists and can be read, and there is no cycle."""
    check_graph({n: s.upstream for n, s in specs.items()}, {n: semantic_spec(s.raw) for n, s in specs.items()},
                {n: s.value_type for n, s in specs.items()})

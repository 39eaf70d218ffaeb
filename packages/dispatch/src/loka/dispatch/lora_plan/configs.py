"""Read LoRA job configurations from a JSON, YAML or CSV file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loka.mods.packed_lora.config import LoraJobConfig


def read_job_configs(path: str | Path) -> list[LoraJobConfig]:
    """Jobs from `path`: a JSON or YAML list of objects (or an object with a "jobs" list),
    or a CSV with one job per row; keys are `LoraJobConfig`'s fields. Errors name the file
    and the entry."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"job configuration file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".json":
        entries = json.loads(path.read_text())
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as err:  # PyYAML is optional
            raise RuntimeError(f"{path}: reading YAML needs PyYAML (pip install pyyaml)") from err
        entries = yaml.safe_load(path.read_text())
    elif suffix == ".csv":
        import polars as pl

        entries = pl.read_csv(path).to_dicts()
    else:
        raise ValueError(f"{path}: job configurations are .json, .yaml/.yml or .csv")
    if isinstance(entries, dict) and "jobs" in entries:
        entries = entries["jobs"]
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty list of jobs (or {{'jobs': [...]}})")
    jobs = [_job(path, n, entry) for n, entry in enumerate(entries)]
    names = [job.name for job in jobs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"{path}: job names must be unique; repeated: {twice}")
    return jobs


def _job(path: Path, n: int, entry: Any) -> LoraJobConfig:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: job {n} is not an object: {entry!r}")
    try:
        return LoraJobConfig.from_dict(entry)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: job {n}: {err}") from err

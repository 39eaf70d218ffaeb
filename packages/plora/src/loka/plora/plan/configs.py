"""Read LoRA job configurations from a JSON, YAML or CSV file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loka.plora.config import LoraJobConfig


def read_job_configs(path: str | Path) -> list[LoraJobConfig]:
    """Jobs from `path`: a JSON or YAML list of objects (or an object with a "jobs" list),
    or a CSV with one job per row; keys are `LoraJobConfig`'s fields. Errors name the file
    and the entry."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"job configuration file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml", ".csv"):
        raise ValueError(f"{path}: job configurations are .json, .yaml/.yml or .csv")
    try:
        entries = _load(path, suffix)
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read it ({err})") from None
    except ValueError as err:  # JSONDecodeError is one; YAML and CSV errors become one below
        raise ValueError(f"{path}: malformed {suffix[1:].upper()}: {_line(err)}") from None
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


def _load(path: Path, suffix: str) -> Any:
    if suffix == ".json":
        return json.loads(path.read_text())
    if suffix == ".csv":
        import polars as pl

        try:
            return pl.read_csv(path).to_dicts()
        except pl.exceptions.PolarsError as err:
            raise ValueError(str(err)) from None
    try:
        import yaml
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"reading {path.name} (YAML) needs PyYAML: pip install 'loka-plora[yaml]'",
            name="yaml",
        ) from None
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(str(err)) from None


def _line(err: Exception) -> str:
    return " ".join(str(err).split())


def _job(path: Path, n: int, entry: Any) -> LoraJobConfig:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: job {n} is not an object: {entry!r}")
    try:
        return LoraJobConfig.from_dict(entry)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: job {n}: {err}") from err

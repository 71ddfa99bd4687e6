"""The base of every run-config section: unknown keys and non-finite numbers rejected, values frozen;
and :func:`path_field`, the marker for fields the loader resolves against the config file's directory."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PATH_FIELD_KEY = "csbp_path"
"""``json_schema_extra`` key marking a field whose value is a filesystem path."""


def path_field(default: Any = ..., *, description: str) -> Any:
    """A ``Field`` whose value is a filesystem path (resolved against the config file's directory)."""
    return Field(default, description=description, json_schema_extra={PATH_FIELD_KEY: True})


class _Section(BaseModel):
    # allow_inf_nan=False: `optim.lr: inf` or `collective_timeout_s: .nan` is an error, not a NaN run.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

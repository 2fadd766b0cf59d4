"""`ballonet train --config FILE.toml`: a run's `TrainConfig` as a TOML file, read and written.

The file holds any `TrainConfig` field by its name (`global_tokens = 8192`,
`lr_decay = "cosine"`; a dashed name as the flag spells it works too); unset fields keep
their defaults and the flags given on the command line override the file
(`config.config_from_args`, which imports this module: this one knows no TrainConfig).
A run with `--checkpoint-dir` writes its resolved config
there as `config.toml` (`write_resolved`), which `--config` reads back as it was.
No torch import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from typing import Literal

from ballonet.errors import InputError
from ballonet.paths import write_atomic
from ballonet.specs import load_toml

RESOLVED = "config.toml"
"""The resolved config's name in a checkpoint folder."""


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _expected(hint) -> tuple[type, ...]:
    """The TOML value types a field of type `hint` accepts (None is not a TOML value)."""
    if typing.get_origin(hint) is Literal:
        return (str,)
    types = tuple(a for a in typing.get_args(hint) if a is not type(None)) or (hint,)
    return (int, float) if float in types else types


def read_config_file(path: str, config_class: type) -> dict:
    """{field: value} of a config file for the dataclass `config_class` (`TrainConfig`),
    each value checked against its field's type; one line naming the file and the key on
    anything else."""
    data = load_toml(path, "config file")
    hints = typing.get_type_hints(config_class)
    values = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in values:
            raise InputError(f"{path}: {key} is given twice (as {name} and {name.replace('_', '-')}); give it once")
        if name not in hints:
            raise InputError(f"{path}: unknown setting {key!r} (the settings are TrainConfig's fields, as in "
                             f"`ballonet train --help`)")
        expected = _expected(hints[name])
        if isinstance(value, bool) != (bool in expected) or not isinstance(value, expected):
            kind = _KINDS[float if float in expected else expected[0]]
            raise InputError(f"{path}: {key} must be {kind}, got {value!r}")
        values[name] = value
    return values


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)  # a JSON string is a TOML basic string


def to_toml(config) -> str:
    """Every field that is set, one `name = value` line each (unset fields are left out:
    TOML has no null, and their default is unset)."""
    lines = ["# The resolved config of a ballonet train run; `ballonet train --config` reads it back."]
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is not None:
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def write_resolved(config, folder: str) -> str:
    """Write `config` to `folder/config.toml` (whole or not at all); returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, RESOLVED)
    text = to_toml(config)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_atomic(path, write)
    return path

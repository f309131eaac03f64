"""strag's one reader of small YAML mappings: the published trace format's meta yaml
(`meta-{trial}.yaml`: dp_size, pp_size, ...) for `strag analyze --meta` (pipelines/analyze.py) and
`strag import-reference` (pipelines/reference.py), and a raw window's job.yaml
(transforms/ingest/common.read_job_yaml); each caller then checks the fields it needs.

The published meta yamls are flat `name: value` lines; `flat_yaml` reads those exactly as
yaml.safe_load does without importing PyYAML (~15 ms of `strag analyze`'s ~0.2 s on the AR
trace); anything else goes to yaml.safe_load.
"""
from __future__ import annotations

import re

__all__ = ["MetaYamlError", "flat_yaml", "read_meta_yaml", "read_yaml_mapping"]

# A line of the published meta yamls: `name: value` with a decimal int or a bare word as the value.
_FLAT_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*): (?:(0|-?[1-9][0-9]*)|([A-Za-z_][A-Za-z0-9_.-]*))")
# Bare words that YAML 1.1 (PyYAML's safe loader) resolves to a bool or null, in any case.
_YAML_WORDS = frozenset({"yes", "no", "true", "false", "on", "off", "null"})


class MetaYamlError(ValueError):
    """The bytes are not a meta yaml: not YAML, not text, or not a mapping. The message says which."""


def flat_yaml(text: str) -> dict | None:
    """The mapping of a YAML text made only of `name: value` lines (decimal ints, bare words),
    exactly as yaml.safe_load reads it; None for anything else, which yaml.safe_load then reads."""
    fields: dict = {}
    for line in text.removesuffix("\n").split("\n"):
        match = _FLAT_LINE.fullmatch(line)
        if match is None:
            return None
        key, number, word = match.groups()
        if key in fields or key.lower() in _YAML_WORDS or (word is not None and word.lower() in _YAML_WORDS):
            return None
        fields[key] = word if number is None else int(number)
    return fields


def read_meta_yaml(data: bytes) -> dict:
    """The fields of a meta yaml's bytes ({} for an empty file); MetaYamlError when it is not a
    YAML mapping ("not a meta yaml (ParserError)", "... (it holds a list, not 'key: value' lines)")."""
    return read_yaml_mapping(data, "a meta yaml")


def read_yaml_mapping(data: bytes | str, what: str = "YAML", detail: bool = False) -> dict:
    """The mapping a YAML document holds ({} for an empty one); MetaYamlError naming `what` it is
    not when it is not text, not YAML (with `detail`: where the parser stopped), or not a mapping."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as error:
        raise MetaYamlError(f"not {what} ({type(error).__name__})") from None
    fields = flat_yaml(text)
    if fields is not None:
        return fields
    import yaml

    try:
        fields = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        where = f": {' '.join(str(error).split())}" if detail else ""
        raise MetaYamlError(f"not {what} ({type(error).__name__}{where})") from None
    if not isinstance(fields, dict):
        raise MetaYamlError(f"not {what} (it holds a {type(fields).__name__}, not 'key: value' lines)")
    return fields

"""YAML that refuses a key set twice in one mapping.

PyYAML (and most parsers) keep the last of two equal keys without a word, so a manifest that
sets `verifyOn: []` and later `verifyOn: [l40]` silently means the second; kubectl's parser and
the API server's strict decoding refuse it. Everything kernelfleet reads from a user's manifest
goes through here, and so do the tests that load the examples and the chart's values.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "load", "load_all"]


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping sets the same key twice; the message names the key and both lines."""


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                first = seen[key].start_mark.line + 1
                raise DuplicateKeyError(
                    None,
                    None,
                    f"key {key!r} is set twice in one mapping (first on line {first}): keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """The one document in `text`, as yaml.safe_load reads it, but refusing duplicate keys."""
    return yaml.load(text, Loader=_StrictLoader)


def load_all(text: str) -> list[Any]:
    """Every document in `text`, as yaml.safe_load_all reads them, but refusing duplicate keys."""
    return list(yaml.load_all(text, Loader=_StrictLoader))

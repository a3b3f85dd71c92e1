"""Objects to YAML: multi-document, byte-for-byte stable (the committed k8s/*.yaml are diffed)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

# Kubernetes' conventional order first; everything else alphabetically, at every level.
_FIRST = ("apiVersion", "kind", "metadata", "name", "namespace")


def to_dict(obj: Any) -> Any:
    """A ``kubernetes.client`` model (or dict/list of them) as plain JSON-ready data."""
    if isinstance(obj, Mapping | list | tuple | str | int | float | bool) or obj is None:
        if isinstance(obj, Mapping):
            return {str(k): to_dict(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [to_dict(v) for v in obj]
        return obj
    from kubernetes import client

    return client.ApiClient().sanitize_for_serialization(obj)


def _ordered(value: Any) -> Any:
    if isinstance(value, Mapping):
        keys = [k for k in _FIRST if k in value] + sorted(k for k in value if k not in _FIRST)
        return {k: _ordered(value[k]) for k in keys}
    if isinstance(value, list):
        return [_ordered(v) for v in value]
    return value


class _Dumper(yaml.SafeDumper):
    """Block style, lists indented under their key, no anchors/aliases."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render(objects: Iterable[Any], header: str = "", *, explicit_start: bool = True) -> str:
    """One YAML document per object, each opened by ``---``, under an optional ``#`` header.

    ``explicit_start=False`` (a single document only) suits files that are not manifests, such
    as Helm values.
    """
    docs = [_ordered(to_dict(obj)) for obj in objects]
    if not explicit_start and len(docs) != 1:
        raise ValueError("explicit_start=False needs exactly one document")
    text = yaml.dump_all(docs, Dumper=_Dumper, explicit_start=explicit_start, sort_keys=False,
                         default_flow_style=False, allow_unicode=True, width=10**6)
    if header:
        text = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) + text
    return text

"""The JSON document ``python -m aoprim bench --json FILE`` writes, and its validator.

The schema is documented for readers in bench/README.md ("The JSON document"); ``SCHEMA``
below is the same thing as a JSON Schema (draft 2020-12) a user can feed to any validator,
and ``validate(doc)`` checks a document against it without third-party packages (it
understands the subset of JSON Schema that SCHEMA uses).
"""
__all__ = ["SCHEMA_ID", "SCHEMA", "validate"]

SCHEMA_ID = "aoprim-bench/1"

_NUM = {"type": "number"}
_STATS = {
    "type": "object",
    "required": ["median", "min", "max", "q1", "q3"],
    "properties": {k: _NUM for k in ("median", "min", "max", "q1", "q3")},
}
_ENTRY = {
    "type": "object",
    "required": ["name", "role", "median", "min", "max", "q1", "q3", "samples", "ratio",
                 "winner"],
    "properties": {
        "name": {"type": "string"},
        "role": {"enum": ["baseline", "candidate", "reference"]},
        "median": _NUM, "min": _NUM, "max": _NUM, "q1": _NUM, "q3": _NUM,
        "samples": {"type": "array", "items": _NUM, "minItems": 1},
        "ratio": {"type": ["number", "null"]},
        "winner": {"type": "boolean"},
        "n": {"type": "integer"},
        "calls_per_sample": {"type": "integer"},
        "metrics": {"type": "object", "additionalProperties": _STATS},
    },
}
_GROUP = {
    "type": "object",
    "required": ["id", "family", "kind", "title", "unit", "better", "params", "series",
                 "baseline", "entries", "skipped"],
    "properties": {
        "id": {"type": "string"},
        "family": {"type": "string"},
        "kind": {"enum": ["python", "c", "contention", "server"]},
        "title": {"type": "string"},
        "unit": {"type": "string"},
        "better": {"enum": ["lower", "higher"]},
        "compete": {"type": "boolean"},
        "params": {"type": "object"},
        "series": {"type": "array", "items": {"type": "string"}},
        "baseline": {"type": ["string", "null"]},
        "entries": {"type": "array", "items": _ENTRY},
        "skipped": {"type": "array", "items": {
            "type": "object", "required": ["name", "reason"],
            "properties": {"name": {"type": "string"}, "reason": {"type": "string"}}}},
        "note": {"type": "string"},
    },
}
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "python -m aoprim bench --json",
    "type": "object",
    "required": ["schema", "header", "groups", "skipped"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "header": {
            "type": "object",
            "required": ["date", "cpu_model", "cores", "python", "aoprim_version", "compiler",
                         "mode", "settings", "server_warmup", "syscalls", "duration_s",
                         "selected"],
            "properties": {
                "date": {"type": "string"},
                "cpu_model": {"type": "string"},
                "cores": {"type": "integer"},
                "python": {"type": "string"},
                "aoprim_version": {"type": "string"},
                "compiler": {"type": "object"},
                "mode": {"enum": ["quick", "full", "tiny"]},
                "settings": {"type": "object"},
                "server_warmup": {"type": "string"},
                "syscalls": {"type": "string"},
                "duration_s": _NUM,
                "selected": {"type": "array", "items": {"type": "string"}},
                "load_average": {"type": ["array", "null"], "items": _NUM},
                "load_average_end": {"type": ["array", "null"], "items": _NUM},
                "own_cpus": {"type": ["number", "null"]},
                "other_cpus": {"type": ["number", "null"]},
                "warnings": {"type": "array", "items": {"type": "string"}},
            },
        },
        "groups": {"type": "array", "items": _GROUP},
        "skipped": {"type": "array", "items": {
            "type": "object", "required": ["what", "reason"],
            "properties": {"what": {"type": "string"}, "reason": {"type": "string"}}}},
    },
}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(v, t):
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, _TYPES[t])


def _check(v, s, path, out):
    if "const" in s and v != s["const"]:
        out.append(f"{path}: {v!r} != {s['const']!r}")
    if "enum" in s and v not in s["enum"]:
        out.append(f"{path}: {v!r} not one of {s['enum']}")
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_is(v, t) for t in types):
            out.append(f"{path}: {type(v).__name__} is not {'/'.join(types)}")
            return
    if isinstance(v, dict):
        for k in s.get("required", ()):
            if k not in v:
                out.append(f"{path}: missing {k!r}")
        props = s.get("properties", {})
        for k, sub in v.items():
            if k in props:
                _check(sub, props[k], f"{path}.{k}", out)
            elif "additionalProperties" in s:
                _check(sub, s["additionalProperties"], f"{path}.{k}", out)
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0):
            out.append(f"{path}: fewer than {s['minItems']} items")
        if "items" in s:
            for i, item in enumerate(v):
                _check(item, s["items"], f"{path}[{i}]", out)


def validate(doc):
    """The problems found in ``doc`` (a parsed JSON document), as a list of strings; empty
    when it follows SCHEMA."""
    out = []
    _check(doc, SCHEMA, "$", out)
    return out

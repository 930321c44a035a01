"""Write helm/kv-event-bridge/values.schema.json: the chart's values plus ``config``, the bridge's
own configuration schema derived from the structs of ``bridge.config`` and the ``Options`` of every
installed connector, so ``helm install`` refuses a bad config before any pod starts.

    python tools/chart_schema.py           write the file
    python tools/chart_schema.py --check   exit 1 when the file is out of date (CI, tests)

Run it after changing a config struct or a connector's options. Field descriptions come from the
structs' ``msgspec.Meta(description=...)``, the same text as the README reference
(``tools/config_reference.py``); ``tools/config_meta.py`` reads the structs for both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.config_meta import SINK_OPTIONS, ByteSize, Config, Duration, Secret, SinkConfig, connectors, sink_common_keys  # noqa: E402
from tools.generated import write_or_check  # noqa: E402

SCHEMA_PATH = ROOT / "helm" / "kv-event-bridge" / "values.schema.json"

# ${VAR} / ${VAR:-default} may stand for any value: the bridge substitutes it before validating.
ENV = {"type": "string", "pattern": r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-[^}]*)?\}"}
DURATION = {
    "description": "Seconds, or a string such as 250ms, 15s, 2m, 1h.",
    "anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "pattern": r"^\s*(\d+(\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$"}],
}
SIZE = {
    "description": "Bytes, or a string such as 64KiB, 16MiB, 1GiB, 10MB.",
    "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^\s*\d+\s*([Bb]|[KkMmGg][Ii]?[Bb])?\s*$"}],
}


class Converter:
    """msgspec type info -> JSON schema; structs go to ``$defs`` (named module.Class)."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def ref(self, cls: type) -> dict[str, Any]:
        name = f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
        if name not in self.defs:
            self.defs[name] = {}  # placeholder first: structs may refer to themselves
            self.defs[name] = self.struct(mi.type_info(cls))  # type: ignore[arg-type]
        return {"$ref": f"#/$defs/{name}"}

    def struct(self, t: mi.StructType, *, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "object"}
        doc = (t.cls.__doc__ or "").strip().split("\n\n", 1)[0]
        if doc and not doc.startswith(t.cls.__name__ + "("):
            out["description"] = " ".join(doc.split())
        out["properties"] = {f.encode_name: self.field(f) for f in t.fields if f.encode_name not in skip}
        required = [f.encode_name for f in t.fields if f.required and f.encode_name not in skip]
        if required:
            out["required"] = required
        if t.forbid_unknown_fields:
            out["additionalProperties"] = False
        return out

    def field(self, f: mi.Field) -> dict[str, Any]:
        s = self.type(f.type)
        default = f.default
        if default is not msgspec.NODEFAULT and not isinstance(default, msgspec.Struct):
            try:
                s = {**s, "default": json.loads(msgspec.json.encode(default, enc_hook=float))}
            except (TypeError, msgspec.EncodeError):
                pass
        return s

    def type(self, t: mi.Type) -> dict[str, Any]:
        if isinstance(t, mi.Metadata):
            s = self.type(t.type)
            extra = t.extra_json_schema or {}
            if "description" in extra and "$ref" in s:
                return {"allOf": [s], **extra}
            return {**s, **extra}
        if isinstance(t, mi.StructType):
            return self.ref(t.cls)
        if isinstance(t, mi.UnionType):
            return {"anyOf": [self.type(a) for a in t.types]}
        if isinstance(t, mi.StrType):
            s = {"type": "string"}
            for key, attr in (("minLength", "min_length"), ("maxLength", "max_length"), ("pattern", "pattern")):
                if getattr(t, attr) is not None:
                    s[key] = getattr(t, attr)
            # A ${VAR} is substituted before the bridge checks the value: let one stand in for a
            # constrained string too (a sidecar's source name: ${POD_NAME}).
            return {"anyOf": [s, ENV]} if len(s) > 1 else s
        if isinstance(t, mi.DictType):
            return {"type": "object", "additionalProperties": self.type(t.value_type)}
        if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
            return {"type": "array", "items": self.type(t.item_type)}
        if isinstance(t, mi.AnyType):
            return {}
        return {"anyOf": [self.scalar(t), ENV]}

    def scalar(self, t: mi.Type) -> dict[str, Any]:
        """A non-string leaf; the caller lets a ${VAR} stand in for it."""
        if isinstance(t, mi.BoolType):
            return {"type": "boolean"}
        if isinstance(t, mi.NoneType):
            return {"type": "null"}
        if isinstance(t, mi.LiteralType):
            return {"enum": list(t.values)}
        if isinstance(t, mi.IntType | mi.FloatType):
            s: dict[str, Any] = {"type": "integer" if isinstance(t, mi.IntType) else "number"}
            for key, attr in (("minimum", "ge"), ("maximum", "le"), ("exclusiveMinimum", "gt"), ("exclusiveMaximum", "lt")):
                if getattr(t, attr) is not None:
                    s[key] = getattr(t, attr)
            return s
        if isinstance(t, mi.CustomType) and issubclass(t.cls, Duration):
            return DURATION
        if isinstance(t, mi.CustomType) and t.cls is ByteSize:
            return SIZE
        if isinstance(t, mi.CustomType) and t.cls is Secret:
            return {"type": "string", "description": "A secret: give it as ${VAR} so it stays out of values files."}
        raise NotImplementedError(f"no JSON schema for {t!r}")


def config_schema(conv: Converter) -> dict[str, Any]:
    """The bridge's config: Config's fields, with each sink checked by its connector's options."""
    info = mi.type_info(Config)
    assert isinstance(info, mi.StructType)
    schema = conv.struct(info)
    sink = mi.type_info(SinkConfig)
    assert isinstance(sink, mi.StructType)
    common = conv.struct(sink, skip=frozenset({SINK_OPTIONS}))
    common_props = common["properties"]
    assert list(common_props) == sink_common_keys()
    installed = connectors()
    rules = []
    for name, options_cls in installed:
        options = mi.type_info(options_cls)
        assert isinstance(options, mi.StructType)
        own = conv.struct(options)
        rules.append(
            {
                "if": {"properties": {"type": {"const": name}}, "required": ["type"]},
                "then": {
                    "description": own.get("description", f"A {name} sink."),
                    "properties": {**common_props, **own["properties"]},
                    "required": own.get("required", []),
                    "additionalProperties": False,
                },
            }
        )
    schema["properties"]["sinks"] = {
        "description": "Where events go; each entry holds the keys every sink has plus its type's own. "
        f"Built-in types: {', '.join(name for name, _ in installed)}; plugins add more (their keys are not checked here).",
        "type": "array",
        "items": {
            "type": "object",
            "properties": common_props,
            "required": ["type"],
            "allOf": rules,
        },
    }
    # values.yaml's config is merged with the user's, so null is how a user drops a default section.
    for key in ("discovery",):
        schema["properties"][key] = {"anyOf": [schema["properties"][key], {"type": "null"}]}
    return schema


def strings() -> dict[str, Any]:
    return {"type": "object", "additionalProperties": {"type": "string"}}


def obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "additionalProperties": False, **extra}


BOOL = {"type": "boolean"}
STR = {"type": "string"}
OBJECTS = {"type": "array", "items": {"type": "object"}}
DNS_LABEL = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"}
DNS_SUBDOMAIN = {"type": "string", "minLength": 1, "maxLength": 253, "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
QUANTITY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"}
PROM_DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h|d|w|y))+$"}
INT_OR_PERCENT = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%$"}]}


def probe() -> dict[str, Any]:
    positive = {"type": "integer", "minimum": 1}
    return obj({"enabled": BOOL, "periodSeconds": positive, "timeoutSeconds": positive, "failureThreshold": positive})


def values_schema() -> dict[str, Any]:
    conv = Converter()
    config = config_schema(conv)
    properties: dict[str, Any] = {
        "global": {"type": "object", "description": "Helm's global values (from a parent chart)."},
        "mode": {
            "description": "deployment: the bridge's own workload; sidecar: a container snippet for the vLLM pods.",
            "enum": ["deployment", "sidecar"],
        },
        "image": obj(
            {
                "repository": {"type": "string", "minLength": 1},
                "tag": STR,
                "digest": {"type": "string", "pattern": "^(sha256:[a-f0-9]{64})?$"},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            },
            required=["repository"],
        ),
        "imagePullSecrets": {"type": "array", "items": obj({"name": DNS_SUBDOMAIN}, required=["name"])},
        "nameOverride": STR,
        "fullnameOverride": STR,
        "replicas": {
            "description": "1 without sharding; the number of shards with sharding.enabled.",
            "type": "integer",
            "minimum": 1,
            "maximum": 4096,
        },
        "sharding": obj({"enabled": BOOL, "podManagementPolicy": {"enum": ["OrderedReady", "Parallel"]}}),
        "config": {"description": "The bridge's configuration, written verbatim to config.yaml.", **config},
        "secretEnv": {
            "description": "Environment variables from Secret keys, usable as ${NAME} in config.",
            "type": "array",
            "items": obj(
                {
                    "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                    "secretName": DNS_SUBDOMAIN,
                    "key": {"type": "string", "pattern": r"^[-._a-zA-Z0-9]+$"},
                    "optional": BOOL,
                },
                required=["name", "secretName", "key"],
            ),
        },
        "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "envFrom": OBJECTS,
        "checkpoint": obj(
            {
                "mountPath": {"type": "string", "pattern": "^/.+"},
                "persistence": obj(
                    {
                        "enabled": BOOL,
                        "size": QUANTITY,
                        "storageClass": {"type": ["string", "null"]},
                        "accessModes": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"enum": ["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany", "ReadOnlyMany"]},
                        },
                        "existingClaim": STR,
                    }
                ),
            }
        ),
        "resources": {"type": "object"},
        "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
        "probes": obj({"liveness": probe(), "readiness": probe(), "startup": probe()}),
        "podSecurityContext": {"type": "object"},
        "securityContext": {"type": "object"},
        "serviceAccount": obj({"create": BOOL, "name": STR, "annotations": strings()}),
        "podAnnotations": strings(),
        "podLabels": strings(),
        "priorityClassName": STR,
        "nodeSelector": strings(),
        "tolerations": OBJECTS,
        "affinity": {"type": "object"},
        "topologySpreadConstraints": OBJECTS,
        "service": obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "annotations": strings()}),
        "podDisruptionBudget": obj(
            {
                "enabled": BOOL,
                "maxUnavailable": {"anyOf": [INT_OR_PERCENT, {"type": "null"}]},
                "minAvailable": {"anyOf": [INT_OR_PERCENT, {"type": "null"}]},
            }
        ),
        "serviceMonitor": obj(
            {
                "enabled": BOOL,
                "labels": strings(),
                "interval": PROM_DURATION,
                "scrapeTimeout": PROM_DURATION,
                "relabelings": OBJECTS,
                "metricRelabelings": OBJECTS,
            }
        ),
        "prometheusRule": obj(
            {
                "enabled": BOOL,
                "labels": strings(),
                "extraGroups": {"type": "array", "items": {"type": "object", "required": ["name", "rules"]}},
            }
        ),
        "grafanaDashboard": obj({"enabled": BOOL, "labels": strings(), "annotations": strings(), "namespace": STR}),
        "sidecar": obj({"native": BOOL, "containerName": DNS_LABEL, "readiness": BOOL, "podSelector": strings()}),
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kv-event-bridge chart values",
        "description": "Generated by tools/chart_schema.py from the chart's values and the bridge's config structs: "
        "edit that, not this file.",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "$defs": dict(sorted(conv.defs.items())),
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the file is out of date")
    args = p.parse_args()
    shown = str(SCHEMA_PATH.relative_to(ROOT))
    return write_or_check(SCHEMA_PATH, render(), check=args.check, shown=shown, command="python tools/chart_schema.py")


if __name__ == "__main__":
    sys.exit(main())

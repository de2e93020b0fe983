#!/usr/bin/env python3
"""The checks behind scripts/check-manifests (run it, not this: it installs what this needs).

Every YAML manifest of a directory (not its subdirectories) is checked by:
- kubernetes: the pinned PyPI package kubernetes-validate, strict (unknown fields rejected),
  against each Kubernetes version asked for: every kind it has a schema for;
- keda-npm: the validators of the npm package @kubernetes-models/keda (generated from KEDA's Go
  API types): ScaledObjects;
- keda-subset: schemas/scaledobject-keda-v1alpha1.subset.json, hand-written from KEDA v2.20.2's
  CRD and scaler sources, strict where the CRD is open (unknown fields, trigger metadata):
  ScaledObjects;
- kustomize: the Kustomization's resources exist, and `kubectl kustomize` renders the directory
  (when kubectl is installed), its output checked again;
- convoy: what no schema knows: probe ports name a port of their container, `--metrics-addr`
  binds a container port on all interfaces, terminationGracePeriodSeconds exceeds convoy's
  shutdown timeout (flag, CONVOY_ENGINE_SHUTDOWN_TIMEOUT_MS, or the settings file in the
  ConfigMap, whose keys are checked against the facade's settings structs), selectors match the
  pods, a ScaledObject targets a Deployment here and names its group and topic.
A kind no checker has a schema for is an error. `--self-test` checks broken copies instead:
each must be rejected by the checker named for it, or the self-test fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml

REPO = Path(__file__).resolve().parents[2]
SUBSET_SCHEMA = "schemas/scaledobject-keda-v1alpha1.subset.json"
# convoy's defaults (convoy-core/src/config.rs): used when nothing sets them.
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0
DEFAULT_GROUP = "convoy"
# Kubernetes' default terminationGracePeriodSeconds.
DEFAULT_GRACE_S = 30

# kubernetes-validate reads and parses its (large) schema files on every call: once is enough.
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
    kubernetes_validate.utils.schema_contents
)


@dataclass
class Problem:
    checker: str
    file: str
    resource: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: {self.resource}" if self.resource else self.file
        return f"[{self.checker}] {where}: {self.message}"


@dataclass
class Doc:
    file: str
    body: dict

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", "?"))

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name", "?"))

    @property
    def resource(self) -> str:
        return f"{self.kind}/{self.name}" if "metadata" in self.body else self.kind


def load(directory: Path) -> tuple[list[Doc], list[Problem]]:
    docs, problems = [], []
    if not directory.is_dir():
        return docs, [Problem("yaml", str(directory), "", "no such directory")]
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.suffix not in (".yaml", ".yml"):
            continue
        try:
            bodies = [b for b in yaml.safe_load_all(path.read_text()) if b is not None]
        except yaml.YAMLError as e:
            problems.append(Problem("yaml", path.name, "", " ".join(str(e).split())))
            continue
        for body in bodies:
            if not isinstance(body, dict):
                problems.append(Problem("yaml", path.name, "", "a document that is not a mapping"))
            else:
                docs.append(Doc(path.name, body))
    return docs, problems


# ---------------------------------------------------------------------------------- schemas


def kubernetes_checks(docs: list[Doc], versions: list[str]) -> tuple[list[Problem], set[int]]:
    """Problems, and the indices of the documents kubernetes-validate has a schema for."""
    problems, known = [], set()
    for i, doc in enumerate(docs):
        for version in versions:
            try:
                kubernetes_validate.validate(doc.body, version, strict=True)
                known.add(i)
            except kubernetes_validate.SchemaNotFoundError:
                break
            except kubernetes_validate.ValidationError as e:
                known.add(i)
                path = ".".join(str(p) for p in e.path) or "(top)"
                problems.append(
                    Problem(
                        "kubernetes",
                        doc.file,
                        doc.resource,
                        f"Kubernetes {e.version} (strict): {path}: {e.message}",
                    )
                )
                break
    return problems, known


def is_scaled_object(doc: Doc) -> bool:
    return doc.kind == "ScaledObject" and str(doc.body.get("apiVersion", "")).startswith("keda.sh/")


def keda_subset_checks(docs: list[Doc], schema_path: Path) -> list[Problem]:
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    problems = []
    for doc in docs:
        for error in sorted(validator.iter_errors(doc.body), key=lambda e: list(e.absolute_path)):
            path = ".".join(str(p) for p in error.absolute_path) or "(top)"
            problems.append(Problem("keda-subset", doc.file, doc.resource, f"{path}: {error.message}"))
    return problems


def keda_npm_checks(docs: list[Doc], node_modules: Path) -> list[Problem]:
    if not docs:
        return []
    script = Path(__file__).with_name("keda-validate.mjs")
    run = subprocess.run(
        ["node", str(script), str(node_modules)],
        input=json.dumps([d.body for d in docs]),
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise SystemExit(f"check-manifests: the KEDA validator (node) failed:\n{run.stderr.strip()}")
    answers = json.loads(run.stdout)
    return [
        Problem("keda-npm", doc.file, doc.resource, answer)
        for doc, answer in zip(docs, answers)
        if answer is not None
    ]


# ---------------------------------------------------------------------------------- kustomize


def kustomize_checks(directory: Path, docs: list[Doc]) -> tuple[list[Problem], list[Doc] | None]:
    problems = []
    for doc in docs:
        if doc.kind != "Kustomization":
            continue
        for resource in doc.body.get("resources") or []:
            if not (directory / resource).exists():
                problems.append(Problem("kustomize", doc.file, "resources", f"{resource} does not exist"))
    if problems or not any(d.kind == "Kustomization" for d in docs) or not shutil.which("kubectl"):
        return problems, None
    run = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        message = " ".join(run.stderr.split())
        return [Problem("kustomize", "kustomization.yaml", "kubectl kustomize", message)], None
    rendered = [Doc("(kubectl kustomize)", b) for b in yaml.safe_load_all(run.stdout) if b]
    return [], rendered


# ---------------------------------------------------------------------------------- convoy


def struct_fields(source: Path, struct: str) -> set[str] | None:
    """The `pub` field names of a Rust struct, as serde reads them (no renames there)."""
    try:
        text = source.read_text()
    except OSError:
        return None
    match = re.search(r"pub struct " + struct + r" \{(.*?)\n\}", text, re.S)
    return set(re.findall(r"^\s*pub (\w+):", match.group(1), re.M)) if match else None


def settings_problems(settings: dict) -> list[str]:
    """Keys of convoy's settings file that the facade (deny_unknown_fields) would refuse."""
    facade = REPO / "convoy" / "src"
    tables = [
        ("", settings, struct_fields(facade / "settings.rs", "ConnectConfig")),
        ("engine.", settings.get("engine") or {}, struct_fields(facade / "engine_settings.rs", "EngineSettings")),
        (
            "engine.retry.",
            (settings.get("engine") or {}).get("retry") or {},
            struct_fields(facade / "engine_settings.rs", "RetrySettings"),
        ),
        (
            "engine.back_pressure.",
            (settings.get("engine") or {}).get("back_pressure") or {},
            struct_fields(facade / "engine_settings.rs", "BackPressureSettings"),
        ),
    ]
    out = []
    for prefix, table, fields in tables:
        if fields is None:
            continue
        out += [f"unknown setting {prefix}{key}" for key in table if key not in fields]
    engine = settings.get("engine") or {}
    for key, least in (("shutdown_timeout_ms", 1000), ("drain_timeout_ms", 1)):
        value = engine.get(key)
        if value is not None and (not isinstance(value, int) or value < least):
            out.append(f"engine.{key} must be a whole number >= {least}, got {value!r}")
    return out


def exported_metrics() -> set[str] | None:
    """The metric names convoy-core/src/metrics.rs defines, with a histogram's series names."""
    try:
        text = (REPO / "convoy-core" / "src" / "metrics.rs").read_text()
    except OSError:
        return None
    names = set(re.findall(r'"(convoy_[a-z0-9_]+)"', text))
    return names | {n + suffix for n in names for suffix in ("_bucket", "_sum", "_count")}


def flag(argv: list[str], name: str) -> list[str]:
    """Every value given to --name (as `--name V` or `--name=V`)."""
    values = []
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(name + "="):
            values.append(arg.split("=", 1)[1])
    return values


def literal_env(container: dict, name: str) -> str | None:
    for env in container.get("env") or []:
        if env.get("name") == name and "value" in env:
            return str(env["value"])
    return None


def url_param(url: str | None, name: str) -> str | None:
    if not url or "?" not in url:
        return None
    for pair in url.split("?", 1)[1].split("&"):
        key, _, value = pair.partition("=")
        if key == name:
            return value
    return None


def settings_file(
    argv: list[str], container: dict, pod: dict, configmaps: dict[str, dict]
) -> tuple[dict | None, str | None, str | None]:
    """convoy's settings file as mounted from a ConfigMap: (settings, where, error)."""
    paths = flag(argv, "--config")
    if not paths:
        return None, None, None
    path = paths[-1]
    for mount in container.get("volumeMounts") or []:
        root = mount["mountPath"].rstrip("/") + "/"
        if not (path + "/").startswith(root):
            continue
        volume = next((v for v in pod.get("volumes") or [] if v.get("name") == mount["name"]), None)
        if not volume or "configMap" not in volume:
            return None, None, None
        name = volume["configMap"].get("name")
        relative = mount.get("subPath") or path[len(root):]
        key = relative
        for item in volume["configMap"].get("items") or []:
            if item.get("path") == relative:
                key = item.get("key")
        data = (configmaps.get(name) or {}).get(key)
        where = f"ConfigMap/{name} key {key}"
        if data is None:
            return None, where, f"--config {path}: {where} is not among these manifests"
        try:
            return tomllib.loads(data), where, None
        except tomllib.TOMLDecodeError as e:
            return None, where, f"{where} is not valid TOML: {e}"
    return None, None, None


def split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def pod_templates(docs: list[Doc]):
    for doc in docs:
        if doc.kind in ("Deployment", "StatefulSet", "DaemonSet"):
            template = ((doc.body.get("spec") or {}).get("template")) or {}
            yield doc, template


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def convoy_checks(docs: list[Doc]) -> list[Problem]:
    problems: list[Problem] = []
    configmaps = {d.name: d.body.get("data") or {} for d in docs if d.kind == "ConfigMap"}
    consumers: dict[str, dict] = {}  # Deployment name -> {"group": ..., "topics": [...]}
    pods = list(pod_templates(docs))
    for doc, template in pods:
        pod = template.get("spec") or {}
        grace = pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
        for container in pod.get("containers") or []:
            say = lambda message: problems.append(  # noqa: E731
                Problem("convoy", doc.file, f"{doc.resource} container {container.get('name')}", message)
            )
            ports = container.get("ports") or []
            names = {p.get("name"): p.get("containerPort") for p in ports if p.get("name")}
            numbers = {p.get("containerPort") for p in ports}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                action = (container.get(probe) or {}).get("httpGet") or (container.get(probe) or {}).get("tcpSocket")
                if not action or "port" not in action:
                    continue
                port = action["port"]
                if isinstance(port, str) and port.isdigit():
                    say(f"{probe} port {port!r}: a number in quotes is neither a port number nor a port name")
                elif isinstance(port, str) and port not in names:
                    say(f"{probe} port {port!r} names no port of the container (named: {', '.join(sorted(names)) or 'none'})")
                elif not isinstance(port, str) and port not in numbers:
                    say(f"{probe} port {port} is no containerPort of the container")
            argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
            if "consume" not in argv:
                continue
            addrs = flag(argv, "--metrics-addr")
            probed = any(container.get(p) for p in ("startupProbe", "livenessProbe", "readinessProbe"))
            if probed and not addrs:
                say("probes without --metrics-addr: `convoy consume` serves /healthz and /readyz only with it")
            for addr in addrs:
                host, _, port = addr.rpartition(":")
                if host.strip("[]") in ("127.0.0.1", "localhost", "::1"):
                    say(f"--metrics-addr {addr} binds loopback: the kubelet's probes and Prometheus come to the pod's IP (use 0.0.0.0:{port})")
                if not port.isdigit() or int(port) not in numbers:
                    say(f"--metrics-addr {addr}: port {port} is no containerPort of the container")
            settings, where, error = settings_file(argv, container, pod, configmaps)
            if error:
                say(error)
            for message in settings_problems(settings or {}):
                say(f"{where}: {message}")
            engine = (settings or {}).get("engine") or {}
            if flag(argv, "--shutdown-timeout-s"):
                shutdown, source = float(flag(argv, "--shutdown-timeout-s")[-1]), "--shutdown-timeout-s"
            elif literal_env(container, "CONVOY_ENGINE_SHUTDOWN_TIMEOUT_MS") is not None:
                shutdown = float(literal_env(container, "CONVOY_ENGINE_SHUTDOWN_TIMEOUT_MS")) / 1000
                source = "CONVOY_ENGINE_SHUTDOWN_TIMEOUT_MS"
            elif isinstance(engine.get("shutdown_timeout_ms"), int):
                shutdown, source = engine["shutdown_timeout_ms"] / 1000, f"{where} [engine] shutdown_timeout_ms"
            else:
                shutdown, source = DEFAULT_SHUTDOWN_TIMEOUT_S, "convoy's default"
            if not isinstance(grace, int) or grace <= shutdown:
                say(
                    f"terminationGracePeriodSeconds {grace} must exceed convoy's shutdown timeout "
                    f"({shutdown:g} s, {source}): the kubelet's SIGKILL would cut the final commit"
                )
            # Where convoy takes the group and topics from: flags (and --url's parameters), then
            # CONVOY_* variables, then the settings file (its fields, then its url's parameters).
            flag_url = (flag(argv, "--url") or [None])[-1]
            env_url = literal_env(container, "CONVOY_URL")
            file_url = (settings or {}).get("url")
            group = (
                (flag(argv, "--group") or [None])[-1]
                or url_param(flag_url, "group")
                or literal_env(container, "CONVOY_GROUP")
                or url_param(env_url, "group")
                or (settings or {}).get("group")
                or url_param(file_url, "group")
                or DEFAULT_GROUP
            )
            topics = (
                flag(argv, "--topic")
                or split(url_param(flag_url, "topics"))
                or split(literal_env(container, "CONVOY_TOPICS"))
                or split(url_param(env_url, "topics"))
                or list((settings or {}).get("topics") or [])
                or split(url_param(file_url, "topics"))
            )
            # Variables from a Secret or a ConfigMap (valueFrom, envFrom) cannot be read here.
            hidden = bool(container.get("envFrom")) or any(
                e.get("name") in ("CONVOY_URL", "CONVOY_GROUP", "CONVOY_TOPICS") and "value" not in e
                for e in container.get("env") or []
            )
            if doc.kind == "Deployment" and not hidden:
                consumers[doc.name] = {"group": group, "topics": topics}
    for doc in docs:
        spec = doc.body.get("spec") or {}
        if doc.kind == "Service" and spec.get("selector"):
            matching = [t for _, t in pods if selects(spec["selector"], (t.get("metadata") or {}).get("labels") or {})]
            if not matching:
                problems.append(Problem("convoy", doc.file, doc.resource, "its selector matches no pod template here"))
            for port in spec.get("ports") or []:
                target = port.get("targetPort")
                if isinstance(target, str) and not target.isdigit():
                    named = {
                        p.get("name")
                        for t in matching
                        for c in (t.get("spec") or {}).get("containers") or []
                        for p in c.get("ports") or []
                    }
                    if matching and target not in named:
                        problems.append(Problem("convoy", doc.file, doc.resource, f"targetPort {target!r} names no container port of its pods"))
        if doc.kind == "PodDisruptionBudget":
            selector = (spec.get("selector") or {}).get("matchLabels") or {}
            if not any(selects(selector, (t.get("metadata") or {}).get("labels") or {}) for _, t in pods):
                problems.append(Problem("convoy", doc.file, doc.resource, "its selector matches no pod template here"))
        if is_scaled_object(doc):
            target = spec.get("scaleTargetRef") or {}
            kind = target.get("kind", "Deployment")
            if not any(d.kind == kind and d.name == target.get("name") for d in docs):
                problems.append(Problem("convoy", doc.file, doc.resource, f"scaleTargetRef names {kind}/{target.get('name')}, which is not among these manifests"))
            least, most = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
            if isinstance(least, int) and isinstance(most, int) and least > most:
                problems.append(Problem("convoy", doc.file, doc.resource, f"minReplicaCount {least} > maxReplicaCount {most}"))
            consumer = consumers.get(target.get("name")) if kind == "Deployment" else None
            for trigger in spec.get("triggers") or []:
                metadata = trigger.get("metadata") or {}
                if not consumer or not isinstance(metadata, dict):
                    continue
                if trigger.get("type") == "kafka":
                    group = metadata.get("consumerGroup")
                    if group is not None and group != consumer["group"]:
                        problems.append(Problem("convoy", doc.file, doc.resource, f"kafka trigger: consumerGroup {group!r}, but the Deployment consumes as group {consumer['group']!r}"))
                    topic = metadata.get("topic")
                    if topic is not None and consumer["topics"] and topic not in consumer["topics"]:
                        problems.append(Problem("convoy", doc.file, doc.resource, f"kafka trigger: topic {topic!r} is not one the Deployment consumes ({', '.join(consumer['topics'])})"))
                if trigger.get("type") == "prometheus":
                    query = str(metadata.get("query", ""))
                    known = exported_metrics()
                    for name in sorted(set(re.findall(r"\bconvoy_[a-z0-9_]+", query))):
                        if known is not None and name not in known:
                            problems.append(Problem("convoy", doc.file, doc.resource, f"prometheus trigger: convoy exports no metric {name} (convoy-core/src/metrics.rs)"))
                    named = re.search(r'\bgroup\s*=\s*"([^"]*)"', query)
                    if named and named.group(1) != consumer["group"]:
                        problems.append(Problem("convoy", doc.file, doc.resource, f"prometheus trigger: the query selects group {named.group(1)!r}, but the Deployment consumes as group {consumer['group']!r}"))
    return problems


# ---------------------------------------------------------------------------------- the run


def check(directory: Path, versions: list[str], node_modules: Path | None, quiet: bool) -> list[Problem]:
    docs, problems = load(directory)
    kube, known = kubernetes_checks(docs, versions)
    problems += kube
    scaled = [d for d in docs if is_scaled_object(d)]
    schema = directory / SUBSET_SCHEMA
    if scaled:
        if not schema.exists():
            schema = REPO / "deploy" / "kubernetes" / SUBSET_SCHEMA
        problems += keda_subset_checks(scaled, schema)
        if node_modules is not None:
            problems += keda_npm_checks(scaled, node_modules)
    kustomize, rendered = kustomize_checks(directory, docs)
    problems += kustomize
    for i, doc in enumerate(docs):
        if i not in known and not is_scaled_object(doc) and doc.kind != "Kustomization":
            problems.append(Problem("schema", doc.file, doc.resource, f"no schema for {doc.body.get('apiVersion')} {doc.kind}"))
    problems += convoy_checks(docs)
    if rendered is not None:
        again, _ = kubernetes_checks(rendered, versions[-1:])
        again += keda_subset_checks([d for d in rendered if is_scaled_object(d)], schema) if scaled else []
        # What the files themselves had is said once.
        said = {(p.checker, p.resource, p.message.split(": ", 1)[-1]) for p in problems}
        problems += [p for p in again if (p.checker, p.resource, p.message.split(": ", 1)[-1]) not in said]
    unique = {}
    for problem in problems:
        unique.setdefault(str(problem), problem)
    problems = list(unique.values())
    if not quiet:
        failing = {p.file for p in problems}
        for doc in docs:
            if doc.file in failing:
                continue
            if doc.kind == "Kustomization":
                how = "resources exist" + (
                    f", `kubectl kustomize` renders {len(rendered)} objects, checked again" if rendered is not None
                    else " (kubectl not installed: not rendered)"
                )
            elif is_scaled_object(doc):
                how = "keda-subset" + (", keda-npm" if node_modules is not None else "") + ", convoy"
            else:
                how = f"kubernetes {' and '.join(versions)} strict, convoy"
            print(f"ok    {doc.file}: {doc.resource} ({how})")
    return problems


# ---------------------------------------------------------------------------------- self-test


def edit(directory: Path, file: str, change) -> None:
    path = directory / file
    bodies = [b for b in yaml.safe_load_all(path.read_text()) if b is not None]
    change(bodies[0])
    path.write_text(yaml.safe_dump_all(bodies, sort_keys=False))


def container(body: dict) -> dict:
    return body["spec"]["template"]["spec"]["containers"][0]


def cases():
    """(what, file, change, the checker that must reject it)."""

    def probe_port_unnamed(b):
        container(b)["readinessProbe"]["httpGet"]["port"] = "metric"

    def probe_port_missing(b):
        del container(b)["livenessProbe"]["httpGet"]["port"]

    def field_misspelt(b):
        b["spec"]["template"]["spec"]["terminationGracePeriod"] = 40

    def grace_too_short(b):
        b["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 20

    def metrics_on_loopback(b):
        args = container(b)["args"]
        args[args.index("--metrics-addr") + 1] = "127.0.0.1:9898"

    def setting_unknown(b):
        b["data"]["convoy.toml"] += "\n[engine.retry]\nmax_attempt = 3\n"

    def lag_threshold_number(b):
        b["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 1000

    def replicas_misspelt(b):
        b["spec"]["minReplicas"] = b["spec"].pop("minReplicaCount")

    def kafka_group_other(b):
        b["spec"]["triggers"][0]["metadata"]["consumerGroup"] = "payments"

    def metric_unknown(b):
        query = b["spec"]["triggers"][0]["metadata"]["query"]
        b["spec"]["triggers"][0]["metadata"]["query"] = query.replace("convoy_source_lag", "convoy_lag")

    def resource_missing(b):
        b["resources"].append("networkpolicy.yaml")

    return [
        ("a probe port names no container port", "deployment.yaml", probe_port_unnamed, "convoy"),
        ("a probe without its port", "deployment.yaml", probe_port_missing, "kubernetes"),
        ("a misspelt field (terminationGracePeriod)", "deployment.yaml", field_misspelt, "kubernetes"),
        ("a grace period below the shutdown timeout", "deployment.yaml", grace_too_short, "convoy"),
        ("--metrics-addr on 127.0.0.1", "deployment.yaml", metrics_on_loopback, "convoy"),
        ("an unknown key in convoy's settings", "configmap.yaml", setting_unknown, "convoy"),
        ("lagThreshold as a number, not a string", "scaledobject-kafka.yaml", lag_threshold_number, "keda-npm"),
        ("lagThreshold as a number (subset schema)", "scaledobject-kafka.yaml", lag_threshold_number, "keda-subset"),
        ("a misspelt ScaledObject field (minReplicas)", "scaledobject-kafka.yaml", replicas_misspelt, "keda-subset"),
        ("a Kafka trigger on another group", "scaledobject-kafka.yaml", kafka_group_other, "convoy"),
        ("a Prometheus query on a metric convoy does not export", "scaledobject-prometheus.yaml", metric_unknown, "convoy"),
        ("a Kustomization resource that does not exist", "kustomization.yaml", resource_missing, "kustomize"),
    ]


def self_test(directory: Path, versions: list[str], node_modules: Path | None) -> int:
    failures = 0
    with tempfile.TemporaryDirectory(prefix="check-manifests-") as scratch:
        for number, (what, file, change, checker) in enumerate(cases()):
            if checker == "keda-npm" and node_modules is None:
                continue
            copy_dir = Path(scratch) / f"case-{number}"
            shutil.copytree(directory, copy_dir)
            edit(copy_dir, file, change)
            problems = check(copy_dir, versions[-1:], node_modules, quiet=True)
            caught = [p for p in problems if p.checker == checker]
            if caught:
                message = str(caught[0])
                print(f"      rejected: {what}: {message[:160]}{'…' if len(message) > 160 else ''}")
            else:
                failures += 1
                others = "; ".join(str(p) for p in problems) or "accepted by every checker"
                print(f"FAIL  self-test: {what} ({file}) was not rejected by [{checker}]: {others}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--kubernetes", default="1.30,1.37", help="versions, comma-separated (oldest first)")
    parser.add_argument("--keda-node-modules", type=Path, help="node_modules with @kubernetes-models/keda")
    parser.add_argument("--self-test", action="store_true", help="check broken copies instead")
    args = parser.parse_args()
    versions = [v.strip() for v in args.kubernetes.split(",") if v.strip()]
    if args.self_test:
        print(f"self-test: broken copies of {args.directory} must each be rejected by the named check")
        failures = self_test(args.directory, versions, args.keda_node_modules)
        print("self-test: " + ("passed" if not failures else f"{failures} broken copies were accepted"))
        return 1 if failures else 0
    problems = check(args.directory, versions, args.keda_node_modules, quiet=False)
    for problem in problems:
        print(f"FAIL  {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

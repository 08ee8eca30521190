"""The Kubernetes deployment (deploy/, Dockerfile, docs/deploy.md) checked against the code:
the flags parse with the real parsers, the ports agree, the metrics are ones the broker
exports. Fast: files are parsed, nothing is started and nothing leaves the process."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import pathlib
import re
import shlex
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import pytest
import yaml

import zloader
from zloader import cli
from zloader._host import loopback
from zloader.transport.keys import keygen
from zloader.worker import DRAIN_SECONDS

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
ADAPTER_VALUES = ROOT / "deploy" / "prometheus-adapter" / "values.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCS = ROOT / "docs" / "deploy.md"
KEDA_FILE = "worker-keda.yaml"
BROKER, WORKER, SERVICE = "zloader-broker", "zloader-worker", "zloader-broker"
METRIC_NAME = re.compile(r"\bzloader_[a-z0-9_]+\b")

# Flags of other tools that docs/deploy.md uses (kubectl, docker, helm); every other
# --flag it names must be one of zloader's.
OTHER_TOOLS_FLAGS = {"--from-file", "--build-arg", "--install", "--reuse-values",
                     "--raw", "--horizontal-pod-autoscaler-tolerance"}


# --- reading the files ---------------------------------------------------------------------

@functools.cache
def manifests() -> tuple[tuple[pathlib.Path, dict[str, Any]], ...]:
    """Every YAML document under deploy/k8s, with its file."""
    out = []
    for path in sorted(K8S.rglob("*.y*ml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                out.append((path, document))
    return tuple(out)


def the(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in manifests() if d.get("kind") == kind
             and d.get("metadata", {}).get("name") == name]
    assert len(found) == 1, f"expected one {kind} named {name} in deploy/k8s, found {len(found)}"
    return found[0]


def container(deployment: str, name: str | None = None, init: bool = False) -> dict[str, Any]:
    """The (only, or named) container of a Deployment's pod."""
    spec = the("Deployment", deployment)["spec"]["template"]["spec"]
    containers = spec.get("initContainers" if init else "containers", [])
    if name is not None:
        containers = [c for c in containers if c["name"] == name]
    assert len(containers) == 1, f"{deployment}: expected one container, got {containers}"
    return containers[0]


def argv(c: dict[str, Any]) -> list[str]:
    """What follows the program: the rest of `command` and `args`."""
    return [str(a) for a in [*c["command"][1:], *c.get("args", [])]]


def volume(deployment: str, name: str) -> dict[str, Any]:
    volumes = the("Deployment", deployment)["spec"]["template"]["spec"]["volumes"]
    found = [v for v in volumes if v["name"] == name]
    assert len(found) == 1, f"{deployment}: no volume {name}"
    return found[0]


def volume_at(deployment: str, c: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume whose mount in container ``c`` holds ``path`` (the deepest mount)."""
    mounts = [m for m in c.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{deployment}/{c['name']}: nothing is mounted at {path}"
    deepest = max(mounts, key=lambda m: len(m["mountPath"]))
    return volume(deployment, deepest["name"])


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("1", "500m", "3Gi") as a number."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "k": 1e3,
             "M": 1e6, "G": 1e9}
    text = str(value)
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def port_number(c: dict[str, Any], port: str | int) -> int:
    """A probe's or a Service's target port, by name or number, as declared by ``c``."""
    declared = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    if isinstance(port, int):
        assert port in declared.values(), f"{c['name']} declares no port {port}"
        return port
    assert port in declared, f"{c['name']} declares no port named {port}"
    return int(declared[port])


def address_port(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` as (HOST, PORT)."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    return host, int(port)


# --- the real parsers ----------------------------------------------------------------------

class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@functools.cache
def real_parser(entry: Callable[[Sequence[str] | None], int]) -> argparse.ArgumentParser:
    """The parser that ``zloader-broker`` or ``zloader-worker`` builds. Both build it inside
    their main function and parse at once; here parse_args hands the parser back before
    any argument is read, so nothing else of the command runs."""
    def hand_back(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", hand_back):
        try:
            entry([])
        except _Captured as captured:
            return captured.parser
    raise AssertionError(f"{entry.__name__} returned without parsing arguments")


def parsed(deployment: str) -> argparse.Namespace:
    """The main container's arguments, parsed by its command's real parser."""
    c = container(deployment)
    entries = {"zloader-broker": cli.broker_main, "zloader-worker": cli.worker_main}
    program = c["command"][0]
    assert program in entries, f"{deployment} runs {program!r}, not a zloader command"
    parser = real_parser(entries[program])
    try:
        return parser.parse_args(argv(c))
    except SystemExit:
        pytest.fail(f"{program} {shlex.join(argv(c))}: its parser refuses these arguments")


def zloader_flags() -> set[str]:
    """Every option string of zloader-broker, zloader-worker and zloader's subcommands."""
    parsers = [real_parser(cli.broker_main), real_parser(cli.worker_main), cli.build_parser()]
    for action in parsers[-1]._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += list(action.choices.values())
    return {option for p in parsers for option in p._option_string_actions}


@functools.cache
def exported_metrics() -> frozenset[str]:
    """The sample names a scrape of the broker returns: the broker's own collector, fed
    one job and one worker, rendered by prometheus_client (counters gain ``_total``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from zloader.broker import metrics

    snapshot = {"jobs": [{"job": "j", "name": "n", "stages": {"pipeline": 1.0}}],
                "workers": [{"worker": "w", "host": "h", "job": "j"}], "rejected": 0}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics._Snapshot(lambda: snapshot))
    text = generate_latest(registry).decode()
    return frozenset(re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines()
                     if line and not line.startswith("#"))


def adapter_rule() -> dict[str, Any]:
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["external"]
    assert len(rules) == 1, "expected the one external rule of zloader"
    return dict(rules[0])


# --- the manifests -------------------------------------------------------------------------

def test_every_manifest_is_a_named_kubernetes_object() -> None:
    kinds = set()
    for path, document in manifests():
        where = path.relative_to(ROOT)
        assert isinstance(document.get("apiVersion"), str) and document["apiVersion"], where
        assert isinstance(document.get("kind"), str) and document["kind"], where
        name = document.get("metadata", {}).get("name")
        assert isinstance(name, str) and name, f"{where}: {document['kind']} has no name"
        kinds.add(document["kind"])
    assert {"Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler",
            "ScaledObject", "Kustomization"} <= kinds


K8S_VERSIONS = ("1.30", "1.33", "1.37")
"""Kubernetes versions the manifests are checked against (kubernetes-validate's schemas,
offline): the oldest supported release the issue names, one between, and the newest."""


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_kubernetes_schemas(version: str) -> None:
    """Each core object against the official OpenAPI schema of ``version``, strictly (a
    field the API does not know fails). KEDA's ScaledObject and the kustomization are not
    Kubernetes API objects: no schema ships for them (they are checked by name and shape
    above and in the KEDA test below)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")  # (the test extra)
    checked = set()
    for path, document in manifests():
        if document["kind"] in ("ScaledObject", "Kustomization"):
            continue
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(ROOT)}: {document['kind']} is not valid for "
                        f"Kubernetes {version}: {exc.message} at "
                        f"{'/'.join(map(str, exc.absolute_path))}")
        checked.add(document["kind"])
    assert checked == {"Deployment", "Service", "PersistentVolumeClaim",
                       "HorizontalPodAutoscaler"}


def test_broker_and_worker_arguments_parse_with_the_real_parsers() -> None:
    for deployment in (BROKER, WORKER):
        parsed(deployment)
        c = container(deployment)
        parser = real_parser(cli.broker_main if deployment == BROKER else cli.worker_main)
        for flag in (a.split("=")[0] for a in argv(c) if a.startswith("--")):
            action = parser._option_string_actions.get(flag)
            assert action is not None, f"{deployment}: {flag} is not a flag"
            assert action.help != argparse.SUPPRESS, \
                f"{deployment}: {flag} is an internal flag, not for deployments"


def test_broker_and_workers_beyond_loopback_have_keys_and_not_insecure() -> None:
    broker, worker = parsed(BROKER), parsed(WORKER)
    assert not loopback(broker.bind), "the broker must accept other pods"
    assert broker.keys and not broker.insecure
    assert worker.advertise and not loopback(f"tcp://{worker.advertise}:0")
    assert worker.keys == broker.keys and not worker.insecure


def test_container_variables_are_defined_in_its_env() -> None:
    for deployment in (BROKER, WORKER):
        spec = the("Deployment", deployment)["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            defined = {e["name"] for e in c.get("env", [])}
            used = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                  " ".join([*c["command"], *c.get("args", [])])))
            assert used <= defined, f"{deployment}/{c['name']}: {used - defined} undefined"


def test_workers_advertise_their_pod_ip() -> None:
    assert parsed(WORKER).advertise == "$(POD_IP)"
    env = {e["name"]: e for e in container(WORKER).get("env", [])}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_service_exposes_the_brokers_control_and_metrics_ports() -> None:
    broker, c = parsed(BROKER), container(BROKER)
    service = the("Service", SERVICE)
    labels = the("Deployment", BROKER)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    bind_port = address_port(broker.bind)[1]
    for wanted in (bind_port, broker.metrics_port):
        assert wanted in ports, f"the Service does not expose port {wanted}"
        target = ports[wanted].get("targetPort", wanted)
        assert port_number(c, target) == wanted, f"Service port {wanted} reaches {target}"
    assert not loopback(f"tcp://{broker.metrics_bind}:0"), \
        "--metrics-bind must accept the scraper's connections"


def test_workers_reach_the_broker_through_the_service() -> None:
    host, port = address_port(parsed(WORKER).broker)
    service = the("Service", SERVICE)
    assert host == service["metadata"]["name"]
    assert port in {p["port"] for p in service["spec"]["ports"]}
    assert port == address_port(parsed(BROKER).bind)[1]


def test_the_broker_pod_alone_is_annotated_for_scraping_on_its_metrics_port() -> None:
    annotations = the("Deployment", BROKER)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(parsed(BROKER).metrics_port)
    service_annotations = the("Service", SERVICE)["metadata"].get("annotations", {})
    assert not any(k.startswith("prometheus.io/") for k in service_annotations), \
        "annotating the Service too makes Prometheus scrape the broker twice"


def test_broker_probes_use_declared_ports() -> None:
    c = container(BROKER)
    for probe in ("readinessProbe", "livenessProbe"):
        check = c[probe].get("httpGet") or c[probe].get("tcpSocket")
        assert check is not None, f"{probe}: neither httpGet nor tcpSocket"
        port_number(c, check["port"])


def test_the_broker_is_one_recreated_replica_with_its_work_dir_on_the_claim() -> None:
    spec = the("Deployment", BROKER)["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"
    work = volume_at(BROKER, container(BROKER), parsed(BROKER).work_dir)
    claim = the("PersistentVolumeClaim", work["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_keys_init_containers_build_the_directory_keygen_makes(tmp_path: pathlib.Path) -> None:
    made = keygen(tmp_path / "keys")
    files = sorted(str(p.relative_to(made.path)) for p in pathlib.Path(made.path).rglob("*")
                   if p.is_file())
    assert "authorized/client.key" in files
    for deployment in (BROKER, WORKER):
        init, main = container(deployment, "keys", init=True), container(deployment)
        script = init["command"][-1]
        destination = re.search(r"^\s*dst=(\S+)$", script, re.MULTILINE)
        assert destination is not None, f"{deployment}: the keys script sets no dst"
        assert destination.group(1) == parsed(deployment).keys
        copied = re.search(r"for name in ([^;]+);", script)
        assert copied is not None, f"{deployment}: the keys script copies no files"
        for name in files:
            assert name in copied.group(1).split() or f'"$dst/{name}"' in script, \
                f"{deployment}: the keys script does not make {name}"
        assert "install -d -m 700" in script, "zloader refuses a keys directory open to others"
        # The directory the main container reads is the one the init container wrote.
        keys_volume = volume_at(deployment, main, parsed(deployment).keys)
        assert volume_at(deployment, init, destination.group(1)) == keys_volume
        assert keys_volume["emptyDir"]["medium"] == "Memory"
        source = re.search(r"^\s*src=(\S+)$", script, re.MULTILINE)
        assert source is not None
        assert volume_at(deployment, init, source.group(1))["secret"]["secretName"] \
            == "zloader-keys"


def test_worker_dev_shm_is_a_memory_backed_empty_dir_within_the_memory_limit() -> None:
    c = container(WORKER)
    shm = volume_at(WORKER, c, "/dev/shm")
    assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    assert shm["emptyDir"]["medium"] == "Memory"
    size = quantity(shm["emptyDir"]["sizeLimit"])
    assert size > 64 * 2**20, "no larger than a container's default /dev/shm"
    assert quantity(c["resources"]["limits"]["memory"]) > size


def test_workers_drain_within_the_grace_period() -> None:
    spec = the("Deployment", WORKER)["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > DRAIN_SECONDS
    # The exec form: zloader-worker itself receives SIGTERM (a shell would swallow it).
    assert container(WORKER)["command"][0] == "zloader-worker"


def test_no_pod_gets_a_service_account_token() -> None:
    # Workers run code sent by any key holder; neither they nor the broker call the API.
    for name in (BROKER, WORKER):
        assert the("Deployment", name)["spec"]["template"]["spec"][
            "automountServiceAccountToken"] is False, name


def test_a_worker_pod_is_one_worker_process_on_one_core() -> None:
    worker = parsed(WORKER)
    assert worker.processes == 1
    assert not getattr(worker, "autoscale", False), "--autoscale would fight the HPA"
    assert quantity(container(WORKER)["resources"]["requests"]["cpu"]) == 1.0
    assert "replicas" not in the("Deployment", WORKER)["spec"], \
        "the autoscaler owns the worker count"


# --- autoscaling ---------------------------------------------------------------------------

def assert_prompt(behavior: dict[str, Any], what: str) -> None:
    """The broker gives up a step that is not carried out in time (a removal after
    DRAIN_SECONDS): a stabilization window, 300 s on scale-down unless set, must not hold
    the autoscaler back that long."""
    for direction in ("scaleUp", "scaleDown"):
        window = behavior[direction]["stabilizationWindowSeconds"]
        assert window < DRAIN_SECONDS, f"{what}: {direction} waits {window} s"


def test_the_adapter_rule_sums_desired_workers_from_exported_metrics() -> None:
    rule, exported = adapter_rule(), exported_metrics()
    series = re.search(r'__name__="([^"]+)"', rule["seriesQuery"])
    assert series is not None and series.group(1) in exported
    assert re.fullmatch(rule["name"]["matches"], series.group(1))
    query = rule["metricsQuery"].replace("<<.Series>>", series.group(1))
    assert query.startswith("sum(zloader_job_desired_workers")
    used = set(METRIC_NAME.findall(query))
    assert "zloader_job_desired_workers" in used and used <= exported, used - exported


def test_the_hpa_sets_the_worker_count_to_the_adapters_metric() -> None:
    hpa = the("HorizontalPodAutoscaler", WORKER)
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": the("Deployment", WORKER)["metadata"]["name"]}
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == adapter_rule()["name"]["as"]
    # AverageValue 1: replicas = the metric. A Value target would scale the current count.
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert_prompt(spec["behavior"], "the HPA")


def test_the_keda_alternative_queries_exported_metrics_for_the_same_deployment() -> None:
    scaled = the("ScaledObject", WORKER)
    assert scaled["spec"]["scaleTargetRef"]["name"] == WORKER
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    assert_prompt(scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
                  "the ScaledObject")
    query = trigger["metadata"]["query"]
    assert query.startswith("sum(zloader_job_desired_workers")
    used = set(METRIC_NAME.findall(query))
    assert "zloader_job_desired_workers" in used
    assert used <= exported_metrics(), used - exported_metrics()
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert query.count(f'namespace="{namespace}"') == len(METRIC_NAME.findall(query))


def test_the_kustomization_lists_existing_files_and_leaves_keda_out() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists {name}, which is missing"
    assert KEDA_FILE not in listed, "the HPA and KEDA must not both scale the workers"
    assert (K8S / KEDA_FILE).is_file()
    others = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", KEDA_FILE}
    assert others == set(listed), f"not listed: {others - set(listed)}"
    images = {i["name"] for i in kustomization["images"]}
    for deployment in (BROKER, WORKER):
        spec = the("Deployment", deployment)["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert c["image"] in images, f"{deployment}/{c['name']}: image not mapped"


# --- the image -----------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines()
             if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def test_the_dockerfile_installs_the_package_and_exposes_the_manifests_ports() -> None:
    instructions = dockerfile_instructions()
    assert any(i == "FROM" and args.startswith("python:") for i, args in instructions)
    copied = " ".join(args for i, args in instructions if i == "COPY")
    for needed in ("setup.cfg", "setup.py", "pyproject.toml", "zloader"):
        assert needed in copied.split(), f"the Dockerfile does not copy {needed}"
    assert any(i == "RUN" and re.search(r"\bpip install (\S+ )*\.(\s|$)", args)
               for i, args in instructions), "no `pip install .`"
    exposed = {int(p.split("/")[0]) for i, args in instructions if i == "EXPOSE"
               for p in args.split()}
    broker, c = parsed(BROKER), container(BROKER)
    assert {address_port(broker.bind)[1], broker.metrics_port} <= exposed
    assert {p["containerPort"] for p in c["ports"]} <= exposed
    users = [args for i, args in instructions if i == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0
    for deployment in (BROKER, WORKER):
        context = the("Deployment", deployment)["spec"]["template"]["spec"]["securityContext"]
        assert context["runAsUser"] == int(users[-1].split(":")[0])
        assert context["runAsNonRoot"] is True


def test_the_dockerignore_keeps_the_virtual_environment_and_git_out() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git"} <= ignored
    copied = {word for i, args in dockerfile_instructions() if i == "COPY"
              for word in args.split()[:-1]}
    assert not copied & ignored, f"the Dockerfile copies ignored paths: {copied & ignored}"


# --- the docs ------------------------------------------------------------------------------

def test_the_docs_name_only_flags_metrics_and_arguments_that_exist() -> None:
    text = DOCS.read_text()
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    unknown = flags - zloader_flags() - OTHER_TOOLS_FLAGS
    assert not unknown, f"docs/deploy.md names flags no zloader command has: {unknown}"
    metrics = set(METRIC_NAME.findall(text)) - {adapter_rule()["name"]["as"]}
    assert metrics, "the docs name no metric"
    assert metrics <= exported_metrics(), metrics - exported_metrics()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert blocks
    loader_args = set(inspect.signature(zloader.Loader).parameters)
    calls = [node for block in blocks for node in ast.walk(ast.parse(block))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Loader"]
    assert calls, "the docs show no Loader call"
    for call in calls:
        for keyword in call.keywords:
            assert keyword.arg in loader_args, f"Loader has no argument {keyword.arg}"

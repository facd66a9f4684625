"""compose/docker-compose.yml agrees with the code it runs.

No Docker engine runs where the tests do, so this reads the file with PyYAML (and runs
`docker-compose config -q` where that happens to be installed) and checks it against the
services' configuration classes: every command runs a module of this repository, every RELAYGR_*
variable is one the service reads, each service's settings load and validate, the ranker list
names the ranker services on their gRPC ports, health checks and published ports use the
configured ports, the rankers reserve distinct GPUs and share the expander's socket volume and IPC
namespace, and the topics the services use are the ones the topics service creates.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from services.expander.config import ExpanderConfig
from services.ranker.config import RankerConfig
from services.router.config import RouterConfig
from services.trigger.config import TriggerConfig
from shared.config import ConfigError, describe, load_config
from shared.kafka import KafkaSettings

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the compose file")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
CONFIGS: dict[str, type] = {
    "expander": ExpanderConfig,
    "ranker": RankerConfig,
    "router": RouterConfig,
    "trigger": TriggerConfig,
}
# The setting that holds each service's gRPC port (health checks and RELAYGR_RANKERS use it).
GRPC_PORT = {"ranker": "RELAYGR_RANKER_PORT", "router": "RELAYGR_ROUTER_PORT"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
_VARIABLE = re.compile(r"(?<!\$)\$\{(\w+)(?:(:?-)([^}]*))?\}")


def _interpolate(value: Any) -> Any:
    """What compose does with the variables unset: ${VAR:-default} -> default, $$ -> $."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group(3) or "", value).replace("$$", "$")
    if isinstance(value, dict):
        return {key: _interpolate(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item) for item in value]
    return value


@pytest.fixture(scope="module")
def text() -> str:
    return COMPOSE.read_text()


@pytest.fixture(scope="module")
def services(text: str) -> dict[str, dict[str, Any]]:
    spec = _interpolate(yaml.safe_load(text))
    assert isinstance(spec.get("services"), dict), "no services mapping"
    return spec["services"]


@pytest.fixture(scope="module")
def volumes(text: str) -> dict[str, Any]:
    return yaml.safe_load(text).get("volumes") or {}


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else [str(part) for part in command]


def _kind(service: dict[str, Any]) -> str | None:
    """ranker / router / trigger / expander for `python -m services.<kind>`, else None."""
    command = _command(service)
    if "-m" not in command:
        return None
    module = command[command.index("-m") + 1]
    return module.removeprefix("services.") if module.startswith("services.") else None


def _by_kind(services: dict[str, dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if _kind(s) == kind}


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


def _env_names(cls: type) -> set[str]:
    return {env for _flag, env, _default, _help in describe(cls)}


def _default(cls: type, env: str) -> str:
    (default,) = [d for _flag, name, d, _help in describe(cls) if name == env]
    return str(ast.literal_eval(default))  # describe() gives repr(default)


def _healthcheck_text(service: dict[str, Any]) -> str:
    test = (service.get("healthcheck") or {}).get("test", [])
    return test if isinstance(test, str) else " ".join(str(part) for part in test)


def _published(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host side, container port) of each published port (short syntax)."""
    out = []
    for entry in service.get("ports", []):
        assert isinstance(entry, str), f"quote port mappings (YAML reads 50:51 as a number): {entry!r}"
        host, _, container = entry.rpartition(":")
        out.append((host, int(container.split("/")[0])))
    return out


def _relaygr(services: dict[str, dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    return {name: (kind, s) for name, s in services.items() if (kind := _kind(s)) is not None}


def test_every_service_kind_is_in_the_stack(services):
    kinds = sorted(_kind(s) or "" for s in services.values())
    assert {"expander", "ranker", "router", "trigger"} <= set(kinds)
    assert len(_by_kind(services, "ranker")) >= 2
    assert len(_by_kind(services, "expander")) == 1, "one expander per host"


def test_commands_run_modules_of_this_repository(services):
    for name, service in services.items():
        if "build" not in service:
            continue  # kafka and topics run the Kafka image's own tools
        command = _command(service)
        assert command[:2] == ["python", "-m"], f"{name}: {command}"
        kind = _kind(service)
        assert kind is not None, f"{name}: {command} is not a services.<name> module"
        assert (ROOT / "services" / kind / "__main__.py").is_file(), f"{name}: no services/{kind}/__main__.py"
        build = service["build"]
        dockerfile = (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile == ROOT / "compose" / "Dockerfile", f"{name}: builds from {dockerfile}"
    for name, (_kind_name, service) in _relaygr(services).items():
        assert "build" in service, f"{name} runs a RelayGR module but does not use the RelayGR image"


def test_each_service_image_is_built_from_its_own_extra(services):
    """One image per service kind, built with that service's pyproject extra (EXTRA); only the
    rankers' extra pulls torch, so only their image may carry it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    images: dict[str, set[str]] = {}
    for name, (kind, service) in _relaygr(services).items():
        extra = str(service["build"].get("args", {}).get("EXTRA"))
        assert extra == kind, f"{name}: built with extra {extra!r}, not {kind!r}"
        assert extra in extras, f"{name}: pyproject.toml has no [{extra}] extra"
        images.setdefault(kind, set()).add(str(service["image"]))
        has_torch = any(dep.startswith("torch") for dep in extras[extra])
        assert has_torch == (kind == "ranker"), (
            f"{name}: the {extra} extra {'lacks' if kind == 'ranker' else 'pulls'} torch"
        )
    assert all(len(names) == 1 for names in images.values()), f"one image per kind: {images}"
    assert len(set().union(*images.values())) == len(images), f"kinds share an image: {images}"


def test_relaygr_variables_are_settings_of_that_service(services):
    """A RELAYGR_* variable set on a service whose config does not read it is silently ignored."""
    known = set().union(*(_env_names(cls) for cls in (*CONFIGS.values(), KafkaSettings)))
    for name, (kind, service) in _relaygr(services).items():
        own = _env_names(CONFIGS[kind])
        for var in _env(service):
            if var.startswith("RELAYGR_"):
                assert var in known, f"{name}: {var} is read by no service"
                assert var in own, f"{name}: {var} is not a {CONFIGS[kind].__name__} setting"


def test_each_service_configuration_loads(services):
    """The values parse and pass the same validation as at start-up."""
    for name, (kind, service) in _relaygr(services).items():
        try:
            load_config(CONFIGS[kind], [], env=_env(service))
        except ConfigError as exc:
            pytest.fail(f"{name}: {exc}")


def test_required_settings_are_set(services):
    for name, (kind, service) in _relaygr(services).items():
        env = _env(service)
        cls = CONFIGS[kind]
        if issubclass(cls, KafkaSettings):
            assert env.get("RELAYGR_KAFKA_BOOTSTRAP"), f"{name}: no RELAYGR_KAFKA_BOOTSTRAP"
            assert int(env.get("RELAYGR_KAFKA_SESSION_TIMEOUT_MS", "0")) >= 6000, (
                f"{name}: real Kafka refuses session timeouts under 6000 ms"
            )
        if kind in ("router", "trigger"):
            assert env.get("RELAYGR_RANKERS"), f"{name}: no RELAYGR_RANKERS"
        if kind in GRPC_PORT:  # reachable from other containers, on a fixed port
            host_var = GRPC_PORT[kind].replace("_PORT", "_HOST")
            assert env.get(host_var) == "0.0.0.0", f"{name}: {host_var} must be 0.0.0.0"
            assert int(env.get(GRPC_PORT[kind], "0")) > 0, f"{name}: {GRPC_PORT[kind]} must be fixed"
        metrics = [var for var in _env_names(cls) if var.endswith("METRICS_PORT")]
        assert len(metrics) == 1
        assert int(env.get(metrics[0], "0")) > 0, f"{name}: {metrics[0]} must be fixed"


def test_router_and_trigger_agree_on_shared_settings(services):
    users = {**_by_kind(services, "router"), **_by_kind(services, "trigger")}
    for var in ("RELAYGR_RANKERS", "RELAYGR_LOAD_FACTOR", "RELAYGR_LOAD_SLACK", "RELAYGR_SIGNAL_TOPIC"):
        values = {name: _env(s).get(var) for name, s in users.items()}
        assert len(set(values.values())) == 1, f"{var} differs: {values}"
    rankers = _by_kind(services, "ranker")
    for var in (
        "RELAYGR_MODEL_PRESET",
        "RELAYGR_MODEL_SEED",
        "RELAYGR_MODEL_CHECKPOINT",
        "RELAYGR_DEFAULT_LEASE_MS",
    ):
        values = {name: _env(s).get(var) for name, s in rankers.items()}
        assert len(set(values.values())) == 1, f"rankers differ on {var}: {values}"
    (ranker_env, *_) = [_env(s) for s in rankers.values()]
    for router in _by_kind(services, "router").values():
        env = _env(router)
        assert env.get("RELAYGR_MAX_PREFIX_TOKENS") == ranker_env.get("RELAYGR_MAX_PREFIX_TOKENS")
        assert env.get("RELAYGR_DEFAULT_LEASE_MS") == ranker_env.get("RELAYGR_DEFAULT_LEASE_MS")
    for trigger in _by_kind(services, "trigger").values():
        assert _env(trigger).get("RELAYGR_MODEL_PRESET") == ranker_env.get("RELAYGR_MODEL_PRESET")


def test_ranker_list_points_at_the_ranker_services(services):
    rankers = _by_kind(services, "ranker")
    for name, service in {**_by_kind(services, "router"), **_by_kind(services, "trigger")}.items():
        targets = _env(service)["RELAYGR_RANKERS"].split(",")
        assert len(set(targets)) == len(targets), f"{name}: duplicate targets {targets}"
        hosts = set()
        for target in targets:
            host, _, port = target.rpartition(":")
            assert host in rankers, f"{name}: {target} is not a ranker service ({sorted(rankers)})"
            assert port == _env(rankers[host])["RELAYGR_RANKER_PORT"], f"{name}: {target}: wrong port"
            hosts.add(host)
        assert hosts == set(rankers), f"{name}: rankers missing from RELAYGR_RANKERS: {set(rankers) - hosts}"


def test_depends_on_names_existing_services_with_valid_conditions(services):
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {dep: {"condition": "service_started"} for dep in depends}
        for dep, spec in depends.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            condition = spec.get("condition", "service_started")
            assert condition in CONDITIONS, f"{name} -> {dep}: {condition}"
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), (
                    f"{name} waits for {dep} to be healthy: no healthcheck"
                )
            if condition == "service_completed_successfully":
                assert services[dep].get("restart", "no") == "no", f"{dep} is one-shot: restart must be 'no'"
    expanders = set(_by_kind(services, "expander"))
    for name in _by_kind(services, "ranker"):
        assert expanders <= set(services[name].get("depends_on") or {}), f"{name} must wait for the expander"
    for name, (kind, service) in _relaygr(services).items():
        assert service.get("restart") in ("always", "unless-stopped", "on-failure"), f"{name}: restart policy"
        if kind in ("router", "trigger"):
            depends = service.get("depends_on") or {}
            assert depends.get("kafka", {}).get("condition") == "service_healthy", name
            assert depends.get("topics", {}).get("condition") == "service_completed_successfully", name


def test_health_checks_and_published_ports_use_the_configured_ports(services):
    host_ports: dict[str, str] = {}
    for name, service in services.items():
        for host, _container in _published(service):
            assert host not in host_ports, f"{name} and {host_ports.get(host)} both publish {host}"
            host_ports[host] = name
    for name, (kind, service) in _relaygr(services).items():
        env = _env(service)
        cls = CONFIGS[kind]
        (metrics_var,) = [var for var in _env_names(cls) if var.endswith("METRICS_PORT")]
        probe = _healthcheck_text(service)
        assert probe, f"{name}: no healthcheck"
        probed = {int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", probe)}
        if kind in GRPC_PORT:
            assert probed == {int(env[GRPC_PORT[kind]])}, f"{name}: healthcheck probes {probed}"
            assert "grpc_health" in probe, f"{name}: gRPC health check expected"
            assert f"relaygr.v1.{kind.capitalize()}" in probe, f"{name}: checks the wrong health name"
        else:
            assert probed == {int(env[metrics_var])}, f"{name}: healthcheck probes {probed}"
        served = {int(env[var]) for var in (GRPC_PORT.get(kind), metrics_var) if var}
        # Services without a bind-host setting serve on loopback: publishing their ports is useless.
        binds_all = any(var.endswith("_HOST") and env.get(var) == "0.0.0.0" for var in _env_names(cls))
        for host, container in _published(service):
            assert container in served, f"{name} publishes {container}, but serves on {served}"
            assert binds_all, f"{name} publishes {host}:{container}, but binds loopback only"


def test_rankers_reserve_distinct_gpus_and_share_the_expander(services, volumes):
    ((expander_name, expander),) = _by_kind(services, "expander").items()
    assert expander.get("ipc") == "shareable"
    assert expander.get("shm_size"), "Docker's default /dev/shm is 64 MB"
    socket_path = _env(expander)["RELAYGR_EXPANDER_SOCKET_PATH"]
    socket_dir = str(Path(socket_path).parent)
    expander_mounts = {m.split(":")[1]: m.split(":")[0] for m in expander.get("volumes", [])}
    assert socket_dir in expander_mounts, f"the expander's {socket_dir} is not a volume"
    assert expander_mounts[socket_dir] in volumes, "the socket volume must be a declared named volume"
    gpus: list[str] = []
    for name, ranker in _by_kind(services, "ranker").items():
        env = _env(ranker)
        assert env.get("RELAYGR_RANKER_DEVICE") == "cuda", name
        assert env.get("RELAYGR_RANKER_HOST_TIER") == "true", f"{name}: no host tier"
        assert env.get("RELAYGR_EXPANDER_SOCKET_PATH") == socket_path, f"{name}: not the expander's socket"
        assert ranker.get("ipc") == f"service:{expander_name}", f"{name}: ipc"
        mounts = {m.split(":")[1]: m.split(":")[0] for m in ranker.get("volumes", [])}
        assert mounts.get(socket_dir) == expander_mounts[socket_dir], f"{name}: does not share {socket_dir}"
        devices = ranker["deploy"]["resources"]["reservations"]["devices"]
        (device,) = [d for d in devices if d.get("driver") == "nvidia"]
        assert "gpu" in device.get("capabilities", []), name
        ids = [str(i) for i in device.get("device_ids", [])]
        assert len(ids) == 1 or device.get("count") == 1, f"{name}: reserve exactly one GPU"
        gpus += ids
    # `count: 1` hands every ranker the same first GPU: several rankers need distinct device_ids.
    assert len(gpus) == len(_by_kind(services, "ranker")), "rankers need device_ids"
    assert len(set(gpus)) == len(gpus), f"rankers share a GPU: {gpus}"


def test_kafka_is_a_healthy_kraft_node_the_clients_can_reach(services):
    kafka = services["kafka"]
    assert "apache/kafka" in kafka["image"]
    assert kafka.get("healthcheck", {}).get("test"), "kafka needs a healthcheck"
    env = _env(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}, "single KRaft node"
    assert env.get("CLUSTER_ID")
    advertised = {url.split("://", 1)[1] for url in env["KAFKA_ADVERTISED_LISTENERS"].split(",")}
    for name, (kind, service) in _relaygr(services).items():
        if issubclass(CONFIGS[kind], KafkaSettings):
            bootstrap = _env(service)["RELAYGR_KAFKA_BOOTSTRAP"]
            assert bootstrap in advertised, f"{name}: {bootstrap} is not an advertised listener"


def test_topics_service_creates_every_topic_the_services_use(services, text):
    topics = services["topics"]
    script = " ".join(_command(topics))
    created = set(re.findall(r"create (\S+) (\d+)", script))
    assert created, "no topics created"
    names = {topic for topic, _partitions in created}
    for name, (kind, service) in _relaygr(services).items():
        cls = CONFIGS[kind]
        env = _env(service)
        for var in ("RELAYGR_RETRIEVAL_TOPIC", "RELAYGR_SIGNAL_TOPIC", "RELAYGR_DLQ_TOPIC"):
            if var in _env_names(cls):
                topic = env.get(var) or _default(cls, var)
                assert topic in names, f"{name} uses topic {topic}, which the topics service does not create"
    for variable in ("RETRIEVAL_PARTITIONS", "SIGNAL_PARTITIONS", "DLQ_PARTITIONS"):
        assert "${" + variable + ":-" in text, f"partition count {variable} is not a variable"


def test_every_variable_has_a_default(text):
    """`up` must work with nothing set: compose replaces an unset ${VAR} with an empty string."""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in _VARIABLE.finditer(line):
            assert match.group(2) == ":-", f"${{{match.group(1)}}} has no default: {line.strip()}"
        assert not re.search(r"(?<!\$)\$(?![{$])", line), f"bare $ (compose interpolates it): {line.strip()}"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_accepts_the_file():
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr

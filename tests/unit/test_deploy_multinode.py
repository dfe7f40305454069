"""deploy/kubernetes/multinode-lws.yaml: the multi-node tensor-parallel LeaderWorkerSet asks lmiserve for
what it serves, in the spellings lmiserve reads (issue #25), and its pods agree with each other.

Each pod's command is rendered as Kubernetes and LeaderWorkerSet would: LWS sets LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE and LWS_WORKER_INDEX (0 on the leader, 1.. on the workers) in every container, and the
kubelet expands ``$(VAR)`` in args from the container's environment. The rendered commands must then
agree: the same model and tensor_parallel_degree everywhere, one node rank each from 0 to nnodes - 1,
one rendezvous address, the degree equal to nnodes x GPUs a pod.

The multi-node options are checked against issue #25's interface (``MULTINODE`` below); where a setting
exists already (tensor_parallel_degree today) the manifest's flag and environment names must also be
among lmiserve's own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmiserve.cli import build_parser
from lmiserve.config import Settings
from lmiserve.config.flags import flag_values, flags_of
from lmiserve.config.sources import environment_names, load_settings, parse_override

yaml = pytest.importorskip("yaml")  # PyYAML comes with transformers

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kubernetes" / "multinode-lws.yaml"
HTTP_PORT = Settings().port

# Issue #25's tensor-parallel and multi-node options: key -> (its flags, the environment variables that set it).
MULTINODE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tensor_parallel_degree": (
        ("--tensor-parallel-size", "--tensor-parallel-degree"),
        ("OPTION_TENSOR_PARALLEL_DEGREE",),
    ),
    "nnodes": (("--nnodes",), ("OPTION_NNODES", "NNODES", "PET_NNODES", "LWS_GROUP_SIZE")),
    "node_rank": (("--node-rank",), ("OPTION_NODE_RANK", "NODE_RANK", "PET_NODE_RANK", "LWS_WORKER_INDEX")),
    "master_addr": (("--master-addr",), ("OPTION_MASTER_ADDR", "MASTER_ADDR", "LWS_LEADER_ADDRESS")),
    "master_port": (("--master-port",), ("OPTION_MASTER_PORT", "MASTER_PORT")),
    "step_timeout": ((), ("OPTION_STEP_TIMEOUT",)),
}
MULTINODE_FLAGS = {flag: key for key, (flags, _) in MULTINODE.items() for flag in flags}
MULTINODE_ENV = {name: key for key, (_, names) in MULTINODE.items() for name in names}
KUBERNETES_VAR = re.compile(r"\$\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)")
LEADER_ADDRESS = "lmiserve-405b-0.lmiserve-405b.default"  # what LWS sets: the leader pod's DNS name


def documents() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc is not None]


def the(kind: str) -> dict:
    [doc] = [doc for doc in documents() if doc["kind"] == kind]
    return doc


def container(template: dict) -> dict:
    [only] = template["spec"]["containers"]
    return only


def gpus(template: dict) -> int:
    return int(container(template)["resources"]["limits"]["nvidia.com/gpu"])


def lws_environment(lws: dict, index: int) -> dict[str, str]:
    return {
        "LWS_LEADER_ADDRESS": LEADER_ADDRESS,
        "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"]["size"]),
        "LWS_WORKER_INDEX": str(index),
    }


def render(template: dict, environment: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The pod's args after the kubelet's $(VAR) expansion, and its environment (LWS's included)."""
    env = {**environment, **{e["name"]: str(e["value"]) for e in container(template).get("env", [])}}
    args = [KUBERNETES_VAR.sub(lambda m: env.get(m["name"], m[0]), str(arg)) for arg in container(template)["args"]]
    return args, env


def options_of(args: list[str]) -> dict[str, str]:
    """`serve FLAG VALUE ...` as {setting key: value}: lmiserve's own parser reads the flags it has, and
    issue #25's table the multi-node ones it does not have yet."""
    assert args[0] == "serve", args  # the image's entrypoint: `serve ARGS` -> `lmiserve serve --model-dir ROOT ARGS`
    namespace, unknown = build_parser().parse_known_args(args)
    options = {key: str(value) for key, value in flag_values(namespace)[0].items()}
    options.update(parse_override(item) for item in namespace.option)
    words = iter(unknown)
    for word in words:
        flag, equals, inline = word.partition("=")
        assert flag in MULTINODE_FLAGS, f"{word} is neither an lmiserve flag nor one of issue #25's"
        options[MULTINODE_FLAGS[flag]] = inline if equals else next(words)
    return options


def rendered_pods() -> list[tuple[str, dict[str, str], dict[str, str]]]:
    """(role, options, environment) of every pod of one group, leader first."""
    lws = the("LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    pods = []
    for index in range(template["size"]):
        role, pod = ("leader", template["leaderTemplate"]) if index == 0 else ("worker", template["workerTemplate"])
        args, env = render(pod, lws_environment(lws, index))
        pods.append((role, options_of(args), env))
    return pods


def test_the_manifest_holds_a_leader_worker_set_and_its_service():
    kinds = [(doc["apiVersion"], doc["kind"]) for doc in documents()]
    assert kinds == [("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"), ("v1", "Service")]
    lws = the("LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] >= 2 and lws["spec"]["replicas"] >= 1
    # a rank cannot rejoin a running group: any pod's restart restarts the group
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    # LeaderReady would wait for a leader that is ready only once the workers have joined
    assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"


def test_leader_and_workers_run_the_same_image_command_and_model():
    template = the("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader, worker = container(template["leaderTemplate"]), container(template["workerTemplate"])
    assert leader["image"] == worker["image"]
    assert leader["args"] == worker["args"] and leader.get("command") == worker.get("command")
    assert leader["env"] == worker["env"]
    assert leader["volumeMounts"] == worker["volumeMounts"]
    assert template["leaderTemplate"]["spec"]["volumes"] == template["workerTemplate"]["spec"]["volumes"]
    assert gpus(template["leaderTemplate"]) == gpus(template["workerTemplate"]) >= 1


def test_every_option_and_variable_is_lmiserves_or_issue_25s():
    known_keys = set(Settings.option_keys())
    for role, options, env in rendered_pods():
        for key in options:
            assert key in known_keys or key in MULTINODE, (role, key)
        for name in env:
            if name.startswith(("OPTION_", "SERVING_")):
                assert name in MULTINODE_ENV or name.split("_", 1)[1].lower() in known_keys, (role, name)
        # the values of the settings lmiserve has today are valid (tensor_parallel_degree and the
        # multi-node ones aside: their values are checked against each other below)
        today = {k: v for k, v in options.items() if k not in MULTINODE}
        lmiserve_env = {k: v for k, v in env.items() if k.startswith("OPTION_") and k not in MULTINODE_ENV}
        load_settings(today, environ=lmiserve_env)


def test_issue_25s_spellings_match_lmiserves_where_the_setting_exists():
    known_keys = set(Settings.option_keys())
    assert "tensor_parallel_degree" in known_keys
    for key, (flags, names) in MULTINODE.items():
        if key in known_keys:
            assert set(flags) <= set(flags_of(key)), key
            assert set(names) & set(environment_names(key)), key  # OPTION_<KEY> at least


def test_the_pods_rendezvous_as_one_group():
    pods = rendered_pods()
    template = the("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    size, per_pod = template["size"], gpus(template["leaderTemplate"])
    [(_, leader, _)] = [pod for pod in pods if pod[0] == "leader"]
    for _, options, _ in pods:
        for key in ("tensor_parallel_degree", "nnodes", "master_addr", "master_port", "dtype"):
            assert options[key] == leader[key], key
    assert int(leader["nnodes"]) == size
    assert [int(options["node_rank"]) for _, options, _ in pods] == list(range(size))  # the leader is node 0
    assert leader["master_addr"] == LEADER_ADDRESS
    assert 1024 <= int(leader["master_port"]) < 65536 and int(leader["master_port"]) != HTTP_PORT
    degree = int(leader["tensor_parallel_degree"])
    assert degree == size * per_pod  # every node runs degree / nnodes workers, one per GPU


def test_only_the_leader_serves_http_and_the_service_selects_it():
    lws, service = the("LeaderWorkerSet"), the("Service")
    template = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = container(template["leaderTemplate"]), container(template["workerTemplate"])
    assert HTTP_PORT in [p["containerPort"] for p in leader["ports"]]
    assert "ports" not in worker and "readinessProbe" not in worker and "livenessProbe" not in worker
    assert leader["readinessProbe"]["httpGet"] == {"path": "/ping", "port": HTTP_PORT}
    assert leader["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"  # 200 during the drain too
    rendezvous = int(options_of(render(template["leaderTemplate"], lws_environment(lws, 0))[0])["master_port"])
    assert rendezvous in [p["containerPort"] for p in leader["ports"]]
    assert service["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
        **template["leaderTemplate"]["metadata"]["labels"],
    }
    [port] = service["spec"]["ports"]
    assert port["targetPort"] == HTTP_PORT


def test_every_pod_outlives_the_drain():
    template = the("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        drain = float({e["name"]: e["value"] for e in container(pod)["env"]}["OPTION_DRAIN_TIMEOUT"])
        assert pod["spec"]["terminationGracePeriodSeconds"] > drain

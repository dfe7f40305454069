"""The LoRA adapters management APIs on real servers: LMI's (DJL Serving's) ``/models/{m}/adapters``
routes and their one-model ``/adapters`` form (SageMaker's), vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, adapters in ``GET /v1/models``, what runtime registration refuses (paths
outside the allowed roots, adapters that do not fit), the API key, the access line and the metrics.

One server of this module's own registers and unregisters adapters (`managed`: api_key, enable_lora,
allowed_model_paths = a folder of adapters); the shared `lora_server` (adapters named at start) and
`server` (no LoRA) are only read.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.server import read_log, run_server
from helpers.waiting import wait_until

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


@dataclass
class Managed:
    client: httpx.Client
    name: str  # the model's
    allowed: Path  # allowed_model_paths: copies of the test adapters and the misfits below
    outside: dict[str, Path]  # the session's adapters, outside allowed_model_paths
    log: Path

    def access(self, request_id: str) -> dict[str, str]:
        """The access line of `request_id` (waits for it), as its logfmt fields."""

        def lines() -> list[str]:
            return [line for line in read_log(self.log) if f"[{request_id}]" in line and "lmiserve.access" in line]

        wait_until(lambda: bool(lines()), "the access line")
        message = lines()[0].split("]: ", 1)[1]
        return {k: json.loads(v) if v.startswith('"') else v for k, v in PAIR.findall(message)}


def _rewrite(src: Path, out: Path, change: Callable[[dict], dict]) -> Path:
    """A copy of adapter `src` whose tensors `change` rewrote."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    shutil.copy(src / "adapter_config.json", out / "adapter_config.json")
    save_file(change(load_file(str(src / "adapter_model.safetensors"))), str(out / "adapter_model.safetensors"))
    return out


def _renamed(tensors: dict) -> dict:
    """q_proj's matrices under a module name the model does not have."""
    return {k.replace("q_proj", "qq_proj"): v for k, v in tensors.items()}


def _widened(tensors: dict) -> dict:
    """v_proj's B taller than v_proj's output: an adapter made for a model of another shape."""
    import torch

    return {k: torch.cat([v, v]) if "v_proj.lora_B" in k else v for k, v in tensors.items()}


@pytest.fixture(scope="module")
def managed(tiny_model_dir: Path, lora_adapter_dirs: dict[str, Path], tmp_path_factory) -> Iterator[Managed]:
    from helpers.lora_adapters import AdapterSpec, make_adapter

    allowed = tmp_path_factory.mktemp("lora-allowed")
    for name, path in lora_adapter_dirs.items():
        shutil.copytree(path, allowed / name)
    make_adapter(tiny_model_dir, allowed / "rank32", AdapterSpec("rank32", 32, ("q_proj",), seed=7))
    _rewrite(lora_adapter_dirs["alpha"], allowed / "no-such-module", _renamed)
    _rewrite(lora_adapter_dirs["alpha"], allowed / "other-shape", _widened)
    (allowed / "not-an-adapter").mkdir()
    log = tmp_path_factory.mktemp("lora-log") / "server.log"
    args = ["--model-id", str(tiny_model_dir), "--api-key", KEY]
    for option in ("enable_lora=true", f"allowed_model_paths={allowed}", "max_cpu_loras=4"):
        args += ["-o", option]
    with (
        run_server(args, stderr_path=log) as url,
        httpx.Client(base_url=url, timeout=60, trust_env=False, headers=AUTH) as client,
    ):
        yield Managed(client, tiny_model_dir.name, allowed, lora_adapter_dirs, log)


def frontend(response: httpx.Response, code: int, kind: str) -> str:
    """The message of LMI's front-end error body, after checking its status, type and shape."""
    assert response.status_code == code, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["code", "type", "message"] and (body["code"], body["type"]) == (code, kind), body
    return body["message"]


def openai_error(response: httpx.Response, code: int) -> str:
    assert response.status_code == code, response.text
    return response.json()["error"]["message"]


def status(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    assert response.text.startswith("{\n  ") and response.text.endswith("}\n")  # LMI's pretty JSON
    return response.json()["status"]


# ---- LMI's adapters API ------------------------------------------------------------------------------


def test_register_list_describe_update_and_unregister(managed):
    c, base = managed.client, f"/models/{managed.name}/adapters"
    src = managed.allowed / "alpha"
    assert status(c.post(base, params={"name": "lmi-a", "src": str(src)})) == "Adapter lmi-a registered"

    listed = c.get(base).json()
    assert list(listed) == ["adapters"]  # one page: no nextPageToken
    assert {"name": "lmi-a", "src": str(src), "pin": False, "loaded": True} in listed["adapters"]

    described = c.get(f"{base}/lmi-a").json()
    assert (described["rank"], described["targetModules"], described["pin"]) == (8, ["q_proj", "v_proj"], False)
    assert (described["requests"], described["running"]) == (0, 0) and described["sizeBytes"] > 0
    assert c.get("/adapters/lmi-a").json() == described  # the one-model form

    assert status(c.post(f"{base}/lmi-a/update", params={"pin": "true"})) == "Adapter lmi-a updated"
    assert c.get(f"{base}/lmi-a").json()["pin"] is True
    beta = managed.allowed / "beta"
    assert status(c.post(f"{base}/lmi-a/update", json={"src": str(beta), "pin": False})) == "Adapter lmi-a updated"
    described = c.get(f"{base}/lmi-a").json()
    assert (described["src"], described["rank"], described["pin"]) == (str(beta), 4, False)

    assert status(c.delete(f"{base}/lmi-a")) == "Adapter lmi-a unregistered"
    message = frontend(c.get(f"{base}/lmi-a"), 404, "ResourceNotFoundException")
    assert message == "Adapter lmi-a is not registered"
    assert "lmi-a" not in [a["name"] for a in c.get(base).json()["adapters"]]


def test_sagemaker_register_and_delete(managed):
    c = managed.client
    body = {"name": "sm-a", "src": str(managed.allowed / "gamma")}
    assert status(c.post("/adapters", json=body)) == "Adapter sm-a registered"
    assert c.get("/adapters/sm-a").json()["rank"] == 16
    assert status(c.delete("/adapters/sm-a")) == "Adapter sm-a unregistered"


def test_lazy_registration_loads_nothing_until_asked(managed):
    c = managed.client
    src = managed.allowed / "beta"
    assert status(c.post("/adapters", params={"name": "lazy", "src": str(src), "preload": "false"}))
    described = c.get("/adapters/lazy").json()
    assert described["loaded"] is False and "rank" not in described  # nulls are left out
    c.delete("/adapters/lazy")


def test_the_listing_comes_in_pages(managed):
    c = managed.client
    names = [f"page-{i}" for i in range(3)]
    for name in names:
        assert status(c.post("/adapters", params={"name": name, "src": str(managed.allowed / "beta"), "preload": "0"}))
    try:
        everything = [a["name"] for a in c.get("/adapters").json()["adapters"]]
        first = c.get("/adapters", params={"limit": 2}).json()
        assert first["nextPageToken"] == "2" and [a["name"] for a in first["adapters"]] == everything[:2]
        rest = c.get("/adapters", params={"limit": 2, "next_page_token": first["nextPageToken"]}).json()
        assert [a["name"] for a in rest["adapters"]] == everything[2:4]
        frontend(c.get("/adapters", params={"limit": "x"}), 400, "BadRequestException")
    finally:
        for name in names:
            c.delete(f"/adapters/{name}")


# ---- what registration refuses -----------------------------------------------------------------------


def test_a_path_outside_the_allowed_roots_is_403_and_reveals_nothing(managed):
    c = managed.client
    for src in (managed.outside["alpha"], "/definitely/not/here", f"{managed.allowed}/../elsewhere"):
        message = frontend(c.post("/adapters", json={"name": "outside", "src": str(src)}), 403, "ForbiddenException")
        assert message == f"Adapter path {src} is not under an allowed model root (model_store or allowed_model_paths)."
    assert c.get("/adapters/outside").status_code == 404


def test_a_symbolic_link_out_of_the_root_is_refused(managed):
    link = managed.allowed / "link-out"
    link.symlink_to(managed.outside["alpha"])
    r = managed.client.post("/adapters", json={"name": "link", "src": str(link)})
    assert frontend(r, 403, "ForbiddenException").startswith("Adapter path")


@pytest.mark.parametrize(
    "folder,words",
    [
        ("rank32", "has rank 32 (at q_proj), above max_lora_rank 16"),
        ("no-such-module", "qq_proj, which this model does not have"),
        ("other-shape", "does not fit this model"),
        ("not-an-adapter", "has no adapter_config.json: not a PEFT adapter"),
        ("missing", "Adapter directory not found"),
    ],
)
def test_an_adapter_that_does_not_fit_is_400_saying_why(managed, folder, words):
    r = managed.client.post("/adapters", json={"name": f"misfit-{folder}", "src": str(managed.allowed / folder)})
    assert words in frontend(r, 400, "BadRequestException")
    assert managed.client.get(f"/adapters/misfit-{folder}").status_code == 404  # nothing registered


@pytest.mark.parametrize(
    "params,words",
    [
        ({"src": "alpha"}, "Parameter name is required."),
        ({"name": "no-src"}, "Parameter src is required."),
        ({"name": " padded", "src": "alpha"}, "invalid adapter name"),
        ({"name": "x", "src": "alpha", "pin": "maybe"}, "Parameter pin must be true or false: maybe"),
        ({"name": "x", "src": "https://example.com/alpha"}, "Unsupported src https://example.com/alpha"),
    ],
)
def test_bad_parameters_are_400(managed, params, words):
    r = managed.client.post("/adapters", params=params)  # a relative src is under the first root
    assert words in frontend(r, 400, "BadRequestException")


def test_a_remote_src_outside_allowed_model_urls_is_403(managed):
    r = managed.client.post("/adapters", params={"name": "x", "src": "s3://bucket/alpha"})
    assert frontend(r, 403, "ForbiddenException") == (
        "Adapter URL s3://bucket/alpha is not allowed: this server fetches only what allowed_model_urls lists "
        "(nothing)."
    )


def test_the_models_own_name_is_refused(managed):
    r = managed.client.post("/adapters", params={"name": managed.name, "src": "alpha"})
    assert frontend(r, 400, "BadRequestException") == f"Adapter name {managed.name} is the name of a served model."


def test_a_name_registered_twice_is_409(managed):
    c = managed.client
    assert status(c.post("/adapters", params={"name": "twice", "src": "alpha"}))
    try:
        r = c.post("/adapters", params={"name": "twice", "src": "beta"})
        assert frontend(r, 409, "ConflictStatusException") == "Adapter twice is already registered."
    finally:
        c.delete("/adapters/twice")


def test_unknown_adapters_and_models_are_404(managed):
    c = managed.client
    for r in (c.get("/adapters/nope"), c.delete("/adapters/nope"), c.post("/adapters/nope/update", json={})):
        assert frontend(r, 404, "ResourceNotFoundException") == "Adapter nope is not registered"
    r = c.get("/models/no-model/adapters")
    assert frontend(r, 404, "ModelNotFoundException") == "Model or workflow not found: no-model"


def test_an_update_from_outside_is_refused_and_changes_nothing(managed):
    c = managed.client
    assert status(c.post("/adapters", params={"name": "kept", "src": "alpha"}))
    try:
        r = c.post("/adapters/kept/update", params={"src": str(managed.outside["beta"])})
        frontend(r, 403, "ForbiddenException")
        r = c.post("/adapters/kept/update", params={"src": "rank32"})
        assert "above max_lora_rank 16" in frontend(r, 400, "BadRequestException")
        assert c.get("/adapters/kept").json()["rank"] == 8
    finally:
        c.delete("/adapters/kept")


def test_every_management_route_needs_the_key(managed):
    c, base = managed.client, f"/models/{managed.name}/adapters"
    calls = [
        ("GET", base),
        ("POST", base),
        ("GET", f"{base}/x"),
        ("DELETE", f"{base}/x"),
        ("POST", f"{base}/x/update"),
        ("GET", "/adapters"),
        ("POST", "/adapters"),
        ("DELETE", "/adapters/x"),
    ]
    for method, path in calls:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            r = c.request(method, path, headers=headers, params={"name": "k", "src": "alpha"})
            assert frontend(r, 401, "UnauthorizedException"), (method, path)
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = c.post(path, json={"lora_name": "k", "lora_path": "alpha"}, headers={"Authorization": ""})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/adapters/k").status_code == 404  # nothing was registered


# ---- the route table ---------------------------------------------------------------------------------


def test_delete_on_the_adapters_collection_does_not_unregister_the_model(managed):
    c = managed.client
    r = c.delete(f"/models/{managed.name}/adapters")
    frontend(r, 405, "MethodNotAllowedException")
    assert [m["modelName"] for m in c.get("/models").json()["models"]] == [managed.name]
    assert c.get("/ping").status_code == 200
    # GET lists the adapters (it was the model-version describe route's)
    assert list(c.get(f"/models/{managed.name}/adapters").json()) == ["adapters"]
    assert c.get(f"/models/{managed.name}/1").json()[0]["workflowName"] == managed.name  # versions still answer


# ---- vLLM's spellings --------------------------------------------------------------------------------


def test_vllm_load_list_and_unload(managed):
    c = managed.client
    src = managed.allowed / "gamma"
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "v-a", "lora_path": str(src)})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'v-a' added successfully.")
    assert r.headers["content-type"].startswith("text/plain")

    cards = {card["id"]: card for card in c.get("/v1/models").json()["data"]}
    assert cards["v-a"]["parent"] == managed.name and cards["v-a"]["root"] == str(src)
    assert cards["v-a"]["object"] == "model" and cards["v-a"]["max_model_len"] is None
    assert cards[managed.name]["parent"] is None

    r = c.post("/v1/load_lora_adapter", json={"lora_name": "v-a", "lora_path": str(src)})
    assert openai_error(r, 400) == "The lora adapter 'v-a' has already been loaded."
    beta = managed.allowed / "beta"
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "v-a", "lora_path": str(beta), "load_inplace": True})
    assert r.status_code == 200 and c.get("/adapters/v-a").json()["rank"] == 4

    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "v-a"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'v-a' removed successfully.")
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "v-a"})
    assert openai_error(r, 404) == "The lora adapter 'v-a' cannot be found."
    assert "v-a" not in [card["id"] for card in c.get("/v1/models").json()["data"]]


def test_vllm_refusals(managed):
    c = managed.client
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "v-out", "lora_path": str(managed.outside["alpha"])})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "v-big", "lora_path": str(managed.allowed / "rank32")})
    assert "above max_lora_rank 16" in openai_error(r, 400)
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "v-none"})
    assert openai_error(r, 400) == "Both 'lora_name' and 'lora_path' must be provided."
    r = c.post("/v1/unload_lora_adapter", json={})
    assert openai_error(r, 400) == "'lora_name' needs to be provided to unload a LoRA adapter."


# ---- logs and metrics --------------------------------------------------------------------------------


def test_the_access_line_names_the_adapter(managed):
    c = managed.client
    rid = f"lora-{uuid.uuid4().hex[:12]}"
    r = c.post("/adapters", params={"name": "logged", "src": "alpha"}, headers={"X-Request-Id": rid})
    assert r.status_code == 200
    fields = managed.access(rid)
    assert (fields["adapter"], fields["model"], fields["route"]) == ("logged", managed.name, "/adapters")
    rid = f"lora-{uuid.uuid4().hex[:12]}"
    c.delete("/adapters/logged", headers={"X-Request-Id": rid})
    assert managed.access(rid)["adapter"] == "logged"
    rid = f"lora-{uuid.uuid4().hex[:12]}"
    c.get("/models", headers={"X-Request-Id": rid})
    assert "adapter" not in managed.access(rid)  # only on requests that have one


def test_metrics_count_the_adapters(managed):
    c = managed.client
    assert status(c.post("/adapters", params={"name": "counted", "src": "alpha", "pin": "true"}))
    try:
        text = c.get("/metrics").text
        name = managed.name
        info = re.search(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", text, re.MULTILINE)
        assert info is not None, text
        labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
        assert labels == {"max_lora": "4", "model_name": name, "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert float(info.group(2)) > 1.7e9  # a timestamp, as vLLM's
        assert f'lmiserve_lora_requests_total{{adapter="counted",model_name="{name}"}} 0.0' in text
        assert f'lmiserve_lora_running_requests{{adapter="counted",model_name="{name}"}} 0.0' in text
        assert re.search(rf'^lmiserve_lora_adapters_loaded\{{model_name="{name}"\}} [1-9]', text, re.MULTILINE)
    finally:
        c.delete("/adapters/counted")


# ---- the shared servers (read only) ------------------------------------------------------------------


def test_adapters_named_at_start_are_listed_everywhere(lora_server, lora_adapter_dirs):
    cards = {card["id"]: card for card in lora_server.get("/v1/models").json()["data"]}
    for name, path in lora_adapter_dirs.items():
        assert (cards[name]["parent"], cards[name]["root"]) == (lora_server.name, str(path.resolve()))
    listed = lora_server.get(f"/models/{lora_server.name}/adapters").json()["adapters"]
    assert sorted(a["name"] for a in listed) == sorted(lora_adapter_dirs)
    assert "vllm:lora_requests_info{" in lora_server.get("/metrics").text


def test_a_model_without_enable_lora_says_how_to_serve_adapters(server):
    r = server.client.post("/adapters", json={"name": "x", "src": "/anywhere"})
    message = frontend(r, 400, "BadRequestException")
    assert message == (
        f"Model {server.name} does not serve LoRA adapters: start it with enable_lora=true "
        "(or name adapters with lora_modules)."
    )
    r = server.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/anywhere"})
    assert "enable_lora=true" in openai_error(r, 400)
    assert server.get("/adapters").status_code == 400
    assert "vllm:lora_requests_info" not in server.get("/metrics").text

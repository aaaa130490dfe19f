"""What the schemas cannot see in the rendered objects: names, selectors against pod labels,
ports against probes and Services, GPUs against TP, the connector's JSON, the proxy's
discovery arguments, keys kept to files, and the proxy's API rights."""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest
import yaml

from appliance import keys as node_keys
from appliance.proxy.settings import ProxySettings
from tests.charts.cases import CASES, KEYS, Rendered, merged, protocol, rdma_devices
from tests.charts.helmtool import CHART
from tests.charts.objects import (
    COMPONENT,
    Doc,
    container,
    env,
    flag,
    kv_config,
    of_kind,
    pod,
    port_number,
    probe_port,
    probes,
    proxy_settings,
    workload,
)

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
KEYS_DIR = "/etc/pd-appliance/keys"
ROLES = ("prefill", "decode")
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def effective(name: str) -> dict[str, Any]:
    return merged(DEFAULTS, CASES[name].values)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_templates(docs: list[Doc]) -> list[dict[str, str]]:
    return [w["spec"]["template"]["metadata"]["labels"] for w in of_kind(docs, "Deployment")]


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest, rendered: Rendered) -> tuple[str, list[Doc]]:
    return request.param, rendered(request.param)


def test_names_and_labels(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    release = CASES[name].release
    for d in docs:
        meta = d["metadata"]
        assert DNS1123_LABEL.match(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "pd-appliance"
        assert labels["app.kubernetes.io/instance"] == release
        assert labels[COMPONENT] in {"prefill", "decode", "proxy", "keys"}
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "pd-appliance-0.1.0"
        assert meta["name"].endswith("-" + labels[COMPONENT])
        if release == "pd":
            base = effective(name).get("fullnameOverride") or "pd-pd-appliance"
            assert meta["name"] == f"{base}-{labels[COMPONENT]}"
    for labels in pod_templates(docs):
        assert labels["app.kubernetes.io/instance"] == release


def test_selectors_pick_exactly_their_role(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    selectors = [(d, d["spec"]["selector"]) for d in of_kind(docs, "Service")]
    selectors += [(d, d["spec"]["selector"]["matchLabels"])
                  for d in of_kind(docs, "PodDisruptionBudget")]
    selectors += [(d, d["spec"]["podSelector"]["matchLabels"])
                  for d in of_kind(docs, "NetworkPolicy")]
    for w in of_kind(docs, "Deployment"):
        selectors.append((w, w["spec"]["selector"]["matchLabels"]))
        for c in pod(w).get("topologySpreadConstraints", []):
            assert c["topologyKey"] == "kubernetes.io/hostname"
            selectors.append((w, c["labelSelector"]["matchLabels"]))
    assert len(selectors) >= 11
    for d, sel in selectors:
        chosen = [t for t in pod_templates(docs) if selects(sel, t)]
        assert len(chosen) == 1, f"{d['kind']}/{d['metadata']['name']} selects {chosen}"
        assert chosen[0][COMPONENT] == d["metadata"]["labels"][COMPONENT]
    assert {d["metadata"]["labels"][COMPONENT] for d in of_kind(docs, "PodDisruptionBudget")} \
        == {"prefill", "decode", "proxy"}


def test_ports_probes_and_services_agree(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    ports = effective(name)["ports"]
    expected = {"prefill": {("vllm", ports["prefill"]), ("bootstrap", ports["bootstrap"])},
                "decode": {("vllm", ports["decode"])}, "proxy": {("proxy", ports["proxy"])}}
    for role, listeners in expected.items():
        w = workload(docs, role)
        for cname, port in listeners:
            c = container(w, cname)
            assert port_number(c, port) == port
            listens = proxy_settings(docs)["port"] if role == "proxy" else \
                int(flag(c["args"], "--port"))
            assert listens == port  # what it listens on
            assert probes(c), f"{role}/{cname} has no probes"
            for kind, probe in probes(c):
                assert port_number(c, probe_port(probe)) == port, (role, cname, kind)
                if kind == "readinessProbe":  # the proxy's: while it can answer
                    assert probe["httpGet"]["path"] == ("/ready" if role == "proxy"
                                                        else "/health")
    for svc in of_kind(docs, "Service"):
        w = workload(docs, svc["metadata"]["labels"][COMPONENT])
        for p in svc["spec"]["ports"]:
            targets = []
            for c in pod(w)["containers"]:
                names = {cp["name"]: cp["containerPort"] for cp in c.get("ports", [])}
                targets += [names[p["targetPort"]]] if p["targetPort"] in names else []
            assert targets == [p["port"]], (svc["metadata"]["name"], p)


def test_headless_services_and_the_proxy_service(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    services = {s["metadata"]["labels"][COMPONENT]: s["spec"] for s in of_kind(docs, "Service")}
    for role in ROLES:
        assert services[role]["clusterIP"] == "None"
        assert services[role]["publishNotReadyAddresses"] is False
    proxy = services["proxy"]
    assert proxy["type"] == effective(name)["proxy"]["service"]["type"]
    if name == "loadbalancer":
        assert proxy["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
        assert proxy["ports"][0]["nodePort"] == 30080


def test_replicas_gpus_and_devices(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    v, spec = effective(name), CASES[name]
    rdma = protocol(v) == "rdma"
    for role, tp, replicas in zip(ROLES, spec.tp, spec.replicas, strict=True):
        w = workload(docs, role)
        assert w["spec"]["replicas"] == replicas
        c = container(w, "vllm")
        assert flag(c["args"], "--tensor-parallel-size") == str(tp)
        res = c["resources"]
        if v["stack"] == "gpu":
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == str(tp)
        else:
            cpus = str(v[role]["cpus"])
            assert res["limits"]["cpu"] == cpus
            assert res["requests"]["cpu"] == (v[role].get("cpuRequest") or cpus)
            assert env(c).get("VLLM_CPU_OMP_THREADS_BIND", {"value": "auto"})["value"] == "auto"
            assert flag(c["args"], "--block-size") == "32"
            assert flag(c["args"], "--kv-cache-memory-bytes") == str(1 << 30)
        image = v["images"]["vllm"]
        default = "pd-appliance/vllm" + ("-cpu" if v["stack"] == "cpu" else "")
        assert c["image"] == f"{image['repository'] or default}:{image['tag'] or '0.1.0'}"
        rdma_res = v["transfer"]["rdmaResource"]["name"]
        assert (rdma_res in res["requests"]) == rdma
        caps = c["securityContext"].get("capabilities", {}).get("add", [])
        assert ("IPC_LOCK" in caps) == rdma
        assert env(c)["PD_PROTOCOL"]["value"] == protocol(v)
        assert env(c)["PD_RDMA_DEVICE"]["value"] == rdma_devices(v, role)
        assert env(c)["PD_GPUDIRECT"]["value"] == v["transfer"]["gpudirect"]
        volumes = {vol["name"]: vol for vol in pod(w)["volumes"]}
        shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert len(shm) == 1
        assert volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory"
        assert volumes[shm[0]["name"]]["emptyDir"]["sizeLimit"]
    for c in (c for w in of_kind(docs, "Deployment") for c in pod(w)["containers"]):
        has_gpu = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
        assert has_gpu == (v["stack"] == "gpu" and c["name"] == "vllm")
    assert workload(docs, "proxy")["spec"]["replicas"] == v["proxy"]["replicas"]


def test_kv_transfer_config(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    v = effective(name)
    p, d = kv_config(workload(docs, "prefill")), kv_config(workload(docs, "decode"))
    for cfg, role, of in ((p, "kv_producer", "prefill"), (d, "kv_consumer", "decode")):
        assert cfg["kv_connector"] == "PDConnector"
        assert cfg["kv_connector_module_path"] == "appliance.connector.facade"
        assert cfg["kv_role"] == role
        assert cfg["engine_id"] == "$(POD_NAME)"
        extra = cfg["kv_connector_extra_config"]
        assert extra["host"] == "$(POD_IP)"
        assert extra["protocol"] == protocol(v)
        assert extra["device_name"] == rdma_devices(v, of)
        assert extra["bootstrap_token_file"] == f"{KEYS_DIR}/{node_keys.BOOTSTRAP_TOKEN}"
        assert extra["side_channel_key_file"] == f"{KEYS_DIR}/{node_keys.SIDE_CHANNEL_KEY}"
        assert "allowed_bootstrap_addrs" not in extra
    pe, de = p["kv_connector_extra_config"], d["kv_connector_extra_config"]
    # The port alone: the connector builds the URL from the pod IP (IPv6 in brackets).
    assert pe["bootstrap_port"] == v["ports"]["bootstrap"] and "bootstrap_addr" not in pe
    assert "bootstrap_addr" not in de and "bootstrap_port" not in de
    assert de.get("allowed_bootstrap_networks", []) == v["podNetworkCidrs"]
    assert ("allowed_bootstrap_networks" in de) == bool(v["podNetworkCidrs"])
    # One deadline policy (appliance.deadlines): D waits longer than the proxy waits for
    # P, and P holds KV longer than D waits, unless set otherwise.
    t = v["timeouts"]
    recv = t["kvRecvS"] or t["prefillS"] + t["kvTransferS"]
    assert de["recv_timeout_s"] == pytest.approx(recv)
    assert pe["send_timeout_s"] == pytest.approx(t["kvSendS"] or recv + t["kvTransferS"])
    dargs = container(workload(docs, "decode"), "vllm")["args"]
    assert flag(dargs, "--middleware") == "appliance.connector.httpguard.KVParamsGuard"
    assert "--middleware" not in container(workload(docs, "prefill"), "vllm")["args"]


def test_env_and_variable_references(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    for w in of_kind(docs, "Deployment"):
        for c in pod(w)["containers"]:
            defined: list[str] = []
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in defined, f"{c['name']}: {e['name']} uses {ref} before it"
                defined.append(e["name"])
                assert "secretKeyRef" not in str(e.get("valueFrom", {}))
            assert "envFrom" not in c
            for arg in c["args"]:
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined, f"{c['name']}: an argument uses undefined {ref}"
            fields = {n: e["valueFrom"]["fieldRef"]["fieldPath"]
                      for n, e in env(c).items() if "valueFrom" in e}
            assert fields.get("POD_IP", "status.podIP") == "status.podIP"
            assert fields.get("POD_NAME", "metadata.name") == "metadata.name"
            if c["name"] == "vllm":
                assert env(c)["VLLM_HOST_IP"]["value"] == "$(POD_IP)"
                assert env(c)["PD_API_KEY_FILE"]["value"] == f"{KEYS_DIR}/{node_keys.API_KEY}"
                assert flag(c["args"], "--host") == "$(POD_IP)"
    boot = container(workload(docs, "prefill"), "bootstrap")["args"]
    assert boot[:3] == ["python", "-m", "appliance.bootstrap"]
    assert flag(boot, "--host") == "$(POD_IP)" and flag(boot, "--ttl") == "30"
    assert flag(boot, "--token-file") == f"{KEYS_DIR}/{node_keys.BOOTSTRAP_TOKEN}"


def test_keys_only_as_files(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    v = effective(name)
    secret = v["keys"]["existingSecret"] or "pd-pd-appliance-keys"
    for w in of_kind(docs, "Deployment"):
        (vol,) = [vol for vol in pod(w)["volumes"] if "secret" in vol]
        assert vol["secret"]["secretName"] == secret
        assert sorted(i["path"] for i in vol["secret"]["items"]) == sorted(node_keys.NAMES)
        for c in pod(w)["containers"]:
            mounts = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
            assert [(m["mountPath"], m["readOnly"]) for m in mounts] == [(KEYS_DIR, True)]
    secrets = of_kind(docs, "Secret")
    if name != "inline-keys":
        assert secrets == []
        return
    (s,) = secrets
    assert s["metadata"]["name"] == secret
    assert {k: base64.b64decode(x).decode() for k, x in s["data"].items()} == {
        node_keys.API_KEY: KEYS["apiKey"], node_keys.BOOTSTRAP_TOKEN: KEYS["bootstrapToken"],
        node_keys.SIDE_CHANNEL_KEY: KEYS["sideChannelKey"]}
    text = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
    for value in KEYS.values():
        assert value not in text


def test_proxy_arguments(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    v = effective(name)
    got = proxy_settings(docs)
    assert got["host"] == "0.0.0.0" and got["port"] == v["ports"]["proxy"]
    assert got["discovery"] == "kubernetes"
    for role in ROLES:
        selector = got["kubernetes"][f"{role}_selector"]
        assert selector == (f"app.kubernetes.io/instance={CASES[name].release},"
                            f"app.kubernetes.io/component={role}")
        wanted = dict(kv.split("=", 1) for kv in selector.split(","))
        chosen = [t for t in pod_templates(docs) if selects(wanted, t)]
        assert [t[COMPONENT] for t in chosen] == [role]
        assert got["kubernetes"][f"{role}_port"] == v["ports"][role]
    assert got["kubernetes"]["bootstrap_port"] == v["ports"]["bootstrap"]
    assert got["policy"] == v["proxy"]["policy"]
    assert got["split"] == v["proxy"]["split"]
    assert float(got["prefill_timeout_s"]) == v["timeouts"]["prefillS"]
    assert float(got["kv_transfer_s"]) == v["timeouts"]["kvTransferS"]
    endpoint = v["tracing"]["otlpEndpoint"]
    assert got.get("otlp_traces_endpoint", "") == endpoint
    assert ("otlp_traces_protocol" in got) == bool(endpoint)
    if endpoint:
        assert float(got["otlp_traces_sample_ratio"]) == v["tracing"]["sampleRatio"]
    for role in ROLES:
        vllm = container(workload(docs, role), "vllm")
        if endpoint:
            assert flag(vllm["args"], "--otlp-traces-endpoint") == endpoint
        else:
            assert "--otlp-traces-endpoint" not in vllm["args"]
        names = {e["name"]: e.get("value") for e in vllm["env"]}
        assert names.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == (endpoint or None)
    if v["proxy"].get("itlSloMs") is not None:
        assert float(got["itl_slo_ms"]) == v["proxy"]["itlSloMs"]
    else:
        assert "itl_slo_ms" not in got
    for key, value in v["proxy"]["settings"].items():  # passed through as given
        if isinstance(value, dict):  # a table: merged with the chart's
            assert value.items() <= got[key].items()
        else:
            assert got[key] == value

    # model.decodePrefillChunk: D's flag, and the proxy's, which weighs a local prefill by it.
    chunk = v["model"].get("decodePrefillChunk")
    if chunk is None:  # the stack's default
        chunk = 128 if v["stack"] == "cpu" else 512
    decode_args = container(workload(docs, "decode"), "vllm")["args"]
    if chunk:
        assert flag(decode_args, "--long-prefill-token-threshold") == str(chunk)
        assert got["decode_prefill_chunk"] == chunk
    else:
        assert "--long-prefill-token-threshold" not in decode_args
        assert "decode_prefill_chunk" not in got
    assert "--long-prefill-token-threshold" not in container(workload(docs, "prefill"),
                                                             "vllm")["args"]
    # model.maxNumBatchedTokens: both engines' step budget (0: vLLM's own).
    budget = v["model"].get("maxNumBatchedTokens")
    if budget is None:  # the stack's default
        budget = 256 if v["stack"] == "cpu" else 0
    for role in ROLES:
        args = container(workload(docs, role), "vllm")["args"]
        if budget:
            assert flag(args, "--max-num-batched-tokens") == str(budget)
        else:
            assert "--max-num-batched-tokens" not in args
    # The engines' block size, which the prefix index hashes by from the first request.
    for role in ROLES:
        assert str(got["kv_block_size"]) == flag(
            container(workload(docs, role), "vllm")["args"], "--block-size")
    # proxy.tokenizer: the model's volume, mounted as P and D mount it, and its path.
    proxy_pod = pod(workload(docs, "proxy"))
    model_mounts = [m for m in container(workload(docs, "proxy"), "proxy")["volumeMounts"]
                    if m["name"] == "model"]
    if v["proxy"].get("tokenizer"):
        assert got["tokenizer"] == v["model"]["path"]
        vllm_pod = pod(workload(docs, "decode"))
        assert [x for x in proxy_pod["volumes"] if x["name"] == "model"] == \
            [x for x in vllm_pod["volumes"] if x["name"] == "model"]
        assert model_mounts == [m for m in container(workload(docs, "decode"), "vllm")[
            "volumeMounts"] if m["name"] == "model"]
        assert model_mounts[0]["readOnly"] is True
    else:
        assert "tokenizer" not in got and not model_mounts
        assert all(x["name"] != "model" for x in proxy_pod["volumes"])
    assert got["backend_api_key_file"] == f"{KEYS_DIR}/{node_keys.API_KEY}"
    assert got["bootstrap_token_file"] == f"{KEYS_DIR}/{node_keys.BOOTSTRAP_TOKEN}"
    assert got["side_channel_key_file"] == f"{KEYS_DIR}/{node_keys.SIDE_CHANNEL_KEY}"


def test_the_proxys_file_holds_valid_settings(case: tuple[str, list[Doc]]) -> None:
    """As the proxy reads it in its pod (the namespace, API server and keys filled in)."""
    _, docs = case
    got = proxy_settings(docs)
    got["kubernetes"]["namespace"] = "serving"
    settings = ProxySettings.model_validate(
        {**got, "backend_api_key": "k", "bootstrap_token": "t"},
        context={"environ": {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}})
    assert settings.kubernetes.api_server == "https://10.96.0.1:443"


def test_rbac_reads_pods_only(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    (role,) = of_kind(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert of_kind(docs, "ClusterRole") == [] and of_kind(docs, "ClusterRoleBinding") == []
    (sa,), (binding,) = of_kind(docs, "ServiceAccount"), of_kind(docs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "serving"}]
    assert pod(workload(docs, "proxy"))["serviceAccountName"] == sa["metadata"]["name"]
    for r in ROLES:  # P and D get no API token at all
        assert pod(workload(docs, r))["automountServiceAccountToken"] is False


def test_startup_budget_covers_model_loading(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    budget = effective(name)["timeouts"]["startupS"]
    for role in ROLES:
        probe = container(workload(docs, role), "vllm")["startupProbe"]
        assert probe["httpGet"]["path"] == "/health"
        assert probe["periodSeconds"] * probe["failureThreshold"] >= budget

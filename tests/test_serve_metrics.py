"""kestrel serve's GET /metrics, against a server process on cpu_ref (the tiny preset with a chat template): Prometheus'
text format, each metric with its HELP, behind the API key; its counters move by a completion's usage."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_process import ServeProcess
from serve_helpers import chat_model
from kestrel_core.engine.kvcache import kv_bytes
from kestrel_core.formats.modelconfig import parse_model_config
from kestrel_core.serve.metrics import ServeMetrics, route_of

KEY = "metrics-key-1"
MAX_BATCH = 4
FAMILIES = {  # name: type
    "kestrel_requests": "counter", "kestrel_prompt_tokens": "counter", "kestrel_generation_tokens": "counter",
    "kestrel_requests_running": "gauge", "kestrel_requests_waiting": "gauge", "kestrel_batch_occupancy": "gauge",
    "kestrel_bytes_streamed_per_token": "gauge", "kestrel_bytes_streamed": "counter", "kestrel_kv_cache_bytes": "gauge",
    "kestrel_time_to_first_token_seconds": "histogram", "kestrel_inter_token_latency_seconds": "histogram"}


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny preset with a chat template and 4096 positions (room for a stream long enough to scrape during)."""
    return chat_model(tiny_ckpt, tmp_path_factory.mktemp("metrics") / "tiny", 4096)


class Server(ServeProcess):
    def __init__(self, model: Path):
        super().__init__(model, "--backend", "cpu_ref", "--max-seq", "2048", "--max-batch", str(MAX_BATCH),
                         "--keep", "2", "--policy", "asymmetric",  # 2 of the 6 layers resident: it streams
                         env={"KESTREL_API_KEY": KEY})

    def get(self, path: str, key: str | None = KEY, **headers) -> httpx.Response:
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.url}{path}", headers={**auth, **headers}, timeout=30)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    def metrics(self) -> dict:
        """{family name: family} of a scrape, parsed by prometheus_client's own parser."""
        response = self.get("/metrics")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain")
        return {f.name: f for f in text_string_to_metric_families(response.text)}


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    s.stop(30)


def config(model: str):
    return parse_model_config(json.loads((Path(model) / "config.json").read_text()))


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    """The value of ``sample`` (default: the family's own name, or its _total) whose labels include ``labels``; 0
    where none has been recorded."""
    family = families[name]
    wanted = {sample} if sample else {name, f"{name}_total"}
    found = [s.value for s in family.samples if s.name in wanted and labels.items() <= s.labels.items()]
    assert len(found) <= 1, found
    return found[0] if found else 0.0


def test_every_metric_is_there_with_its_help_and_type(server):
    text = server.get("/metrics").text
    families = server.metrics()
    for name, kind in FAMILIES.items():
        assert families[name].type == kind, name
        assert families[name].documentation, name
        assert f"# HELP {name}" in text
    assert value(families, "kestrel_requests_running") == 0 and value(families, "kestrel_requests_waiting") == 0
    assert value(families, "kestrel_bytes_streamed") > 0  # the warm-up token's
    # in host memory the cache holds every slot's --max-seq positions and the park row, keys and values, float32
    assert value(families, "kestrel_kv_cache_bytes") == kv_bytes(config(server.path), 2048 + 1, torch.float32,
                                                                 MAX_BATCH)
    assert "kestrel_device_peak_bytes" not in families  # cpu_ref reports no device memory
    assert not any(name.startswith(("python_", "process_")) for name in families)  # not the global registry's


def test_kestrel_info_says_what_the_server_runs_as_the_start_does(server):
    """The start said nothing of the backend's device, the draft, the ranks or the expert budget, and /metrics nothing
    of what it served."""
    server.wait_for("ready in")
    (sample,) = server.metrics()["kestrel_info"].samples
    labels = sample.labels
    assert sample.value == 1
    assert labels == {"model": str(server.path), "served_as": server.name, "backend": "cpu_ref", "device": "cpu",
                      "keep": "2", "draft": "none", "ranks": "1", "expert_budget": "none",
                      "max_batch": str(MAX_BATCH), "max_positions": "2048", "address": server.url}
    line = server.wait_for("kestrel serve: serving: ")
    said = dict(kv.split("=", 1) for kv in line.split("serving: ", 1)[1].split(" "))
    assert said == labels  # none of these values holds a space
    start = server.lines.index(line)
    assert any(server.url in x and "ready in" in x for x in server.lines[start:])  # the block ends at the address


def test_keep_auto_is_said_with_what_it_chose(tiny_ckpt):
    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.service import Limits, Service

    service = Service(KestrelConfig().override(model=str(tiny_ckpt), backend__name="cpu_ref"), "tiny", Limits())
    assert service.info() == {}  # nothing while it loads: kestrel_info is left out
    assert b"kestrel_info" not in service.metrics.exposition()[0]
    service.load()
    try:
        info = service.info()
        assert info["keep"] == f"auto:{service.run.config.residency.keep}" and info["keep"] != "auto:auto"
        assert b'kestrel_info{' in service.metrics.exposition()[0]
    finally:
        service.close()


def test_a_completion_moves_the_counters_by_its_usage(server):
    before = server.metrics()
    body = {"model": server.name, "prompt": [5, 17, 42, 99, 3], "max_tokens": 12, "ignore_eos": True}
    usage = server.post("/v1/completions", body).json()["usage"]
    after = server.metrics()

    def moved(name, sample=None, **labels):
        return value(after, name, sample, **labels) - value(before, name, sample, **labels)

    assert usage["prompt_tokens"] == 5 and usage["completion_tokens"] == 12
    assert moved("kestrel_prompt_tokens") == usage["prompt_tokens"]
    assert moved("kestrel_generation_tokens") == usage["completion_tokens"]
    assert moved("kestrel_requests", route="/v1/completions", status="2xx") == 1
    assert moved("kestrel_time_to_first_token_seconds", "kestrel_time_to_first_token_seconds_count") == 1
    assert moved("kestrel_inter_token_latency_seconds", "kestrel_inter_token_latency_seconds_count") == 11
    assert moved("kestrel_time_to_first_token_seconds", "kestrel_time_to_first_token_seconds_sum") > 0
    assert moved("kestrel_bytes_streamed") > 0
    assert value(after, "kestrel_bytes_streamed_per_token") > 0
    assert moved("kestrel_requests", route="/metrics", status="2xx") == 1  # the scrape before this one


def test_n_choices_count_the_prompt_once_and_every_choices_tokens(server):
    before = server.metrics()
    body = {"model": server.name, "prompt": [1, 2, 3], "max_tokens": 4, "n": 3, "ignore_eos": True,
            "temperature": 1.0, "seed": 7}
    usage = server.post("/v1/completions", body).json()["usage"]
    after = server.metrics()
    assert value(after, "kestrel_prompt_tokens") - value(before, "kestrel_prompt_tokens") == usage["prompt_tokens"] == 3
    assert (value(after, "kestrel_generation_tokens") - value(before, "kestrel_generation_tokens")
            == usage["completion_tokens"] == 12)
    count = "kestrel_time_to_first_token_seconds_count"
    assert value(after, "kestrel_time_to_first_token_seconds", count) - \
        value(before, "kestrel_time_to_first_token_seconds", count) == 3


def test_refusals_are_counted_by_route_and_status_class(server):
    before = server.metrics()
    assert server.post("/v1/completions", {"model": "gpt-4", "prompt": [1]}).status_code == 404
    assert server.post("/tokenize", {"prompt": 5}).status_code == 400
    assert server.get("/v1/models", key=None).status_code == 401
    assert server.get("/v1/models", Host="attacker.example").status_code == 403
    assert server.get("/no/such/route/12345").status_code == 404
    after = server.metrics()
    for route, n in (("/v1/completions", 1), ("/tokenize", 1), ("/v1/models", 2), ("other", 1)):
        moved = value(after, "kestrel_requests", route=route, status="4xx") - \
            value(before, "kestrel_requests", route=route, status="4xx")
        assert moved == n, route
    routes = {s.labels["route"] for s in after["kestrel_requests"].samples}
    assert "/no/such/route/12345" not in routes


def test_running_waiting_and_occupancy_follow_the_batch(server):
    """A long stream holds a slot: a scrape while it runs sees it in the batch, and one after it left does not."""
    body = {"model": server.name, "prompt": [1, 2], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is generating
        during = server.metrics()
        assert value(during, "kestrel_requests_running") == 1
        assert value(during, "kestrel_batch_occupancy") == pytest.approx(1 / MAX_BATCH)
        assert value(during, "kestrel_requests_waiting") == 0
    # gone before its end: the disconnect cancels it, and its slot is free again
    for _ in range(200):
        if value(server.metrics(), "kestrel_requests_running") == 0:
            break
        time.sleep(0.05)
    assert value(server.metrics(), "kestrel_batch_occupancy") == 0


def test_metrics_need_the_key_and_health_does_not(server):
    for key in (None, KEY + "x"):
        response = server.get("/metrics", key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert server.get("/metrics", Host="attacker.example").status_code == 403
    assert server.get("/health", key=None).status_code == 200


def test_two_servers_in_one_process_keep_their_own_registries():
    a, b = ServeMetrics(dict), ServeMetrics(lambda: {"running": 2, "occupancy": 0.25})
    a.ended(5, [[1.0, 1.5, 1.75]], 0.5, 100.0)
    fa = {f.name: f for f in text_string_to_metric_families(a.exposition()[0].decode())}
    fb = {f.name: f for f in text_string_to_metric_families(b.exposition()[0].decode())}
    assert value(fa, "kestrel_prompt_tokens") == 5 and value(fb, "kestrel_prompt_tokens") == 0
    assert value(fa, "kestrel_generation_tokens") == 3
    assert value(fa, "kestrel_inter_token_latency_seconds", "kestrel_inter_token_latency_seconds_count") == 2
    assert value(fa, "kestrel_time_to_first_token_seconds", "kestrel_time_to_first_token_seconds_sum") == 0.5
    assert value(fa, "kestrel_bytes_streamed_per_token") == 100.0
    assert value(fb, "kestrel_requests_running") == 2 and value(fb, "kestrel_batch_occupancy") == 0.25
    assert value(fa, "kestrel_requests_running") == 0  # a model still loading: nothing to read


def test_route_labels_are_bounded():
    assert route_of("/v1/completions") == "/v1/completions"
    assert route_of("/v1/models/tiny") == "/v1/models/{name}"
    assert route_of("/wp-admin/x") == "other" and route_of("/v1/completions/x") == "other"


def test_the_device_peak_is_a_gauge_where_the_backend_reports_one():
    """cuda reports its device memory's peak (``memory_stats``): the scrape carries it, and the KV cache's bytes."""
    import types

    from kestrel_core.serve.service import Service

    backend = types.SimpleNamespace(memory_stats=lambda: {"device_peak_bytes": 3 * 2**30, "budget_bytes": 1})
    runner = types.SimpleNamespace(snapshot=lambda: {"bytes_uploaded": 5, "bytes_read_host": 7})
    fake = types.SimpleNamespace(scheduler=types.SimpleNamespace(running=1, waiting=0, max_batch=4,
                                                                 kv_cache_bytes=2**20),
                                 run=types.SimpleNamespace(runner=runner, backend=backend))
    figures = Service.figures(fake)
    assert figures["device_peak_bytes"] == 3 * 2**30 and figures["kv_cache_bytes"] == 2**20
    assert figures["bytes_streamed"] == 12
    families = {f.name: f for f in text_string_to_metric_families(ServeMetrics(lambda: figures).exposition()[0]
                                                                   .decode())}
    assert families["kestrel_device_peak_bytes"].type == "gauge"
    assert value(families, "kestrel_device_peak_bytes") == 3 * 2**30
    assert value(families, "kestrel_kv_cache_bytes") == 2**20

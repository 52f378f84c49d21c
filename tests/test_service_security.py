"""API keys, TLS and mutual TLS, bind defaults, and ports already in use."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from image_pipeline import prepare_image
from tests.support.certs import make_certs
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.client import Security, VisionLanguageClient, VlmError
from vlm_server.client.cli import main as client_main
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.frontend.api_keys import ApiKeys, read_keys_file
from vlm_server.models.interface import LoadedModel
from vlm_server.options.command_line import load_config
from vlm_server.options.table import ServerConfig
from vlm_server.rpc.auth import bearer_token, client_identity
from vlm_server.server.lifecycle import ListenError, VisionLanguageServer, api_keys

REPO_ROOT = Path(__file__).resolve().parents[1]
KEYS = ("alpha-key", "beta-key")


def _reference(tiny: LoadedModel) -> BatchedEngine:
    return BatchedEngine(tiny, EngineConfig(max_batch_size=1, kv_budget_bytes=16 << 20))


# ---- API keys -----------------------------------------------------------------------------


def test_api_key_check_accepts_only_the_configured_keys() -> None:
    check = ApiKeys(KEYS)
    assert check("alpha-key") and check("beta-key")
    assert not check("alpha") and not check("") and not check(None)
    assert bearer_token((("authorization", "Bearer  abc "),)) == "abc"
    assert bearer_token((("authorization", "Basic abc"),)) is None
    who = client_identity(check, (("authorization", "Bearer beta-key"),), "ipv4:10.1.2.3:555")
    assert who.startswith("key:") and "beta" not in who
    assert client_identity(check, (), "ipv4:10.1.2.3:555") == "ipv4:10.1.2.3"
    with pytest.raises(ValueError):
        ApiKeys([])


def test_api_keys_come_from_the_environment_and_a_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# team keys\nfile-key-1\n\n  file-key-2  # the CI's\n")
    assert read_keys_file(path) == ("file-key-1", "file-key-2")
    config = load_config(["--api-keys-file", str(path)], environ={"VLM_API_KEYS": "env-key, other"})
    keys = api_keys(config)
    assert keys is not None and len(keys) == 4
    assert all(keys(k) for k in ("env-key", "other", "file-key-1", "file-key-2"))
    assert dict(config.items())["api_keys"] == "<2 keys>"  # never logged
    assert api_keys(ServerConfig()) is None


@pytest.fixture(scope="module")
def guarded(tiny: LoadedModel) -> Iterator[ServerThread]:
    with ServerThread(local_config(api_keys=KEYS), in_process(lambda: _reference(tiny))) as running:
        yield running


def test_calls_without_a_valid_key_are_unauthenticated(guarded: ServerThread) -> None:
    for security, words in ((None, "missing API key"), (Security(api_key="nope"), "invalid")):
        with VisionLanguageClient(guarded.target, timeout=30, security=security) as client:
            with pytest.raises(VlmError) as caught:
                client.model_info()
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert words in caught.value.message
            with pytest.raises(VlmError) as caught:
                client.query(None, "hello?", max_tokens=2)
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    with VisionLanguageClient(guarded.target, timeout=30, security=Security("beta-key")) as ok:
        assert ok.model_info().model_name == "tiny"
        assert ok.query(None, "hello?", max_tokens=2, temperature=0).finish_reason


def test_vlm_client_sends_the_key_from_its_flag_or_environment(
    guarded: ServerThread, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["info", "--target", guarded.target, "--timeout", "30"]
    assert client_main([*base, "--api-key", "alpha-key"]) == 0
    assert "model_name: tiny" in capsys.readouterr().out
    assert client_main(base) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("VLM_API_KEY", "beta-key")
    assert client_main(base) == 0


def test_health_stays_open_and_reflection_needs_a_key(guarded: ServerThread) -> None:
    with grpc.insecure_channel(guarded.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        listing = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        with pytest.raises(grpc.RpcError) as caught:
            list(reflect.ServerReflectionInfo(listing, timeout=10))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_one_key_cannot_flush_the_images_another_key_uploaded(tiny: LoadedModel) -> None:
    pictures = []
    for i in range(8):
        out = io.BytesIO()
        Image.new("RGB", (64, 48), (i * 30, 255 - i * 30, 90)).save(out, format="PNG")
        pictures.append(out.getvalue())
    size = prepare_image(pictures[0]).crops.nbytes
    config = local_config(
        api_keys=KEYS, image_cache_bytes=4 * size, image_cache_client_bytes=2 * size
    )
    alice, mallory = Security("alpha-key"), Security("beta-key")
    with ServerThread(config, in_process(lambda: _reference(tiny))) as server:
        with VisionLanguageClient(server.target, timeout=60, security=alice) as client:
            kept = client.encode_image(pictures[0])
        with VisionLanguageClient(server.target, timeout=60, security=mallory) as client:
            ids = [client.encode_image(p) for p in pictures[1:]]
            with pytest.raises(VlmError) as caught:  # her own oldest went first
                client.caption(ids[0], max_tokens=1)
            assert caught.value.field == "image_id"
        with VisionLanguageClient(server.target, timeout=60, security=alice) as client:
            assert client.caption(kept, max_tokens=1, temperature=0).finish_reason


# ---- TLS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_tls_serves_only_tls_clients(tiny: LoadedModel, certs: Path) -> None:
    config = local_config(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"))
    with ServerThread(config, in_process(lambda: _reference(tiny))) as server:
        secure = Security(ca_cert=certs / "ca.pem")
        with VisionLanguageClient(server.target, timeout=30, security=secure) as client:
            assert client.model_info().model_name == "tiny"
        with VisionLanguageClient(server.target, timeout=5) as plain:
            with pytest.raises(VlmError) as caught:
                plain.model_info()
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_ca(tiny: LoadedModel, certs: Path) -> None:
    config = local_config(
        tls_cert=str(certs / "server.pem"),
        tls_key=str(certs / "server.key"),
        tls_client_ca=str(certs / "ca.pem"),
    )
    with ServerThread(config, in_process(lambda: _reference(tiny))) as server:
        no_cert = Security(ca_cert=certs / "ca.pem")
        with VisionLanguageClient(server.target, timeout=5, security=no_cert) as client:
            with pytest.raises(VlmError) as caught:
                client.model_info()
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        mutual = Security(
            ca_cert=certs / "ca.pem",
            client_cert=certs / "client.pem",
            client_key=certs / "client.key",
        )
        with VisionLanguageClient(server.target, timeout=30, security=mutual) as client:
            assert client.model_info().model_name == "tiny"


@pytest.mark.parametrize(
    "overrides",
    [{"tls_cert": "a.pem"}, {"tls_key": "a.key"}, {"tls_client_ca": "ca.pem"}],
)
def test_tls_settings_that_cannot_work_are_refused(overrides: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="tls_"):
        ServerConfig(**overrides)


# ---- bind defaults and ports in use -------------------------------------------------------


def test_metrics_listen_on_loopback_by_default(tiny: LoadedModel) -> None:
    assert ServerConfig().metrics_host == "127.0.0.1"
    config = local_config(host="0.0.0.0")  # every interface for gRPC, not for metrics
    with ServerThread(config, in_process(lambda: _reference(tiny))) as server:
        assert server.server is not None
        http = server.server.metrics._http
        assert http is not None and http.server_address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert b"process_resident_memory_bytes" in response.read()


def test_a_second_server_on_a_taken_port_fails_naming_it(tiny: LoadedModel, tmp_path: Path) -> None:
    with ServerThread(local_config(), in_process(lambda: _reference(tiny))) as first:
        assert first.server is not None
        port = first.server.port
        taken = local_config(port=port)

        async def start_second() -> None:
            second = VisionLanguageServer(taken, in_process(lambda: _reference(tiny)))
            await second.start()

        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: port {port} is in use"):
            first.run(start_second())
        busy_metrics = local_config(metrics_port=first.server.metrics_port)

        async def start_third() -> None:
            third = VisionLanguageServer(busy_metrics, in_process(lambda: _reference(tiny)))
            await third.start()

        with pytest.raises(ListenError, match=f"metrics on 127.0.0.1:{busy_metrics.metrics_port}"):
            first.run(start_third())


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "vlm_server.cli", "serve", "--host", "127.0.0.1", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**os.environ, "VLM_LOG_FORMAT": "kv"})  # fmt: skip


def test_vlm_serve_on_a_taken_port_exits_with_one_line(tiny: LoadedModel) -> None:
    with ServerThread(local_config(), in_process(lambda: _reference(tiny))) as first:
        assert first.server is not None
        done = _serve("--port", str(first.server.port), "--metrics-port", "0")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "level=error" in line]
    assert len(errors) == 1 and f"port {first.server.port} is in use" in errors[0]
    assert "--port" in errors[0] and "Traceback" not in done.stderr
    # Nothing but the server's own log lines: no line of gRPC's core (E0000 ...).
    assert all(line.startswith("ts=") for line in done.stderr.splitlines() if line), done.stderr


def test_vlm_serve_on_a_taken_metrics_port_exits_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve("--port", "0", "--metrics-port", str(port))
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "level=error" in line]
    assert len(errors) == 1 and f"metrics on 127.0.0.1:{port}" in errors[0], done.stderr
    assert "Traceback" not in done.stderr

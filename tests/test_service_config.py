"""Server configuration (flags, VLM_* environment, sizes) and the structured log format."""

from __future__ import annotations

import json
import logging

import pytest

from vlm_server.frontend.logs import JsonFormatter, KeyValueFormatter
from vlm_server.options.command_line import build_parser, load_config
from vlm_server.options.spec import parse_size
from vlm_server.options.table import OPTIONS, ServerConfig


def test_defaults() -> None:
    config = load_config([], environ={})
    assert config == ServerConfig()
    assert config.max_message_bytes == 32 << 20
    assert config.image_limits.max_image_bytes == 32 << 20
    assert config.engine == "batched" and config.port == 50051


def test_environment_then_flags_take_precedence() -> None:
    env = {
        "VLM_PORT": "6000",
        "VLM_MAX_BATCH_SIZE": "8",
        "VLM_MAX_MESSAGE_BYTES": "64MiB",
        "VLM_MODEL": "/models/md2",
        "VLM_DTYPE": "bf16",
    }
    config = load_config(["--port", "7000", "--max-queue", "5"], environ=env)
    assert (config.port, config.max_batch_size, config.max_queue) == (7000, 8, 5)
    assert config.max_message_bytes == 64 << 20
    assert (config.model, config.dtype) == ("/models/md2", "bf16")


def test_every_option_has_a_flag_and_an_environment_variable() -> None:
    fields = {name for name, _ in ServerConfig().items()}
    assert {opt.name for opt in OPTIONS} == fields
    assert all(opt.env == "VLM_" + opt.name.upper() for opt in OPTIONS)


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("2KiB", 2048), ("32MiB", 32 << 20), ("1g", 1 << 30), ("5 MB", 5 << 20)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        ([], {"VLM_PORT": "many"}),
        ([], {"VLM_DTYPE": "int4"}),
        (["--max-queue", "0"], {}),
        (["--max-batch-size", "8", "--max-step-tokens", "8"], {}),  # no room for a prefill
        (["--max-message-bytes", "lots"], {}),
        (["--log-format", "xml"], {}),
        (["--gil-switch-interval-ms", "0"], {}),
        (["--gil-switch-interval-ms", "1000"], {}),
        (["--prefill-sm-carveout", "-1"], {}),
    ],
)
def test_bad_values_are_refused(
    argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        load_config(argv, environ=env)
    assert caught.value.code == 2
    assert "error" in capsys.readouterr().err


def _record(**fields: object) -> logging.LogRecord:
    record = logging.LogRecord("vlm.access", logging.INFO, __file__, 1, "request", None, None)
    record.fields = fields
    return record


def test_key_value_and_json_log_lines() -> None:
    record = _record(
        request_id="ab12", task="caption", code="OK", total_ms=12.3456, error="bad thing = here"
    )
    line = KeyValueFormatter().format(record)
    assert "msg=request request_id=ab12 task=caption code=OK total_ms=12.346" in line
    assert 'error="bad thing = here"' in line and "\n" not in line
    data = json.loads(JsonFormatter().format(record))
    assert data["task"] == "caption" and data["total_ms"] == 12.3456 and data["level"] == "info"


def test_help_lists_the_choices_of_every_enum_flag() -> None:
    text = " ".join(build_parser("vlm serve").format_help().split())
    for opt in OPTIONS:
        if opt.choices:
            assert f"(one of: {', '.join(opt.choices)})" in text, opt.name
    assert "(one of: batched, reference)" in text and "(one of: kv, json)" in text


def test_security_and_limit_flags_read_the_environment() -> None:
    env = {
        "VLM_API_KEYS": "a,b",
        "VLM_IMAGE_CACHE_CLIENT_BYTES": "64MiB",
        "VLM_MAX_OBJECT_CHARS": "80",
        "VLM_MAX_QUESTION_CHARS": "500",
        "VLM_METRICS_HOST": "0.0.0.0",
    }
    config = load_config([], environ=env)
    assert config.api_keys == ("a", "b") and config.client_cache_bytes == 64 << 20
    assert (config.max_object_chars, config.metrics_host) == (80, "0.0.0.0")
    assert config.max_question_chars == 500
    small = load_config(["--image-cache-bytes", "16MiB"], environ={})
    assert small.client_cache_bytes == 16 << 20  # never more than the whole cache


def test_constraint_flags_reach_the_engine_limits() -> None:
    config = load_config(
        ["--max-choices", "3", "--max-regex-chars", "40", "--constraint-compile-seconds", "0.5"],
        environ={},
    )
    limits = config.constraint_limits
    assert (limits.max_choices, limits.max_regex_chars, limits.constraint_compile_seconds) == (
        3,
        40,
        0.5,
    )
    with pytest.raises(SystemExit):
        load_config(["--max-choices", "0"], environ={})


def test_engine_and_interpreter_tuning_flags() -> None:
    config = load_config(["--gil-switch-interval-ms", "0.5", "--prefill-sm-carveout", "16"])
    assert config.gil_switch_interval_ms == 0.5 and config.prefill_sm_carveout == 16
    assert load_config([], environ={"VLM_PREFILL_SM_CARVEOUT": "8"}).prefill_sm_carveout == 8
    with pytest.raises(ValueError, match="gil_switch_interval_ms"):
        ServerConfig(gil_switch_interval_ms=0.001)


def test_gpu_decode_threshold_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert ServerConfig().image_gpu_decode_min_pixels == 0  # off by default
    config = load_config([], environ={"VLM_IMAGE_GPU_DECODE_MIN_PIXELS": "4000000"})
    assert config.image_gpu_decode_min_pixels == 4_000_000
    flag = load_config(["--image-gpu-decode-min-pixels", "1000000"], environ={})
    assert flag.image_gpu_decode_min_pixels == 1_000_000
    with pytest.raises(SystemExit) as caught:
        load_config(["--image-gpu-decode-min-pixels", "-1"], environ={})
    assert caught.value.code == 2
    assert "--image-gpu-decode-min-pixels must be >= 0" in capsys.readouterr().err


def test_gpu_decoder_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert ServerConfig().image_gpu_decoder == "auto"
    assert load_config(["--image-gpu-decoder", "nvimgcodec"]).image_gpu_decoder == "nvimgcodec"
    env = {"VLM_IMAGE_GPU_DECODER": "torchvision"}
    assert load_config([], environ=env).image_gpu_decoder == "torchvision"
    with pytest.raises(SystemExit) as caught:
        load_config(["--image-gpu-decoder", "nvjpeg"], environ={})
    assert caught.value.code == 2
    assert "--image-gpu-decoder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="image_gpu_decoder must be one of auto, nvimgcodec"):
        ServerConfig(image_gpu_decoder="nvjpeg")

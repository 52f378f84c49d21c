"""The option table: one name from flag to component, grouped --help, generated docs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vlm_server.engine.config import COMPILE_THREADS_AUTO, PREFILL_SMS_AUTO, RESERVED_ROWS_AUTO
from vlm_server.options.__main__ import main as options_main
from vlm_server.options.command_line import RENAMED, as_given, build_parser, load_config
from vlm_server.options.markdown import COMMAND, render
from vlm_server.options.spec import Group, format_size, parse_size
from vlm_server.options.table import OPTIONS, ServerConfig

ROOT = Path(__file__).resolve().parents[1]


def test_docs_configuration_is_generated_from_the_table() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert text == render(), f"docs/configuration.md is stale: run {COMMAND}"
    assert COMMAND in text.splitlines()[2]  # the command is at the top of the file


def test_the_markdown_command_prints_the_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert options_main(["--markdown"]) == 0
    assert capsys.readouterr().out == render()


def test_help_shows_every_flag_in_its_group() -> None:
    text = build_parser().format_help()
    for group in Group:
        assert f"\n{group.title}:\n" in text, group
        assert any(opt.group is group for opt in OPTIONS), group
    starts = [text.index(f"\n{opt.group.title}:\n") for opt in OPTIONS]
    for opt, start in zip(OPTIONS, starts, strict=True):
        assert text.index(f"  {opt.flag} ", start) > start, opt.name
    assert "40% of free GPU memory" in " ".join(text.split())  # not %-formatted twice


def test_advanced_knobs_say_what_their_default_bought() -> None:
    advanced = [opt for opt in OPTIONS if opt.group is Group.ADVANCED]
    names = {opt.name for opt in advanced}
    assert {"gil_switch_interval_ms", "malloc_arena_max", "malloc_mmap_threshold"} <= names
    for opt in advanced:
        assert "Measured" in opt.help, opt.name


def test_every_option_reaches_its_component_under_its_own_name() -> None:
    config = ServerConfig()
    names = {opt.name for opt in OPTIONS}
    reached = set()
    for component in (config.engine_config, config.image_limits, config.constraint_limits):
        for f in dataclasses.fields(component):
            if f.name in names:
                reached.add(f.name)
                mine, theirs = getattr(config, f.name), getattr(component, f.name)
                if f.name == "prefill_sms":  # the text "auto" or a count, as an int there
                    mine = PREFILL_SMS_AUTO if mine == "auto" else int(mine)
                if f.name == "background_reserved_rows":  # the same
                    mine = RESERVED_ROWS_AUTO if mine == "auto" else int(mine)
                if f.name == "compile_threads":  # the same
                    mine = COMPILE_THREADS_AUTO if mine == "auto" else int(mine)
                if f.name in ("experts_fp8_activations", "vision_fp8"):  # auto: None there
                    mine = None if mine == "auto" else mine == "on"
                assert theirs == mine or (mine == 0 and theirs is None), f.name
    assert {"max_queue", "kv_budget_bytes", "crop_graph_sizes", "max_image_bytes"} <= reached
    assert {"max_constraint_states", "constraint_compile_seconds"} <= reached


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_old_names_are_refused_naming_the_new_one(
    old: str, new: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flag, new_flag = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
    with pytest.raises(SystemExit):
        load_config([flag, "4"], environ={})
    assert f"{flag} is now {new_flag}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config([], environ={"VLM_" + old.upper(): "4"})
    assert f"VLM_{old.upper()} is now VLM_{new.upper()}" in capsys.readouterr().err


def test_errors_name_what_the_user_set(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_config([], environ={"VLM_MAX_QUEUE": "0"})
    assert "VLM_MAX_QUEUE must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config(["--pipeline-depth", "3"], environ={})
    assert "--pipeline-depth must be 1 (blocking) or 2" in capsys.readouterr().err
    message = "http_port must be in -1..65535 (0 = off, -1 = any free port)"
    assert as_given(message, {}) == "--http-port must be in -1..65535 (0 = off, -1 = any free port)"
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        ServerConfig(max_queue=0)


@pytest.mark.parametrize("value", [1, 1000, 1 << 10, 3 << 20, 1 << 30, 0])
def test_sizes_are_shown_as_they_parse(value: int) -> None:
    assert parse_size(format_size(value)) == value


@pytest.mark.parametrize(
    ("given", "kept", "engine"),
    [
        ([], "auto", None),
        (["--experts-fp8-activations", "true"], "on", True),
        (["--experts-fp8-activations", "on"], "on", True),
        (["--experts-fp8-activations", "false"], "off", False),
        (["--experts-fp8-activations", "AUTO"], "auto", None),
    ],
)
def test_an_auto_switch_takes_auto_and_a_booleans_words(
    given: list[str], kept: str, engine: bool | None
) -> None:
    config = load_config(given, environ={})
    assert config.experts_fp8_activations == kept
    assert config.engine_config.experts_fp8_activations is engine


def test_an_auto_switch_refuses_other_words_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        load_config(["--experts-fp8-activations", "maybe"], environ={})
    assert "--experts-fp8-activations" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config([], environ={"VLM_EXPERTS_FP8_ACTIVATIONS": "2"})
    assert "VLM_EXPERTS_FP8_ACTIVATIONS" in capsys.readouterr().err

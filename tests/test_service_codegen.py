"""The contract: generated code is fresh, and the proto states its units."""

from __future__ import annotations

from pathlib import Path

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.rpc import codegen


def test_checked_in_generated_code_is_fresh(tmp_path: Path) -> None:
    codegen.generate(tmp_path)
    fresh = codegen.generated_files(tmp_path)
    checked_in = codegen.generated_files(codegen.API_DIR)
    assert sorted(fresh) == sorted(checked_in), "run: python -m vlm_server.rpc.codegen"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale generated files {stale}: run python -m vlm_server.rpc.codegen"


def test_codegen_check_mode_passes_on_the_checked_in_tree() -> None:
    assert codegen.main(["--check"]) == 0


def test_generated_stub_requires_the_pinned_grpcio() -> None:
    grpc_file = codegen.API_DIR / "v1" / "vision_language_pb2_grpc.py"
    assert f"GRPC_GENERATED_VERSION = '{codegen.GRPCIO_TOOLS_VERSION}'" in grpc_file.read_text()


def test_service_has_one_rpc_per_task_with_streaming_text() -> None:
    service = pb.DESCRIPTOR.services_by_name["VisionLanguage"]
    assert service.full_name == "vlm.v1.VisionLanguage"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {
        "Caption",
        "Query",
        "Point",
        "Detect",
        "Segment",
        "EncodeImage",
        "GetModelInfo",
    }
    streaming = {name for name, m in methods.items() if m.server_streaming}
    assert streaming == {"Caption", "Query"}
    assert not any(m.client_streaming for m in methods.values())


def test_coordinates_are_named_as_normalized() -> None:
    point = pb.NormalizedPoint.DESCRIPTOR
    box = pb.NormalizedBox.DESCRIPTOR
    assert [f.name for f in point.fields] == ["x_norm", "y_norm"]
    assert [f.name for f in box.fields] == ["x_min_norm", "y_min_norm", "x_max_norm", "y_max_norm"]
    source = (codegen.PROTO_ROOT / codegen.PROTO_FILES[0]).read_text()
    assert "normalized to the image" in source and "origin at the top-left" in source
    # The contract says what the server does: boxes as the reference returns them, past the
    # picture where an object is cut by its border, unless the request sets `clip`.
    assert "extends past the picture" in source and "optional bool clip" in source


def test_every_task_request_takes_bytes_or_an_image_id() -> None:
    for message in (
        pb.CaptionRequest,
        pb.QueryRequest,
        pb.PointRequest,
        pb.DetectRequest,
        pb.SegmentRequest,
    ):
        oneof = message.DESCRIPTOR.oneofs_by_name["image"]
        assert [f.name for f in oneof.fields] == ["image_bytes", "image_id"]
        assert "settings" in message.DESCRIPTOR.fields_by_name

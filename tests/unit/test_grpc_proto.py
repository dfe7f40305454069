"""The gRPC service's wire code: the committed generated files are what grpc_tools.protoc makes of the
.proto files (``UPDATE_GRPC_CODE=1`` rewrites them), and every message lmiserve serves has the field
numbers, types and nesting of Triton's grpc_service.proto (read from tritonclient's own descriptors), so
tritonclient.grpc and KServe's client read and write them unchanged; the service has Triton's name and
the signatures of Triton's methods."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc
from tritonclient.grpc import service_pb2 as triton

from lmiserve.protocols.tensor.kserve.grpc import oip_pb2

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "lmiserve/protocols/tensor/kserve/grpc"
RUNS = {  # proto -> the protoc outputs generated from it
    "oip.proto": ("--python_out", "--pyi_out"),
    "grpc_service.proto": ("--grpc_python_out",),
}
GENERATED = ("oip_pb2.py", "oip_pb2.pyi", "grpc_service_pb2_grpc.py")


def _protoc(*args: str) -> None:
    assert protoc.main(["protoc", f"-I{REPO}", *args]) == 0, args


def test_the_committed_generated_code_is_current(tmp_path: Path):
    for proto, outputs in RUNS.items():
        _protoc(*(f"{flag}={tmp_path}" for flag in outputs), str(REPO / PACKAGE / proto))
    stale = [
        name for name in GENERATED if (tmp_path / PACKAGE / name).read_bytes() != (REPO / PACKAGE / name).read_bytes()
    ]
    if stale and os.environ.get("UPDATE_GRPC_CODE") == "1":
        for name in stale:
            shutil.copyfile(tmp_path / PACKAGE / name, REPO / PACKAGE / name)
        pytest.skip(f"rewrote {', '.join(stale)}")
    assert stale == [], "regenerate: UPDATE_GRPC_CODE=1 .venv/bin/python -m pytest tests/unit/test_grpc_proto.py -n 0"
    assert not (REPO / PACKAGE / "grpc_service_pb2.py").exists()  # it would claim Triton's service name


def _shape(message) -> dict:
    """A message's wire shape: its fields by number (name, type, repetition, message type's short name,
    oneof) and its nested messages', map entries included."""
    return {
        "fields": {
            f.number: (
                f.name,
                f.type,
                f.is_repeated,
                f.message_type.name if f.message_type else None,
                f.containing_oneof.name if f.containing_oneof else None,
            )
            for f in message.fields
        },
        "nested": {n.name: _shape(n) for n in message.nested_types},
    }


@pytest.mark.parametrize("name", sorted(oip_pb2.DESCRIPTOR.message_types_by_name))
def test_every_message_has_tritons_wire_shape(name):
    ours = oip_pb2.DESCRIPTOR.message_types_by_name[name]
    assert _shape(ours) == _shape(triton.DESCRIPTOR.message_types_by_name[name])


def test_the_service_is_tritons_with_its_signatures(tmp_path: Path):
    _protoc(f"--descriptor_set_out={tmp_path / 'set.pb'}", str(REPO / PACKAGE / "grpc_service.proto"))
    files = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes()).file
    [service] = [s for f in files for s in f.service]
    [package] = [f.package for f in files if f.service]
    assert f"{package}.{service.name}" == "inference.GRPCInferenceService"
    theirs = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    for method in service.method:
        triton_method = theirs[method.name]
        assert method.input_type.rsplit(".", 1)[1] == triton_method.input_type.name, method.name
        assert method.output_type.rsplit(".", 1)[1] == triton_method.output_type.name, method.name
        streaming = (method.client_streaming, method.server_streaming)
        assert streaming == (triton_method.client_streaming, triton_method.server_streaming), method.name
    assert [m.name for m in service.method] == [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "RepositoryIndex",
    ]

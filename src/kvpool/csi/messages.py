"""The protobuf messages the plugin speaks, built at import from a compact table.

Two APIs: CSI v1 (package ``csi.v1``, the spec's ``csi.proto``) and the kubelet's plugin
registration (package ``pluginregistration``). Only the fields the plugin and its tests use
are declared, with the numbers and types of the official protos; a field not declared is
skipped on the wire as an unknown field. No generated code: each table becomes a
``FileDescriptorProto`` in a descriptor pool of this module's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

_Field = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _Field.TYPE_STRING,
    "bool": _Field.TYPE_BOOL,
    "int64": _Field.TYPE_INT64,
}
_MAP = "map"
"""A ``map<string, string>`` field."""


@dataclass(frozen=True)
class Message:
    """A message: ``fields`` are (name, number, kind), kind a scalar of :data:`_SCALARS`,
    ``map``, ``repeated <kind>``, or a message or enum of the file (``Outer.Inner``) or
    ``.google.protobuf.<Name>``; ``enums`` list their values' names from 0 up."""

    name: str
    fields: tuple[tuple[str, int, str], ...] = ()
    nested: tuple[Message, ...] = ()
    enums: dict[str, tuple[str, ...]] = field(default_factory=dict)
    oneofs: dict[str, tuple[str, ...]] = field(default_factory=dict)


CSI_PACKAGE = "csi.v1"
CSI = (
    Message("GetPluginInfoRequest"),
    Message(
        "GetPluginInfoResponse",
        (("name", 1, "string"), ("vendor_version", 2, "string"), ("manifest", 3, _MAP)),
    ),
    Message("GetPluginCapabilitiesRequest"),
    Message("GetPluginCapabilitiesResponse", (("capabilities", 1, "repeated PluginCapability"),)),
    Message(
        "PluginCapability",
        (("service", 1, "PluginCapability.Service"),),
        nested=(
            Message(
                "Service",
                (("type", 1, "PluginCapability.Service.Type"),),
                enums={"Type": ("UNKNOWN", "CONTROLLER_SERVICE")},
            ),
        ),
        oneofs={"type": ("service",)},
    ),
    Message("ProbeRequest"),
    Message("ProbeResponse", (("ready", 1, ".google.protobuf.BoolValue"),)),
    Message(
        "VolumeCapability",
        (
            ("block", 1, "VolumeCapability.BlockVolume"),
            ("mount", 2, "VolumeCapability.MountVolume"),
            ("access_mode", 3, "VolumeCapability.AccessMode"),
        ),
        nested=(
            Message("BlockVolume"),
            Message(
                "MountVolume",
                (
                    ("fs_type", 1, "string"),
                    ("mount_flags", 2, "repeated string"),
                    ("volume_mount_group", 3, "string"),
                ),
            ),
            Message(
                "AccessMode",
                (("mode", 1, "VolumeCapability.AccessMode.Mode"),),
                enums={
                    "Mode": (
                        "UNKNOWN",
                        "SINGLE_NODE_WRITER",
                        "SINGLE_NODE_READER_ONLY",
                        "MULTI_NODE_READER_ONLY",
                        "MULTI_NODE_SINGLE_WRITER",
                        "MULTI_NODE_MULTI_WRITER",
                        "SINGLE_NODE_SINGLE_WRITER",
                        "SINGLE_NODE_MULTI_WRITER",
                    )
                },
            ),
        ),
        oneofs={"access_type": ("block", "mount")},
    ),
    Message(
        "NodePublishVolumeRequest",
        (
            ("volume_id", 1, "string"),
            ("publish_context", 2, _MAP),
            ("staging_target_path", 3, "string"),
            ("target_path", 4, "string"),
            ("volume_capability", 5, "VolumeCapability"),
            ("readonly", 6, "bool"),
            ("secrets", 7, _MAP),
            ("volume_context", 8, _MAP),
        ),
    ),
    Message("NodePublishVolumeResponse"),
    Message(
        "NodeUnpublishVolumeRequest", (("volume_id", 1, "string"), ("target_path", 2, "string"))
    ),
    Message("NodeUnpublishVolumeResponse"),
    Message("NodeGetCapabilitiesRequest"),
    Message(
        "NodeGetCapabilitiesResponse", (("capabilities", 1, "repeated NodeServiceCapability"),)
    ),
    Message(
        "NodeServiceCapability",
        (("rpc", 1, "NodeServiceCapability.RPC"),),
        nested=(
            Message(
                "RPC",
                (("type", 1, "NodeServiceCapability.RPC.Type"),),
                enums={"Type": ("UNKNOWN", "STAGE_UNSTAGE_VOLUME")},
            ),
        ),
        oneofs={"type": ("rpc",)},
    ),
    Message("NodeGetInfoRequest"),
    Message(
        "NodeGetInfoResponse", (("node_id", 1, "string"), ("max_volumes_per_node", 2, "int64"))
    ),
)

REGISTRATION_PACKAGE = "pluginregistration"
REGISTRATION = (
    Message("InfoRequest"),
    Message(
        "PluginInfo",
        (
            ("type", 1, "string"),
            ("name", 2, "string"),
            ("endpoint", 3, "string"),
            ("supported_versions", 4, "repeated string"),
        ),
    ),
    Message("RegistrationStatus", (("plugin_registered", 1, "bool"), ("error", 2, "string"))),
    Message("RegistrationStatusResponse"),
)


def _enum_names(messages: tuple[Message, ...], prefix: str = "") -> set[str]:
    names: set[str] = set()
    for message in messages:
        path = f"{prefix}{message.name}"
        names.update(f"{path}.{enum}" for enum in message.enums)
        names.update(_enum_names(message.nested, f"{path}."))
    return names


def _describe(
    message: Message, package: str, enums: set[str], prefix: str = ""
) -> descriptor_pb2.DescriptorProto:
    proto = descriptor_pb2.DescriptorProto(name=message.name)
    path = f"{prefix}{message.name}"
    oneof_of = {}
    for index, (oneof, members) in enumerate(message.oneofs.items()):
        proto.oneof_decl.add(name=oneof)
        oneof_of.update(dict.fromkeys(members, index))
    for name, number, declared in message.fields:
        kind = declared.removeprefix("repeated ")
        field_proto = proto.field.add(name=name, number=number, label=_Field.LABEL_OPTIONAL)
        if name in oneof_of:
            field_proto.oneof_index = oneof_of[name]
        if kind != declared:
            field_proto.label = _Field.LABEL_REPEATED
        if kind == _MAP:
            entry = f"{''.join(part.capitalize() for part in name.split('_'))}Entry"
            map_entry = proto.nested_type.add(name=entry)
            map_entry.options.map_entry = True
            for key, key_number in (("key", 1), ("value", 2)):
                map_entry.field.add(
                    name=key,
                    number=key_number,
                    label=_Field.LABEL_OPTIONAL,
                    type=_Field.TYPE_STRING,
                )
            field_proto.label = _Field.LABEL_REPEATED
            field_proto.type = _Field.TYPE_MESSAGE
            field_proto.type_name = f".{package}.{path}.{entry}"
        elif kind in _SCALARS:
            field_proto.type = _SCALARS[kind]
        else:
            field_proto.type = _Field.TYPE_ENUM if kind in enums else _Field.TYPE_MESSAGE
            field_proto.type_name = kind if kind.startswith(".") else f".{package}.{kind}"
    for enum, values in message.enums.items():
        enum_proto = proto.enum_type.add(name=enum)
        for number, value in enumerate(values):
            enum_proto.value.add(name=value, number=number)
    for nested in message.nested:
        proto.nested_type.append(_describe(nested, package, enums, f"{path}."))
    return proto


def build(package: str, messages: tuple[Message, ...], pool: Any) -> dict[str, Any]:
    """Add ``messages`` to ``pool`` as one file; their classes by (nested) name."""
    enums = _enum_names(messages)
    file_proto = descriptor_pb2.FileDescriptorProto(
        name=f"kvpool/{package.replace('.', '/')}.proto", package=package, syntax="proto3"
    )
    file_proto.dependency.append(wrappers_pb2.DESCRIPTOR.name)
    for message in messages:
        file_proto.message_type.append(_describe(message, package, enums))
    file_descriptor = pool.Add(file_proto)
    classes: dict[str, Any] = {}

    def collect(descriptors: Any, prefix: str) -> None:
        for name, descriptor in descriptors.items():
            classes[f"{prefix}{name}"] = message_factory.GetMessageClass(descriptor)
            collect(descriptor.nested_types_by_name, f"{prefix}{name}.")

    collect(file_descriptor.message_types_by_name, "")
    return classes


_pool = descriptor_pool.DescriptorPool()
_pool.Add(descriptor_pb2.FileDescriptorProto.FromString(wrappers_pb2.DESCRIPTOR.serialized_pb))
_csi = build(CSI_PACKAGE, CSI, _pool)
_registration = build(REGISTRATION_PACKAGE, REGISTRATION, _pool)

GetPluginInfoRequest = _csi["GetPluginInfoRequest"]
GetPluginInfoResponse = _csi["GetPluginInfoResponse"]
GetPluginCapabilitiesRequest = _csi["GetPluginCapabilitiesRequest"]
GetPluginCapabilitiesResponse = _csi["GetPluginCapabilitiesResponse"]
ProbeRequest = _csi["ProbeRequest"]
ProbeResponse = _csi["ProbeResponse"]
VolumeCapability = _csi["VolumeCapability"]
NodePublishVolumeRequest = _csi["NodePublishVolumeRequest"]
NodePublishVolumeResponse = _csi["NodePublishVolumeResponse"]
NodeUnpublishVolumeRequest = _csi["NodeUnpublishVolumeRequest"]
NodeUnpublishVolumeResponse = _csi["NodeUnpublishVolumeResponse"]
NodeGetCapabilitiesRequest = _csi["NodeGetCapabilitiesRequest"]
NodeGetCapabilitiesResponse = _csi["NodeGetCapabilitiesResponse"]
NodeGetInfoRequest = _csi["NodeGetInfoRequest"]
NodeGetInfoResponse = _csi["NodeGetInfoResponse"]

InfoRequest = _registration["InfoRequest"]
PluginInfo = _registration["PluginInfo"]
RegistrationStatus = _registration["RegistrationStatus"]
RegistrationStatusResponse = _registration["RegistrationStatusResponse"]

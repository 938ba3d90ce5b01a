"""A fake kubelet ``Registration`` service on a unix socket (the kubelet boundary in tests):
it records every RegisterRequest; the test then dials the plugin's socket as kubelet would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from services.nodeagent.deviceplugin.v1beta1 import api_pb2 as pb
from services.nodeagent.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc


class FakeKubelet(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.requests: list[pb.RegisterRequest] = []
        self.server: grpc.aio.Server | None = None

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        self.requests.append(request)
        return pb.Empty()

    async def start(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(grace=None)

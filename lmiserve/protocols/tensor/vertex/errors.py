"""Vertex AI errors: any non-2xx status with a JSON body; lmiserve answers ``{"error": msg}`` (the legacy
AI Platform shape, as TF Serving) with the tensor protocols' statuses."""

from __future__ import annotations

from lmiserve.protocols.tensor.errors import JsonErrorRenderer


class VertexErrorRenderer(JsonErrorRenderer):
    protocol = "vertex"
    pass


RENDERER = VertexErrorRenderer()

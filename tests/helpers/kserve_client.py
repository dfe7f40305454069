"""KServe's `InferenceRESTClient` (protocol v2), unmodified, run with .venv-kserve's python (kserve brings
its own fastapi, grpcio, kubernetes and pandas, which lmiserve's venv does not need).

    python kserve_client.py http://127.0.0.1:PORT MODEL   -> JSON of what the client says

Printed: {"live": is_server_live(), "ready": is_server_ready(), "model_ready": is_model_ready(MODEL),
"unknown_model_ready": is_model_ready of a model that is not served}.
"""

from __future__ import annotations

import asyncio
import json
import sys

from kserve import InferenceRESTClient, RESTConfig


async def main(url: str, model: str) -> dict:
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
    try:
        return {
            "live": await client.is_server_live(url),
            "ready": await client.is_server_ready(url),
            "model_ready": await client.is_model_ready(url, model),
            "unknown_model_ready": await client.is_model_ready(url, "not-served"),
        }
    finally:
        await client.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))

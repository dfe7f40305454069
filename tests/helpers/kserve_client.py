"""KServe's Python SDK, unmodified, run with .venv-kserve's python (kserve brings its own fastapi, grpcio,
kubernetes and pandas, which lmiserve's venv does not need).

    python kserve_client.py http://127.0.0.1:PORT MODEL           -> JSON of what InferenceRESTClient says
    python kserve_client.py grpc 127.0.0.1:PORT KEY LLM TENSOR    -> JSON of what InferenceGRPCClient says

REST (protocol v2): {"live": is_server_live(), "ready": is_server_ready(), "model_ready":
is_model_ready(MODEL), "unknown_model_ready": is_model_ready of a model that is not served}.

gRPC (the API key KEY in the `authorization` metadata): {"live", "ready", "model_ready" (TENSOR),
"unknown_model_ready" (the status code's name), "typed" and "raw" (infer on TENSOR with x = AFFINE_X as
typed contents, then as raw_input_contents: {"id", "outputs": {name: [datatype, shape, values]}}), "llm"
(infer on LLM: text_input "Hello there" with max_tokens 5 as a parameter: the text), "no_key" (the status
code's name of an infer without the key)}.
"""

from __future__ import annotations

import asyncio
import json
import sys

AFFINE_X = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
PROMPT = "Hello there"


async def rest(url: str, model: str) -> dict:
    from kserve import InferenceRESTClient, RESTConfig

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


def _outputs(response) -> dict:
    return {o.name: [o.datatype, list(o.shape), o.as_numpy().tolist()] for o in response.outputs}


async def grpc_checks(address: str, key: str, llm: str, tensor: str) -> dict:
    import grpc
    import numpy as np
    from kserve import InferenceGRPCClient, InferInput, InferRequest

    headers = [("authorization", f"Bearer {key}")]
    x = np.array(AFFINE_X, dtype=np.float32)
    async with InferenceGRPCClient(address, timeout=60, retries=0) as client:
        out: dict = {
            "live": await client.is_server_live(),
            "ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready(tensor),
        }
        try:
            await client.is_model_ready("not-served")
            out["unknown_model_ready"] = "OK"
        except grpc.RpcError as exc:
            out["unknown_model_ready"] = exc.code().name
        typed = InferInput("x", list(x.shape), "FP32", data=x.reshape(-1).tolist())
        response = await client.infer(InferRequest(tensor, [typed], request_id="typed-1"), headers=headers)
        out["typed"] = {"id": response.id, "outputs": _outputs(response)}
        raw = InferInput("x", list(x.shape), "FP32")
        raw.set_data_from_numpy(x, binary_data=True)
        response = await client.infer(InferRequest(tensor, [raw], request_id="raw-1"), headers=headers)
        out["raw"] = {"id": response.id, "outputs": _outputs(response)}
        prompt = InferInput("text_input", [1], "BYTES", data=[PROMPT])
        request = InferRequest(llm, [prompt], parameters={"max_tokens": 5})
        response = await client.infer(request, headers=headers)
        text = response.outputs[0].as_numpy().reshape(-1)[0]
        out["llm"] = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        try:
            await client.infer(InferRequest(tensor, [typed]))
            out["no_key"] = "OK"
        except grpc.RpcError as exc:
            out["no_key"] = exc.code().name
        return out


if __name__ == "__main__":
    if sys.argv[1] == "grpc":
        print(json.dumps(asyncio.run(grpc_checks(*sys.argv[2:6]))))
    else:
        print(json.dumps(asyncio.run(rest(sys.argv[1], sys.argv[2]))))

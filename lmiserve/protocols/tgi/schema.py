"""TGI's generate request: POST /generate, /generate_stream, / (with `stream`) and /tokenize.

Lenient where harmless (unknown keys ignored), strict on types: a body that does not fit is rejected
as TGI does, with 422 ``Failed to deserialize the JSON body ...``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from lmiserve.protocols.textgen.parameters import TextGenParameters

TgiParameters = TextGenParameters  # the ``parameters`` object


class GenerateRequest(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={"examples": [{"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": 8}}]},
    )

    inputs: StrictStr
    parameters: TextGenParameters | None = None  # absent: do_sample defaults to true (a TGI quirk)
    stream: StrictBool = False

    def effective_parameters(self) -> TextGenParameters:
        return self.parameters if self.parameters is not None else TextGenParameters(do_sample=True)

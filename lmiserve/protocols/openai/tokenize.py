"""vLLM's tokenizer routes: `POST /tokenize` in vLLM's shape and `POST /detokenize`.

`/tokenize` is TGI's route too: the body tells which (TGI's routes hand a body with `prompt` or
`messages` and no `inputs` to `invoke_tokenize`; app.py wires it). vLLM's requests:

- `{"model"?, "prompt": str, "add_special_tokens"?: true, "return_token_strs"?: false}`;
- `{"model"?, "messages": [...], "add_generation_prompt"?: true, "continue_final_message"?: false,
  "add_special_tokens"?: false, "chat_template_kwargs"?: {...}, "tools"?: [...],
  "return_token_strs"?: false}`: the model's chat template applied, then tokenized;

answered `{"count", "max_model_len", "tokens": [...], "token_strs": [...] | null}`.
`/detokenize` takes `{"model"?, "tokens": [int, ...]}` and answers `{"prompt": str}` (special tokens
kept, as vLLM decodes).

`model` absent or null: the default text model; a name that is not served: 404. Errors are the OpenAI
routes' own error object (lmiserve/protocols/openai/errors.py): 400 for a bad body (both or neither of
`prompt` and `messages`, an unknown field, a request `chat_template`, a token id out of the vocabulary,
both `add_generation_prompt` and `continue_final_message`), 404 for an unknown model. Its own
`chat_template` in a request is refused (the model's applies), and so is any field not listed.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.errors import (
    InvalidRequest,
    ModelNotFound,
    SchemaViolation,
    TemplateError,
)
from lmiserve.core.media import Image, ImageSource
from lmiserve.core.tokenizer import tokenizing
from lmiserve.protocols.openai import errors
from lmiserve.protocols.textgen import images as vision
from lmiserve.protocols.textgen.body import json_payload, parse_strict
from lmiserve.protocols.textgen.served import Served, served
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import apidoc
from lmiserve.server.errors import protocol_routes, rendered_by
from lmiserve.server.lookup import adapter_owner, model_service
from lmiserve.server.responses import raw_response

TAG = "vLLM"


# --- the bodies ---------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (e.g. BOS)")
    return_token_strs: bool = Field(False, description="Also answer the tokens' strings")


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False, description="Leave the last message open (not with add_generation_prompt)"
    )
    add_special_tokens: bool = Field(False, description="Special tokens on top of the chat template's own")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="More variables for the chat template")
    tools: list[dict[str, Any]] | None = Field(None, description="Tools given to the chat template")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


# --- errors: the OpenAI routes' own error object (lmiserve/protocols/openai/errors.py) ----------------

RENDERER = errors.RENDERER


# --- the handlers ------------------------------------------------------------------------------------


def _parse(model: type[_Strict], payload: Any) -> Any:
    if isinstance(payload, dict) and "chat_template" in payload:
        raise InvalidRequest("`chat_template` is not accepted: the model's own chat template applies.")
    return parse_strict(model, payload)


def _model(request: Request, name: str | None) -> Served:
    """The named text model (the default one without a name), ready."""
    if name is None:
        return served(request)
    try:
        service = model_service(request, name)
    except ModelNotFound:
        owner = adapter_owner(request, name)  # a LoRA adapter tokenizes as its model does
        if owner is None:
            raise ModelNotFound(f"The model `{name}` does not exist.") from None
        service = owner
    if not service.is_llm:
        raise InvalidRequest(f"The model `{name}` is a {service.kind} model: it does not generate text.")
    return Served.of(service)


def _text_of(content: Any) -> Any:
    """A message's content: a string, or the text of OpenAI's content parts (an ``image_url`` part: an
    image's mark, for a vision model's template)."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                texts.append(vision.MARK)
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise SchemaViolation(
                    "messages: content parts must be {'type': 'text', 'text': str} or {'type': 'image_url', ...}"
                )
            texts.append(part["text"])
        return "".join(texts)
    return content


def image_sources(payload: Any) -> list[ImageSource]:
    """The ``image_url`` parts' sources of a chat body's messages, in order (none for other bodies)."""
    messages = payload.get("messages") if isinstance(payload, dict) else None
    sources: list[ImageSource] = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                value = part.get("image_url")
                url = value.get("url") if isinstance(value, dict) else value
                sources.append(vision.url_source(url, f"messages[{i}].content[{j}].image_url"))
    return sources


def _chat_text(model: Served, req: TokenizeChatRequest) -> str:
    if req.add_generation_prompt and req.continue_final_message:
        raise InvalidRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    messages = []
    for i, message in enumerate(req.messages):
        if not isinstance(message.get("role"), str):
            raise SchemaViolation(f"messages.{i}.role: a string is required")
        messages.append({**message, "content": _text_of(message.get("content"))})
    tokenizer: Any = model.tokenizer
    processor = model.processor
    if processor is not None and getattr(processor, "chat_template", None):  # a vision model's template
        tokenizer, messages = processor, vision.template_messages(messages)
    elif vision.has_marks(messages):
        raise vision.no_vision(model.service.name)
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("The model has no chat template.")
    extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
    taken = sorted(set(extra) & set(inspect.signature(model.tokenizer.apply_chat_template).parameters))
    if taken:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)}: give them as fields, if at all.")
    if req.tools is not None:
        extra["tools"] = req.tools
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **extra,
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors of a model's own template, bad kwargs
        raise TemplateError(f"The chat template failed: {exc}") from None
    return str(text)


def tokenize_payload(request: Request, payload: Any, images: tuple[Image, ...] = ()) -> bytes:
    """vLLM's tokenize answer for a decoded body; `images`: its messages' images, loaded (their tokens
    counted, as the processor expands them)."""
    if isinstance(payload, dict) and "prompt" in payload and "messages" in payload:
        raise SchemaViolation("Give either `prompt` or `messages`, not both.")
    if not isinstance(payload, dict) or ("prompt" not in payload and "messages" not in payload):
        raise SchemaViolation("Give `prompt` (a string) or `messages` (a chat).")
    req: TokenizeCompletionRequest | TokenizeChatRequest
    if "prompt" in payload:
        completion: TokenizeCompletionRequest = _parse(TokenizeCompletionRequest, payload)
        model = _model(request, completion.model)
        req, text = completion, completion.prompt
    else:
        chat: TokenizeChatRequest = _parse(TokenizeChatRequest, payload)
        model = _model(request, chat.model)
        req, text = chat, _chat_text(model, chat)
    if images:
        ids = model.encode_with_images(text, images, special=req.add_special_tokens)
    else:
        ids = [int(i) for i in model.tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]]
    strs = [str(s) for s in model.tokenizer.convert_ids_to_tokens(ids)] if req.return_token_strs else None
    body = {"count": len(ids), "max_model_len": model.limits.max_total_tokens, "tokens": ids, "token_strs": strs}
    return dumps(body)


async def invoke_tokenize(request: Request, payload: Any) -> Response:
    """`/tokenize` with a body in vLLM's shape (TGI's route hands it over), errors in vLLM's shape."""

    async def endpoint(request: Request) -> Response:
        sources = image_sources(payload)
        images: tuple[Image, ...] = ()
        if sources:  # the model the body names loads them (400 naming it when it takes no images)
            name = payload.get("model")
            images = await _model(request, name if isinstance(name, str) else None).load_images(sources)
        return raw_response(await tokenizing(tokenize_payload, request, payload, images))

    return await rendered_by(RENDERER, endpoint)(request)


async def detokenize(request: Request) -> Response:
    req = _parse(DetokenizeRequest, await json_payload(request))
    model = _model(request, req.model)
    vocabulary = len(model.tokenizer)
    outside = [t for t in req.tokens if not 0 <= t < vocabulary]
    if outside:
        raise InvalidRequest(f"Token ids out of the vocabulary (0 to {vocabulary - 1}): {outside[:8]}")
    text = await tokenizing(model.tokenizer.decode, req.tokens, skip_special_tokens=False)
    return raw_response(dumps({"prompt": text}))


# --- routes and the API document ---------------------------------------------------------------------

TOKENIZE_BODIES: tuple[type[BaseModel], ...] = (TokenizeCompletionRequest, TokenizeChatRequest)
DETOKENIZE = apidoc.Operation(
    "Decode token ids (vLLM's /detokenize)",
    TAG,
    apidoc.ok("The text", apidoc.json(DetokenizeResponse)),
    body=apidoc.json(DetokenizeRequest),
)


def routes() -> list[BaseRoute]:
    """`POST /detokenize` (the API key guarded); `/tokenize` is TGI's route, which hands vLLM's bodies
    to `invoke_tokenize`."""
    return protocol_routes(RENDERER, [apidoc.document(Route("/detokenize", detokenize, methods=["POST"]), DETOKENIZE)])

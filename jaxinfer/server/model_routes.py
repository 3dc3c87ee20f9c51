"""The model and its tokenizer: `GET /v1/models`, `GET /v1/models/{id}`, `POST /tokenize`, `POST /detokenize`."""

from __future__ import annotations

from flask import Blueprint, request

from jaxinfer.server import protocol
from jaxinfer.server.app_state import app_state, ready_client
from jaxinfer.server.errors import APIError, bad_request

model_routes = Blueprint("models", __name__)


def _model_card() -> dict:
    state = app_state()
    card = {"id": state.served_model_name, "object": "model", "created": state.started, "owned_by": "jaxinfer"}
    max_model_len = state.client.max_model_len
    if max_model_len is not None:  # unknown while the model loads
        card["max_model_len"] = max_model_len
        # Clients that are not the in-process engine loop (a Ray replica's) may not know it.
        card["quantization"] = getattr(state.client, "quantization", None)
        if getattr(state.client, "activation_scales", None) is not None:  # FP8 weights only
            card["activation_scales"] = state.client.activation_scales
    # How the engine stores its KV cache (EngineLoop's; a client that does not say leaves it out).
    card.update(getattr(state.client, "kv_cache_metadata", None) or {})
    return card


@model_routes.get("/v1/models")
def models() -> dict:
    return {"object": "list", "data": [_model_card()]}


@model_routes.get("/v1/models/<path:model_id>")
def model(model_id: str) -> dict:
    served = app_state().served_model_name
    if model_id != served:
        raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{served}'.",
                       param="model", code="model_not_found")
    return _model_card()


@model_routes.post("/tokenize")
def tokenize() -> dict:
    client = ready_client()
    body = protocol.parse_json_body(request.get_data(cache=False))
    protocol.check_model(body, app_state().served_model_name)
    if "messages" in body:
        messages = protocol.parse_messages(body)
        add_generation_prompt = protocol.field(body, "add_generation_prompt", "bool", True)
        tokens = protocol.encode_chat(client.tokenizer, messages, add_generation_prompt)
    else:
        prompt = protocol.field(body, "prompt", "str", None)
        if prompt is None:
            raise bad_request("'prompt' (a string) or 'messages' is required", param="prompt")
        add_special = protocol.field(body, "add_special_tokens", "bool", True)
        tokens = client.tokenizer.encode(prompt, add_special_tokens=add_special)
    return {"count": len(tokens), "max_model_len": client.max_model_len, "tokens": tokens}


@model_routes.post("/detokenize")
def detokenize() -> dict:
    client = ready_client()
    body = protocol.parse_json_body(request.get_data(cache=False))
    protocol.check_model(body, app_state().served_model_name)
    if "tokens" not in body:
        raise bad_request("'tokens' is required", param="tokens")
    tokens = protocol.token_ids(body["tokens"], "tokens", client.tokenizer.vocab_size)
    return {"prompt": client.tokenizer.decode(tokens)}

"""The output constraint of a request: OpenAI's ``response_format``, vLLM's ``structured_outputs``
extra field, or its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields, into one :class:`StructuredOutputsParams`.

A request may use one of them; two (even agreeing ones) are a 400 naming both, rather than a
guess at which one wins. Whether the engine can compile the constraint (a JSON-schema keyword
llguidance does not support, a bad regex) is the engine's to say: its ``RequestError`` reaches the
client as a 400 naming the field.
"""

from __future__ import annotations

import json

from jaxinfer.errors import RequestError
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.server.errors import bad_request

# vLLM's older per-kind fields -> the StructuredOutputsParams field each sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def constraint_fields(body: dict) -> list[str]:
    """The request fields that constrain the output (``response_format`` of type text does not)."""
    names = [name for name in ("structured_outputs", *GUIDED_FIELDS) if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        names.insert(0, "response_format")
    return names


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The request's output constraint, or None; 400 naming the field for anything malformed."""
    names = constraint_fields(body)
    if not names:
        return None
    if len(names) > 1:
        quoted = " and ".join(f"'{n}'" for n in names)
        raise bad_request(f"{quoted} each constrain the output; send only one of them", param=names[1])
    name = names[0]
    if name == "response_format":
        kwargs = _response_format(body[name])
    elif name == "structured_outputs":
        kwargs = _structured_outputs_field(body[name])
    else:
        kwargs = {GUIDED_FIELDS[name]: body[name]}
    if "json" in kwargs:
        kwargs["json"] = _schema(kwargs["json"], name)
    if "choice" in kwargs and not isinstance(kwargs["choice"], list):
        # A string is iterable too: "yes" would become the choices "y", "e", "s".
        field = "structured_outputs.choice" if name == "structured_outputs" else name
        raise bad_request(f"'{field}' must be a list of strings", param=field)
    try:
        return StructuredOutputsParams(**kwargs)
    except RequestError as e:
        param = e.field if name == "structured_outputs" else name
        raise bad_request(str(e) if name == "structured_outputs" else f"'{name}': {e}", param=param) from None


def _response_format(fmt) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"'response_format' must be an object whose 'type' is one of {list(RESPONSE_FORMAT_TYPES)}",
                          param="response_format")
    if fmt["type"] == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object with a 'schema'",
                          param="response_format.json_schema")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise bad_request("'response_format.json_schema.name' must be a string",
                          param="response_format.json_schema.name")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows a name alone: any JSON object then
        return {"json_object": True}
    return {"json": schema}


def _structured_outputs_field(value) -> dict:
    if not isinstance(value, dict):
        raise bad_request("'structured_outputs' must be an object", param="structured_outputs")
    kwargs = {k: value[k] for k in STRUCTURED_OUTPUTS_KINDS if value.get(k) is not None}
    if "json_object" in kwargs:
        if not isinstance(kwargs["json_object"], bool):
            raise bad_request("'structured_outputs.json_object' must be a boolean",
                              param="structured_outputs.json_object")
        if not kwargs["json_object"]:
            del kwargs["json_object"]  # false: no constraint of that kind
    return kwargs


def _schema(schema, name: str) -> dict:
    """A JSON schema sent as an object or as its JSON text, as an object; booleans are schemas too
    but say nothing useful about an output, so only objects are taken."""
    field = "response_format.json_schema.schema" if name == "response_format" else (
        "structured_outputs.json" if name == "structured_outputs" else name)
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"'{field}' is not valid JSON", param=field) from None
    if not isinstance(schema, dict):
        raise bad_request(f"'{field}' must be a JSON schema object", param=field)
    return schema

"""The OpenAPI document of the worker's HTTP API (served at /openapi.json), bounds included.

Written out rather than derived from the routes: the routes read raw bodies so that every malformed one gets
an OpenAI-style error, which leaves nothing for FastAPI to derive a schema from.
"""

from __future__ import annotations

from typing import Any

from warmstart.worker.openai_requests import CHAT_ROLES, RequestLimits

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}


def openapi_schema(limits: RequestLimits, max_model_len: int) -> dict[str, Any]:
    max_tokens = min(limits.max_tokens or max_model_len, max_model_len)
    return {
        "openapi": "3.0.3",
        "info": {"title": "warmstart worker", "version": "1"},
        "paths": {
            "/health": _get("process alive"),
            "/ready": _get("engine serving", extra={"503": _json_response("not serving yet")}),
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text format"}}}},
            "/v1/models": _get("the served model"),
            "/v1/completions": _post(_completion_body(limits, max_tokens)),
            "/v1/chat/completions": _post(_chat_body(limits, max_tokens)),
        },
        "components": {"schemas": {"Error": ERROR}},
    }


def _sampling_properties(limits: RequestLimits, max_tokens: int) -> dict[str, Any]:
    stop_string = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    return {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n, "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "return_token_ids": {"type": "boolean", "nullable": True},
        "stream_options": {
            "type": "object",
            "nullable": True,
            "properties": {"include_usage": {"type": "boolean"}},
            "additionalProperties": False,
        },
        "stop": {
            "nullable": True,
            "oneOf": [
                stop_string,
                {"type": "array", "items": stop_string, "maxItems": limits.max_stop_strings},
            ],
        },
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1, "nullable": True},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "user": {"type": "string"},
    }


def _completion_body(limits: RequestLimits, max_tokens: int) -> dict[str, Any]:
    prompt = {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": limits.max_prompts},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        ]
    }
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {**_sampling_properties(limits, max_tokens), "prompt": prompt},
        "additionalProperties": False,
    }


def _chat_body(limits: RequestLimits, max_tokens: int) -> dict[str, Any]:
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": list(CHAT_ROLES)},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
            "name": {"type": "string"},
        },
        "additionalProperties": False,
    }
    properties = {
        **_sampling_properties(limits, max_tokens),
        "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": limits.max_messages},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens, "nullable": True},
    }
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": properties,
        "additionalProperties": False,
    }


def _json_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def _get(description: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"get": {"responses": {"200": _json_response(description), **(extra or {})}}}


def _post(body: dict[str, Any]) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {
        "post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": "the completion (JSON), or server-sent events with stream: true",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
                "400": {"description": "a bad request, naming the field", **error},
                "404": {"description": "an unknown model", **error},
                "408": {"description": "the body did not arrive in time", **error},
                "413": {"description": "the body is too large", **error},
                "503": {"description": "the engine failed", **error},
            },
        }
    }

"""docs/request_fields.md is current (regenerated from atomd/api/protocol.py), and its outcomes
are what the request decoding really does: unknown fields and unimplemented values are a 400
naming the field, no-op values of unimplemented fields pass."""
from __future__ import annotations

import pathlib
import re
import runpy

import pytest

from atomd.api import protocol, responses_api, validation

pytestmark = pytest.mark.unit

DOC = runpy.run_path(str(pathlib.Path(__file__).resolve().parent.parent / "scripts" / "request_fields_doc.py"),
                     run_name="request_fields_doc")
ROW = re.compile(r"^\| `(/v1/[a-z/]+)` \| `(\w+)` \| \w+ \| (.*) \|$")


def rows() -> list[tuple[str, str, str]]:
    return [m.groups() for line in DOC["OUT"].read_text().splitlines() if (m := ROW.match(line))]


def test_the_table_is_generated_from_the_code():
    assert DOC["OUT"].read_text() == DOC["render"](), "run scripts/request_fields_doc.py"


def base(endpoint: str) -> dict:
    if endpoint == "/v1/responses":
        return {"input": "x"}
    return {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}


def validate(endpoint: str, body: dict) -> None:
    import msgspec

    if endpoint == "/v1/responses":  # what the server does with one: to_chat, then the chat checks
        req = protocol.decode_request(msgspec.json.encode(body), responses_api.ResponsesRequest)
        chat, _ = responses_api.to_chat(req, responses_api.ResponseStore(1), responses_api.L.DEFAULT)
        validation.validate_chat_request(chat)
        return
    kind = protocol.CompletionRequest if endpoint == "/v1/completions" else protocol.ChatCompletionRequest
    req = protocol.decode_request(msgspec.json.encode(body), kind)
    validate = (validation.validate_completion_request if kind is protocol.CompletionRequest
                else validation.validate_chat_request)
    validate(req)


@pytest.mark.parametrize("endpoint,field,outcome", [r for r in rows() if r[2] != "implemented"])
def test_every_unimplemented_field_is_a_400_naming_it(endpoint, field, outcome):
    with pytest.raises(protocol.APIError) as e:
        validate(endpoint, dict(base(endpoint), **{field: {"zzz": "not a no-op"}}))
    assert e.value.status == 400 and (e.value.param or "").split(".")[0] == field
    assert e.value.code == re.search(r"400 `(\w+)`", outcome).group(1)  # the code the table promises
    if "unknown_field" not in outcome:  # a known field: its no-op values pass
        unsupported = responses_api.UNSUPPORTED if endpoint == "/v1/responses" else protocol.UNSUPPORTED
        for noop in unsupported[field]:
            validate(endpoint, dict(base(endpoint), **{field: noop}))

"""The Responses store and request checks without a server (atomd/api/responses_store.py,
atomd/api/responses_api.py): eviction never drops a running background response, a finished
background response fills its own entry, OpenAI's input-items page, and reasoning.effort
refused where the chat template would ignore it. Served behaviour: tests/test_responses_api.py."""
from __future__ import annotations

import pytest

from atomd.api import protocol, responses_api
from atomd.api.responses_store import ResponseStore, StoredResponse, input_items, page

pytestmark = pytest.mark.unit


def entry(status: str = "completed") -> StoredResponse:
    return StoredResponse({"status": status}, [] if status == "completed" else None, [])


def test_the_oldest_finished_response_is_evicted_never_a_running_one():
    store = ResponseStore(2, max_background=1)
    running = entry("queued")
    running.task = object()  # a background generation in flight
    store.put("run", running)
    store.put("b", entry())
    store.put("c", entry())
    assert list(store.items) == ["run", "c"]
    store.put("d", entry())
    assert list(store.items) == ["run", "d"]
    with pytest.raises(protocol.APIError) as e:
        store.get("run")  # not completed: no conversation to continue
    assert (e.value.status, e.value.code) == (400, "previous_response_not_completed")
    store.completed("run", {"status": "completed"}, ["turn"], [])
    assert store.items["run"] is running and running.conversation == ["turn"]
    with pytest.raises(protocol.APIError) as e:
        store.find("b")
    assert (e.value.status, e.value.code) == (404, "response_not_found")


def test_input_items_and_their_pages():
    items = input_items([{"role": "user", "content": "x"},
                         {"role": "assistant", "content": [{"type": "output_text", "text": "y"}]},
                         {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c", "output": "1"}])
    assert [(i["type"], i.get("role")) for i in items] == [("message", "user"), ("message", "assistant"),
                                                          ("function_call", None), ("function_call_output", None)]
    assert [i["content"][0]["type"] for i in items[:2]] == ["input_text", "output_text"]
    ids = [i["id"] for i in items]
    assert len(set(ids)) == 4
    assert [i["id"] for i in page(items, {})["data"]] == ids[::-1]  # desc by default, as OpenAI
    first = page(items, {"order": "asc", "limit": "3"})
    assert [i["id"] for i in first["data"]] == ids[:3] and first["has_more"] and first["last_id"] == ids[2]
    rest = page(items, {"order": "asc", "after": ids[2]})
    assert [i["id"] for i in rest["data"]] == ids[3:] and not rest["has_more"]
    for query, param in (({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
                         ({"order": "up"}, "order"), ({"after": "nope"}, "after")):
        with pytest.raises(protocol.APIError) as e:
            page(items, query)
        assert (e.value.status, e.value.param) == (400, param)


def test_reasoning_effort_is_refused_where_the_template_does_not_read_it():
    req = responses_api.ResponsesRequest(input="x", reasoning=responses_api.Reasoning(effort="high"))
    for template in (None, "{{ messages[0]['content'] }}"):
        with pytest.raises(protocol.APIError) as e:
            responses_api.reasoning_kwargs(req, template)
        assert (e.value.status, e.value.param) == (400, "reasoning.effort")
    assert responses_api.reasoning_kwargs(req, "{{ reasoning_effort }}") == {"reasoning_effort": "high"}
    none = responses_api.ResponsesRequest(input="x", reasoning=responses_api.Reasoning())
    assert responses_api.reasoning_kwargs(none, None) is None  # {} asks for nothing

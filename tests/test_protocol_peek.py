"""A message refused before it is parsed (too large) still carries its request's id back (#47)."""

from __future__ import annotations

import json

import pytest

from streamllm.service import protocol as p


def big(**fields) -> str:
    return json.dumps({**fields, "lines": ["x" * 3000]})


@pytest.mark.parametrize(("raw", "want"), [
    (big(type="push", id=30, session="s"), 30),
    (big(id="req-7", type="push"), "req-7"),
    ('{"type": "push", "id" : -4, "lines": []}', -4),
    ('{"type": "push", "id": "a\\"b", "lines": []}', 'a"b'),  # escapes read as decode reads them
    # an "id" inside a string or a nested object is not the message's id
    ('{"lines": ["{\\"id\\": 5}"], "q": {"id": 6}, "id": 7}', 7),
    ('{"lines": ["\\"id\\": 5"], "q": {"id": 6}}', None),
    ('{"id": 1.5}', None), ('{"id": true}', None), ('{"id": null}', None),
    ('{"id": "' + "x" * (p.MAX_ID_CHARS + 1) + '"}', None),  # an id decode would refuse
    (json.dumps({"type": "push", "lines": ["x" * 5000], "id": 9}), None),  # past the head: not looked for
])
def test_peek_id(raw, want):
    assert p.peek_id(raw) == want
    assert p.peek_id(raw.encode()) == want


def test_a_too_large_message_is_refused_with_its_id():
    with pytest.raises(p.ProtocolError) as refused:
        p.decode(big(type="push", id=30, session="s").encode(), 1000)
    assert refused.value.code == p.TOO_LARGE and refused.value.request_id == 30

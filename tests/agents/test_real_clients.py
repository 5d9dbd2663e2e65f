"""Claude Code, Codex and opencode, installed from npm at their pinned versions, driven
headless against ``kvstore serve`` with the README's settings: a turn that calls a tool
(the model asks for a file, the client reads it and sends it back), a turn that continues
the session, a server restart on the same cache root and a turn that resumes the session.

No request is refused; every turn ends without an error; from the second turn on at least
95% of each request's prompt comes from the cache, from memory and, after the restart, from
disk; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_model import REPLY, TOOL_WORD
from scenario import CLAUDE, CODEX, MARKER, OPENCODE, REUSE, Client, session, tool_results, usage

pytestmark = pytest.mark.agents


@pytest.mark.parametrize("client", [CLAUDE, CODEX, OPENCODE], ids=lambda c: c.name)
def test_a_session_calls_a_tool_and_is_reused_from_memory_and_after_a_restart_from_disk(
        client: Client, tmp_path: Path, bin_dir: Path) -> None:
    with session(client, tmp_path, bin_dir) as s:
        one = s.turn(client.first(f"Read the README of this project. {TOOL_WORD}"))
        assert one.run.ok() and REPLY in one.run.stdout, one.run
        sid = client.session(one.run)
        two = s.turn(client.again("What does it say?"))
        assert two.run.ok() and REPLY in two.run.stdout, two.run
        s.restart()
        three = s.turn(client.resume("Thanks, that is all.", sid), restarted=True)
        assert three.run.ok() and REPLY in three.run.stdout, three.run
        done = [e for t in s.turns for e in t.exchanges]

    # no request refused, none past 127.0.0.1
    assert [(e.method, e.path, e.status) for e in done if e.status != 200] == []
    assert s.recorder.escapes == []
    # the tool round trip: the model's call, run by the client, its result sent back
    first = one.model_requests(client.path)
    assert len(first) >= 2, [e.path for e in one.exchanges]
    results = [r for e in first[1:] for r in tool_results(e)]
    assert any(MARKER in r for r in results), results
    # from the second turn on, each request's prompt from the cache: memory, then disk
    shares = {(i, j): usage(e) for i, t in enumerate(s.turns) if i > 0
              for j, e in enumerate(t.model_requests(client.path))}
    assert len(shares) >= 2
    low = {k: v for k, v in shares.items() if v[1] < REUSE * v[0]}
    assert not low, (low, shares)

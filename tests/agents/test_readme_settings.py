"""The README's "Coding agents" settings are what tests/agents/ runs the clients with (read
from the README by ``clients.readme_settings``): they parse for each client, name the
server's address where the tests put theirs, and the README names the pinned versions.
In the default suite: no client is installed or run."""

from __future__ import annotations

import clients


def test_each_clients_readme_settings_parse_and_point_at_the_server() -> None:
    claude = clients.readme_settings("claude", "127.0.0.1:1234")
    assert claude.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:1234"
    assert claude.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    codex = clients.readme_settings("codex", "127.0.0.1:1234")
    assert list(codex.files) == [".codex/config.toml"]
    assert 'base_url = "http://127.0.0.1:1234/v1"' in codex.files[".codex/config.toml"]
    opencode = clients.readme_settings("opencode", "127.0.0.1:1234")
    assert list(opencode.files) == [".config/opencode/opencode.json"]
    assert '"baseURL": "http://127.0.0.1:1234/v1"' in \
        opencode.files[".config/opencode/opencode.json"]
    assert opencode.env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    options = clients.serve_options()
    assert "--max-tokens" in options and "--model" not in options and "--port" not in options


def test_the_readme_names_the_pinned_versions() -> None:
    section = " ".join(clients.readme_section().split())  # line breaks are spaces
    v = clients.versions()
    for name, package in (("Claude Code", "@anthropic-ai/claude-code"),
                          ("Codex", "@openai/codex"), ("opencode", "opencode-ai")):
        assert f"{name} {v[package]}" in section, (name, v[package])

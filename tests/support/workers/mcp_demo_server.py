"""A tiny, real MCP stdio server for muajax's tests: an in-memory notes store.

State lives in the process, so every server process is an isolated store. Run with
`python tests/support/workers/mcp_demo_server.py` (stdio transport); `server.streamable_http_app()`
serves it over streamable HTTP (tests/support/mcp_http_server.py). Built on the MCP SDK's
`MCPServer` (mcp 2.x's name for FastMCP).
"""
from __future__ import annotations

import json
import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("muajax-notes-demo", log_level="WARNING")
_notes: dict[str, str] = {}


@server.tool()
def add_note(title: str, body: str) -> str:
    """Save a note, replacing any note with the same title.

    Args:
        title: The note's title.
        body: The note's text.
    """
    if not title.strip():
        raise ToolError("a note needs a non-empty title")
    _notes[title] = body
    return f"Saved note {title!r}."


@server.tool()
def get_note(title: str) -> str:
    """Read a note by its title.

    Args:
        title: The note's title.
    """
    if title not in _notes:
        raise ToolError(f"no note titled {title!r}")
    return _notes[title]


@server.tool()
def list_notes() -> str:
    """The titles of all notes, as a JSON list."""
    return json.dumps(sorted(_notes))


@server.tool()
def delete_note(title: str) -> str:
    """Delete a note.

    Args:
        title: The note's title.
    """
    # A bare KeyError, not a ToolError: exercises an unexpected server-side exception.
    del _notes[title]
    return f"Deleted note {title!r}."


@server.tool()
def wait(seconds: float) -> str:
    """Sleep, then answer (for timeout tests).

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"waited {seconds} s"


@server.tool()
def get_env(name: str) -> str:
    """The value of one of the server's environment variables ("" when unset).

    Args:
        name: The variable's name.
    """
    return os.environ.get(name, "")


@server.tool()
def server_pid() -> int:
    """The server's process id (lets tests check that the process is gone after close)."""
    return os.getpid()


if __name__ == "__main__":
    server.run("stdio")

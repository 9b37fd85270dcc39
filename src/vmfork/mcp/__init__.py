"""``vmfork mcp``: a Model Context Protocol server over the daemon's REST API.

MCP clients (desktop assistants, coding agents) get forkd-mcp's tools with the
same names and parameters, plus files and snapshot details. The tools call the
daemon through the Python SDK (``vmfork.client``); the official MCP Python SDK
(``mcp``) speaks the protocol, over stdio or streamable HTTP.
"""

from vmfork.mcp.server import build_server

__all__ = ["build_server"]

"""Any MCP server as a tool domain (stdio or streamable HTTP)."""

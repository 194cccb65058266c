"""The service: one server (websocket, HTTP), its connections, tenants and metrics; the thin client."""

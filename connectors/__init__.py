"""Sink plugins: one module per sink type, found through the kv_bridge.connectors entry points."""

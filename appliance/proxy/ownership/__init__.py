"""Who must free the KV P computes for a request (`kv`: one explicit holder per transfer),
the D calls waiting on it (`pulls`), and the proxy's release of what nobody took (`release`)."""

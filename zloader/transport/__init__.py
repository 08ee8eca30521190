"""ZeroMQ framing and the shared-memory ring."""

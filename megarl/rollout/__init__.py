"""Rollout: the embedded generation engine (engine/), its SGLang-compatible HTTP server (server/),
the trainer-side client (client/), engine processes and the router (fleet/), and the multi-turn
agent loop (agent/)."""

"""The embedded rollout server: SGLang's HTTP API in front of the generation engine.

    python -m megarl.rollout.server --model-path DIR [--tp N] [--port 30000]

app.py assembles the FastAPI app from one APIRouter per route group; the request and response
field tables are SGLang's (sglang_fields.py), checked against the real sglang package in tests.
"""

"""The embedded server's routes, one APIRouter per group, included by app.py in this order:
generate.py (/generate, streamed or not), control.py (health, model and server info, load, layout,
abort, pause/continue, flush cache), weights.py (every weight-update and weight-version endpoint)
memory.py (release/resume memory occupation) and lora.py (load / unload LoRA adapters). Each route reaches the engine through the one
ServerState on app.state (state.py)."""

from megarl.rollout.server.routes import control, generate, lora, memory, weights

ROUTERS = (generate.router, control.router, weights.router, memory.router, lora.router)

"""Rollout engine processes as the controller sees them: RolloutFleet (fleet.py) over Ray launcher
actors (engine_launcher.py), the embedded server's and SGLang's subprocesses (server_process.py,
sglang_process.py, sglang_launch.py) and sglang-router (router.py, router_actor.py)."""

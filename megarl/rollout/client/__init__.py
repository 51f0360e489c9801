"""The trainer's side of rollout: RolloutClient (client.py) for any server speaking SGLang's HTTP
API, RolloutManager (manager.py) that turns a batch of prompts into a batch of rows, and partial
rollouts carried across weight updates (partial.py). Never imports the engine or the server."""

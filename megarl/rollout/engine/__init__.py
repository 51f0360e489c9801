"""The in-process generation engine behind the embedded server: GenerationEngine (generation.py),
its continuous-batching scheduler, rows and sampling protocol, logit processing, KV cache and
attention masks, weight loading (weights.py), and the model runners for tp=1 and tp>1 (runner/)."""

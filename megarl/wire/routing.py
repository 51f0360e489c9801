"""MoE routing records: which experts the embedded engine routed every token to, in SGLang's format.

A request with `return_routed_experts: true` (SGLang's field) gets `meta_info["routed_experts"]`,
the Megatron engine replays it (actor.moe.routing_replay, engine/megatron/routing_replay.py), and a
real SGLang server launched with --enable-return-routed-experts sends the same thing.

Wire format (SGLang's, from its routed_experts_capturer): base64 of a little-endian int32 array,
flattened from the logical shape [tokens, num_hidden_layers, top_k]:

- tokens: every token the engine fed through the model, i.e. prompt + output - 1 (the last sampled
  token is never fed), from `routed_experts_start_len` (default 0) on;
- layers: all decoder layers, in order; a dense layer (DeepSeek-V3's first_k_dense_replace, Qwen's
  mlp_only_layers) holds zeros, as in SGLang, whose buffer is num_hidden_layers wide;
- per token and layer, the top_k expert ids the router chose, in the router's order.

The shape is not sent; the reader knows num_hidden_layers and num_experts_per_tok from the model.
In a trainer Batch the column `routed_experts` is [rows, T, num_hidden_layers * top_k] int16 aligned
with `input_ids` (position t = token t's experts), -1 where nothing was routed (a row's last token,
padding); `batch_column` builds it.

Capture hooks the Hugging Face router modules (Qwen3-MoE's sparse MoE block, DeepSeek-V3's top-k
router): forward hooks, armed only for batches in which a request asked, so other batches pay
nothing. Under tensor parallelism rank 0's hooks see every token: routers are replicated and their
input is the all-reduced hidden state.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

NO_EXPERT = -1  # batch_column's value where the rollout routed nothing


def _qwen3_moe_topk(module, output) -> torch.Tensor:
    """Qwen3MoeSparseMoeBlock returns (hidden, router_logits); its choice is top_k of the softmax,
    recomputed here exactly as transformers computes it (same ops, same dtype)."""
    weights = torch.softmax(output[1], dim=1, dtype=torch.float)
    return torch.topk(weights, module.top_k, dim=-1).indices


def _deepseek_v3_topk(module, output) -> torch.Tensor:
    return output[0]  # DeepseekV3TopkRouter returns (topk_indices, topk_weights)


# HF module class name -> how its forward output gives the chosen experts [tokens, top_k]
_ROUTERS = {"Qwen3MoeSparseMoeBlock": _qwen3_moe_topk, "DeepseekV3TopkRouter": _deepseek_v3_topk}


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


class RoutingRecorder:
    """Forward hooks on a model's MoE routers; `attach` returns None for a model without any."""

    def __init__(self, model, routers: list[tuple[int, torch.nn.Module]]):
        config = model.config
        self.num_layers, self.top_k = config.num_hidden_layers, config.num_experts_per_tok
        self.armed = False
        self.last: dict[int, torch.Tensor] = {}  # layer -> [tokens, top_k] of the last forward
        for layer, module in routers:
            module.register_forward_hook(self._hook(layer, _ROUTERS[type(module).__name__]))

    @classmethod
    def attach(cls, model) -> RoutingRecorder | None:
        routers = [(_layer_index(name), m) for name, m in model.named_modules() if type(m).__name__ in _ROUTERS]
        return cls(model, routers) if routers else None

    def _hook(self, layer: int, topk):
        def hook(module, inputs, output):
            if self.armed:
                self.last[layer] = topk(module, output).to("cpu", torch.int32)

        return hook

    def take(self, rows: int, width: int) -> torch.Tensor:
        """The last forward's choices as [rows, width, layers, top_k] (zeros on dense layers)."""
        out = torch.zeros(rows, width, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, ids in self.last.items():
            out[:, :, layer] = ids.view(rows, width, self.top_k)
        self.last = {}
        return out


class BatchCapture:
    """One running batch's routing records, appended to the rows that asked (Row.routed)."""

    def __init__(self, recorder: RoutingRecorder, rows):
        self.recorder, self.rows = recorder, rows

    @staticmethod
    def start(recorder: RoutingRecorder | None, rows) -> BatchCapture | None:
        """Arm the hooks iff a row of this batch asked; None (nothing recorded) otherwise."""
        wanted = recorder is not None and any(r.req.return_routed_experts for r in rows)
        if recorder is not None:
            recorder.armed, recorder.last = wanted, {}
        return BatchCapture(recorder, rows) if wanted else None

    def prefill(self, width: int) -> None:
        """After the prefill of the left-padded rows [rows, width] (Row.fed_ids each)."""
        ids = self.recorder.take(len(self.rows), width)
        for b, row in enumerate(self.rows):
            if row.req.return_routed_experts:
                # a re-prefill after a retraction feeds the output too: the tokens already recorded
                # keep the experts of the forward that produced their successors' log-probs
                have = sum(len(piece) for piece in row.routed)
                row.routed.append(ids[b, width - len(row.fed_ids()) + have :])

    def decode(self, active: list[int]) -> None:
        """After a decode step of the rows `active` (one token each)."""
        ids = self.recorder.take(len(active), 1)
        for k, i in enumerate(active):
            if self.rows[i].req.return_routed_experts:
                self.rows[i].routed.append(ids[k])


def row_records(routed: list[torch.Tensor], tokens: int) -> np.ndarray:
    """A row's records [tokens, layers, top_k] int32, cut to `tokens` (prompt + output - 1)."""
    if not routed:
        return np.zeros((0, 0, 0), dtype=np.int32)
    return torch.cat(routed)[: max(tokens, 0)].numpy()


def encode(records: np.ndarray, start: int = 0) -> str:
    """SGLang's meta_info["routed_experts"]: base64 of little-endian int32, from token `start`."""
    return base64.b64encode(np.ascontiguousarray(records[start:], dtype="<i4").tobytes()).decode("ascii")


def concat(first: str, then: str) -> str:
    """Two records of consecutive token ranges (SGLang's base64) as one."""
    return base64.b64encode(base64.b64decode(first) + base64.b64decode(then)).decode("ascii")


def decode(value: str, tokens: int) -> np.ndarray:
    """meta_info["routed_experts"] -> [tokens, layers * top_k] int32 (the shape is not sent)."""
    flat = np.frombuffer(base64.b64decode(value), dtype="<i4")
    if tokens <= 0 or flat.size % tokens:
        raise ValueError(
            f"routed_experts holds {flat.size} expert ids, not a whole number per token for "
            f"{tokens} tokens (prompt + output - 1); the server's routing record is truncated"
        )
    return flat.reshape(tokens, -1)


def batch_column(rows: list[tuple[list[int], object]], width: int) -> torch.Tensor:
    """The Batch column `routed_experts` [rows, width, layers * top_k] int16 (module doc) from
    (prompt ids, GenerateOutput) pairs whose meta_info carries SGLang's routed_experts."""
    decoded = []
    for i, (prompt, out) in enumerate(rows):
        value = out.meta_info.get("routed_experts")
        if not isinstance(value, str):
            raise RuntimeError(
                f"rollout row {i}: the server returned no routed_experts although return_routed_experts was "
                "requested (actor.moe.routing_replay); a real SGLang server needs --enable-return-routed-experts (megarl "
                "passes it to the engines it launches), and sglang-router drops the field (RolloutManager sends "
                "these requests to the engines directly)"
            )
        decoded.append(decode(value, len(prompt) + len(out.output_ids) - 1))
    per_token = {d.shape[1] for d in decoded}
    if len(per_token) != 1:
        raise RuntimeError(
            f"rollout rows carry {sorted(per_token)} expert ids per token; one model routes "
            "every row with the same layers and top_k"
        )
    if decoded and max(int(d.max(initial=0)) for d in decoded) > torch.iinfo(torch.int16).max:
        raise RuntimeError("routed_experts names an expert id above 32767; the int16 column cannot hold it")
    column = torch.full((len(rows), width, per_token.pop()), NO_EXPERT, dtype=torch.int16)
    for i, d in enumerate(decoded):
        column[i, : len(d)] = torch.from_numpy(d.astype(np.int16))
    return column

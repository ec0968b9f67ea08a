"""What a step must move and compute, from the model config and the batch alone (the performance model of
docs/DESIGN.md): the floor that any implementation pays, so achieved rates derived from it are lower bounds.

    weight bytes   every weight once per step (quantized ones at their stored size: values + scales); an untied
                   embedding table is gathered, so only the rows of the step's tokens are read; a MoE layer's
                   experts are read at the step's expert coverage: with n tokens each routed to k of X experts,
                   the expected share hit is 1 - (1 - k/X)^n (uniform routing; taken at the mean n of the steps)
    KV read        context tokens x KV bytes per token (each sequence's whole cache, read once by its attention)
    KV write       new tokens x KV bytes per token
    FLOPs          2 x decoder matmul params x tokens        (q, k, v, o, gate, up, down; MoE: the router and
                                                              the k experts a token is routed to, not all X)
                 + 2 x LM-head params x sequences            (logits only at each sequence's last token)
                 + 4 x heads x head_dim x layers x pairs     (q.k and p.v for each (query, key) pair)

Every term but the expert coverage is linear in (steps, tokens, sequences, context tokens, pairs), so the same
formula prices one step, a window of steps or the engine's running totals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.quant.memory import weight_bytes


@dataclasses.dataclass(frozen=True)
class Work:
    """Bytes moved and FLOPs done by some steps."""

    weight_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    flops: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Per-unit prices of a model's steps; `num_devices` is how many devices share each step (tensor parallel)."""

    step_weight_bytes: int  # read whole by every step
    token_weight_bytes: int  # read per token (rows of a gathered, untied embedding)
    kv_bytes_per_token: int  # K and V of one token over all layers
    matmul_params: int  # decoder-layer projection parameters
    head_params: int  # LM head (vocab x hidden)
    flops_per_pair: int  # attention FLOPs per (query, key) pair over all layers
    num_devices: int = 1
    expert_bytes: int = 0  # MoE: all experts of all layers (not in step_weight_bytes)
    expert_share_per_token: float = 0.0  # MoE: k / X, the share of a layer's experts one token is routed to

    @classmethod
    def of(cls, cfg: ModelConfig, weight_dtype: str, kv_bytes_per_token: int, num_devices: int = 1,
           stored: Mapping[str, str] | None = None) -> "ModelCost":
        """`stored`: the weights kept in another dtype than weight_dtype, by path (EngineCore.stored_dtypes)."""
        total = weight_bytes(cfg, weight_dtype, stored)
        row = cfg.hidden_size * jnp.dtype(weight_dtype).itemsize
        embed = cfg.vocab_size * row
        e, d = cfg.hidden_size, cfg.head_dim
        layer = e * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.mlp_params(active=True)
        tied = cfg.tie_word_embeddings  # the table is then read whole as the LM head
        experts = (cfg.num_layers * cfg.num_experts * 3 * e * cfg.intermediate_size
                   * jnp.dtype(weight_dtype).itemsize if cfg.is_moe else 0)  # experts stay float (llama.py)
        return cls(step_weight_bytes=(total if tied else total - embed) - experts,
                   token_weight_bytes=0 if tied else row, kv_bytes_per_token=kv_bytes_per_token,
                   matmul_params=cfg.num_layers * layer, head_params=cfg.vocab_size * e,
                   flops_per_pair=4 * cfg.num_heads * d * cfg.num_layers, num_devices=num_devices,
                   expert_bytes=experts,
                   expert_share_per_token=cfg.num_experts_per_tok / cfg.num_experts if cfg.is_moe else 0.0)

    def plus(self, draft: "ModelCost") -> "ModelCost":
        """The prices of steps that also run a draft model's forward pass over the same tokens (speculative
        decoding, jaxserve.spec.draft): the two models' sums. A MoE draft's experts count whole. Not counted:
        the K single-token draft passes a verify step runs first (K more reads of the draft's weights)."""
        return dataclasses.replace(
            self, step_weight_bytes=self.step_weight_bytes + draft.step_weight_bytes + draft.expert_bytes,
            token_weight_bytes=self.token_weight_bytes + draft.token_weight_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token + draft.kv_bytes_per_token,
            matmul_params=self.matmul_params + draft.matmul_params, head_params=self.head_params + draft.head_params,
            flops_per_pair=self.flops_per_pair + draft.flops_per_pair)

    def expert_coverage(self, tokens_per_step: float) -> float:
        """Expected share of a MoE layer's experts that a step of this many tokens reads."""
        return 1.0 - (1.0 - self.expert_share_per_token) ** tokens_per_step

    def weights_read(self, steps: int, tokens: int) -> float:
        """Weight bytes `steps` steps of `tokens` tokens in all read (see the module docstring)."""
        experts = steps * self.expert_bytes * self.expert_coverage(tokens / steps) if steps else 0.0
        return steps * self.step_weight_bytes + tokens * self.token_weight_bytes + experts

    def work(self, steps: int, tokens: int, seqs: int, context_tokens: int, attended_pairs: int) -> Work:
        return Work(weight_bytes=self.weights_read(steps, tokens),
                    kv_read_bytes=context_tokens * self.kv_bytes_per_token,
                    kv_write_bytes=tokens * self.kv_bytes_per_token,
                    flops=2 * self.matmul_params * tokens + 2 * self.head_params * seqs
                    + self.flops_per_pair * attended_pairs)

    def of_records(self, records) -> Work:
        """The work of some StepRecords (jaxserve.engine.stats): a decode burst of D steps is D forward passes,
        each reading the weights and running the LM head over the rows still in their burst."""
        return self.work(sum(r.burst for r in records), sum(r.num_tokens for r in records),
                         sum(r.head_rows for r in records), sum(r.context_tokens for r in records),
                         sum(r.attended_pairs for r in records))

    def of_totals(self, totals) -> Work:
        """The work of an engine's running totals (jaxserve.engine.stats.StepTotals)."""
        return self.work(totals.passes, totals.tokens, totals.head_rows, totals.context_tokens,
                         totals.attended_pairs)

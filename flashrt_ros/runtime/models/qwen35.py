"""Qwen3.5-style hybrid decoder: Gated DeltaNet and gated full attention, an MTP
head, and optional policy heads, computing over named views of the state arena.

The model owns weights and derived constants only. Every piece of execution
state (KV, recurrent, conv, MTP KV, position, last hidden state, input history)
is a view of the arena it is bound to, so capsules see all of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import gated_delta, sampling
from ..arena import RegionSpec, StateArena
from ..attention import Span, attend_one, write_and_attend
from ..backends.cpu import row_product
from ..backends.cpu.delta_step import DeltaStep
from ..config import FULL, LINEAR, ModelConfig
from ..layers import apply_rope, gated_rms_norm, rms_norm, rope_tables
from ..projection import Projection
from .cast import Cast
from .moe import SparseMoE, SwiGLU


def state_specs(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype) -> list[RegionSpec]:
    """The arena regions this model needs; the arena decides where they go."""
    n_full, n_lin = len(cfg.full_layers), len(cfg.linear_layers)
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    specs = [
        RegionSpec("meta.position", "meta", torch.int64, (1,)),
        # The sampling RNG's state: its seed; the position is its counter (see sampling.py).
        RegionSpec("meta.rng", "meta", torch.int64, (1,)),
        RegionSpec("meta.last_hidden", "meta", dtype, (cfg.hidden_size,)),
        # Per row: the token id (-1 for an observation step) and the sampling seed in effect when
        # the row was committed, so that a replay of the rows sets the RNG state as the run had it.
        RegionSpec("meta.tokens", "meta", torch.int64, (max_seq_len, 2), per_token=True),
    ]
    if n_lin:
        specs += [
            RegionSpec("recurrent", "recurrent", torch.float32,
                       (n_lin, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)),
            RegionSpec("conv", "conv", dtype, (n_lin, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)),
        ]
    if n_full:
        # Position-major: the live prefix of every attention layer is ONE range.
        specs.append(RegionSpec("kv", "kv", dtype, (max_seq_len, n_full, 2, hkv, d), per_token=True))
    if cfg.mtp_num_hidden_layers:
        specs.append(RegionSpec("mtp.kv", "mtp", dtype, (max_seq_len, 2, hkv, d), per_token=True))
    if cfg.policy:
        specs.append(RegionSpec("meta.observations", "meta", torch.float32, (max_seq_len, cfg.obs_dim), per_token=True))
    return specs


@dataclass(slots=True)
class _Block:
    """One decoder layer's weights. Projections are stored transposed, [in, out], and fused
    (one GEMM per projection group): the layout a row streams through in order."""

    kind: str
    ln_in: torch.Tensor            # fp32, 1 + w
    ln_post: torch.Tensor          # fp32, 1 + w
    mlp: SwiGLU | SparseMoE
    in_proj: Projection            # linear: qkv|z|b|a   full: q|k|gate|v
    out_proj: Projection
    norm_a: torch.Tensor           # linear: gated output norm (plain w)   full: q|k norm per head (1 + w)
    conv: torch.Tensor | None = None      # [K, C], time-major like the conv state
    neg_a: torch.Tensor | None = None     # -exp(A_log), fp32
    dt_bias: torch.Tensor | None = None   # fp32
    slot: int = 0                  # index into the recurrent/conv or kv region
    delta: DeltaStep | None = None        # linear, CPU backend: the mixer in one C call (prefill too)


def _mlp(w: dict[str, torch.Tensor], p: str, cfg: ModelConfig, cast: Cast) -> SwiGLU | SparseMoE:
    """The FFN under ``p`` (``...mlp.``): dense, or a sparse MoE block (experts as [in, out])."""
    def swiglu(q: str) -> SwiGLU:
        gate_up = cast.proj(w[f"{q}gate_proj.weight"], w[f"{q}up_proj.weight"])
        return SwiGLU(gate_up, cast.proj(w[f"{q}down_proj.weight"]))

    if not cfg.moe:
        return swiglu(p)
    shared = gates = None
    if cfg.shared_expert_intermediate_size:
        shared, gates = swiglu(f"{p}shared_expert."), w[f"{p}shared_expert_gate.weight"]
    router = cast.proj(*[t for t in (w[f"{p}gate.weight"], gates) if t is not None])
    return SparseMoE(router, cast.t_each(w[f"{p}experts.gate_up_proj"]),
                     cast.t_each(w[f"{p}experts.down_proj"]), cfg.num_experts_per_tok, shared)


def _block(w: dict[str, torch.Tensor], prefix: str, kind: str, slot: int, cast: Cast, cfg: ModelConfig) -> _Block:
    common = dict(ln_in=cast.one_plus(w[f"{prefix}input_layernorm.weight"]),
                  ln_post=cast.one_plus(w[f"{prefix}post_attention_layernorm.weight"]),
                  mlp=_mlp(w, f"{prefix}mlp.", cfg, cast))
    if kind == FULL:
        a = f"{prefix}self_attn."
        q_norm, k_norm = w[f"{a}q_norm.weight"], w[f"{a}k_norm.weight"]
        d = q_norm.shape[0]
        # q_proj interleaves [query_h, gate_h] per head; regroup the rows as
        # queries | keys | gates | values so that queries and keys are one block
        # that takes a single per-head norm and a single RoPE.
        q_and_gate = w[f"{a}q_proj.weight"].view(-1, 2, d, w[f"{a}q_proj.weight"].shape[-1])
        heads = q_and_gate.shape[0]
        kv_heads = w[f"{a}k_proj.weight"].shape[0] // d
        return _Block(kind, **common, slot=slot,
                      in_proj=cast.proj(q_and_gate[:, 0].flatten(0, 1), w[f"{a}k_proj.weight"],
                                        q_and_gate[:, 1].flatten(0, 1), w[f"{a}v_proj.weight"]),
                      out_proj=cast.proj(w[f"{a}o_proj.weight"]),
                      norm_a=cast.one_plus(torch.cat([q_norm.expand(heads, d), k_norm.expand(kv_heads, d)])))
    a = f"{prefix}linear_attn."
    return _Block(kind, **common, slot=slot,
                  in_proj=cast.proj(w[f"{a}in_proj_qkv.weight"], w[f"{a}in_proj_z.weight"],
                                    w[f"{a}in_proj_b.weight"], w[f"{a}in_proj_a.weight"]),
                  out_proj=cast.proj(w[f"{a}out_proj.weight"]),
                  norm_a=cast(w[f"{a}norm.weight"]),
                  conv=cast(w[f"{a}conv1d.weight"][:, 0, :].t()),
                  neg_a=-w[f"{a}A_log"].float().exp().to(cast.device),
                  # A copy: float() and to() hand back the very tensor when it is fp32 on the device,
                  # which from a checkpoint is the safetensors file's memory map, kept mapped for good.
                  dt_bias=w[f"{a}dt_bias"].float().to(cast.device, copy=True))


class Qwen35:
    """The hybrid decoder. Build, then ``bind`` an arena; every forward writes state there."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, max_seq_len: int, cpu_kernels: bool = False,
                 fixed_shapes: bool = False) -> None:
        """``cpu_kernels``: run few-row products and the linear mixers on the CPU backend (float32
        on a CPU, the library built; the caller checks ``backends.cpu.serves``). ``fixed_shapes``:
        decode, verify and draft rows route their experts with fixed shapes and no host read
        (``SparseMoE.gathered``, what a CUDA graph captures); prefill always groups rows by expert."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.cpu_kernels, self.fixed_shapes = cpu_kernels, fixed_shapes
        cast = Cast(device, dtype)
        head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        self.lm_head = cast.proj(head)   # [in, out], as every projection (see _Block)
        # Tied: the table is the head's own memory, read by column (a lookup gathers one row per
        # token, a strided read), not a second copy of the largest matrix.
        self.embed = self.lm_head.w.t() if cfg.tie_word_embeddings else cast(weights["model.embed_tokens.weight"])
        self.final_norm = cast.one_plus(weights["model.norm.weight"])
        slots = {FULL: 0, LINEAR: 0}
        self.blocks: list[_Block] = []
        for idx, kind in enumerate(cfg.layer_types):
            self.blocks.append(_block(weights, f"model.layers.{idx}.", kind, slots[kind], cast, cfg))
            slots[kind] += 1
        self.mtp: _Block | None = None
        if cfg.mtp_num_hidden_layers:
            self.mtp = _block(weights, "mtp.layers.0.", FULL, 0, cast, cfg)
            # A boundary needs only the MTP layer's K and V rows; its queries, gates, attention
            # and MLP only make drafts (speculative decoding). So K|V is one product and
            # queries|gates another: a boundary skips the second, and a draft computes its K
            # and V rows with the very product a boundary uses, so the MTP KV row it writes
            # at the position counter is the committed one.
            a = "mtp.layers.0.self_attn."
            self.mtp_kv_proj = cast.proj(weights[f"{a}k_proj.weight"], weights[f"{a}v_proj.weight"])
            q_and_gate = weights[f"{a}q_proj.weight"].view(cfg.num_attention_heads, 2, cfg.head_dim, -1)
            self.mtp.in_proj = cast.proj(q_and_gate[:, 0].flatten(0, 1), q_and_gate[:, 1].flatten(0, 1))
            self.mtp_q_norm = self.mtp.norm_a[:cfg.num_attention_heads]
            self.mtp_k_norm = self.mtp.norm_a[cfg.num_attention_heads:]
            self.mtp_fc = cast.proj(weights["mtp.fc.weight"])
            self.mtp_norm_embed = cast.one_plus(weights["mtp.pre_fc_norm_embedding.weight"])
            self.mtp_norm_hidden = cast.one_plus(weights["mtp.pre_fc_norm_hidden.weight"])
            self.mtp_final_norm = cast.one_plus(weights["mtp.norm.weight"])
        if cpu_kernels:   # one scratch for every product, sized once every weight is built
            products = self.projections() + self.draft_projections() + self.expert_projections()
            partials = row_product.scratch(max(p.w.shape[1] for p in products))
            for p in products:
                p.use_row_kernel(partials)
        if cfg.policy:
            self.obs_proj = cast.t(weights["policy.obs_proj.weight"])
            self.obs_bias = cast(weights["policy.obs_proj.bias"])
            self.action_head = cast.t(weights["policy.action_head.weight"])
            self.action_bias = cast(weights["policy.action_head.bias"])
        cos, sin = rope_tables(max_seq_len, cfg.rotary_dim, cfg.rope_theta, device)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self.rows = torch.arange(max_seq_len, device=device)
        self.vocab_index = torch.arange(cfg.vocab_size, device=device)
        # Not state: the sampled step's input, a fixed address so that a captured graph reads
        # whatever the engine writes here before replaying it.
        # float64, as the scores are: a float32 would flush a temperature under 1e-38 to 0.
        self.temperature = torch.ones(1, dtype=torch.float64, device=device)
        # The cut a truncated draw makes (sampling.threshold): top-k (0: none), top-p (1: none).
        self.cut = (torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.float64, device=device))
        # Not state either: the last decode step's margin (sampling.margin) in logit units,
        # an output at a fixed address like the policy's action.
        self.margin = torch.zeros(1, dtype=torch.float64, device=device)
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.qk_scale = torch.tensor([dk ** -1.0] * hk + [dk ** -0.5] * hk, device=device).view(2 * hk, 1)
        self.arena: StateArena | None = None

    def bind(self, arena: StateArena, verify_rows: int = 0) -> None:
        """Take the arena's views. ``verify_rows``: the most rows a ``verify`` runs, each of which
        leaves its fixed-size state in ``verify_states``."""
        self.arena = arena
        # The fixed-size state after each row of a verify, laid out as the arena's fixed block.
        self.verify_states = torch.zeros(verify_rows, arena.fixed_bytes, dtype=torch.uint8, device=arena.device)
        self._row_views = [arena.fixed_views(image) for image in self.verify_states]
        self.position = arena["meta.position"]
        self.rng_seed = arena["meta.rng"]
        self.last_hidden = arena["meta.last_hidden"]
        self.tokens, self.seeds = arena["meta.tokens"].unbind(1)
        self.recurrent = arena.views.get("recurrent")
        self.conv = arena.views.get("conv")
        self.kv = arena.views.get("kv")
        self.mtp_kv = arena.views.get("mtp.kv")
        self.observations = arena.views.get("meta.observations")
        # The CPU backend runs each linear layer's mixer in one call, over this arena's state.
        cfg, hk, dk = self.cfg, self.cfg.linear_num_key_heads, self.cfg.linear_key_head_dim
        for b in self.blocks:
            b.delta = None
            if b.kind == LINEAR and self.cpu_kernels:
                b.delta = DeltaStep(self.conv[b.slot], b.conv, b.neg_a, b.dt_bias, self.recurrent[b.slot], b.norm_a,
                                    key_heads=hk, q_scale=dk ** -1.0, k_scale=dk ** -0.5,
                                    qk_eps=gated_delta.L2_EPS / dk, norm_eps=cfg.rms_norm_eps)

    # ---- mixers ------------------------------------------------------------------------------
    def _linear_mixer(self, x: torch.Tensor, b: _Block) -> torch.Tensor:
        rows = b.in_proj(x)
        return b.out_proj(b.delta(rows) if b.delta is not None else self.delta_rule(rows, b))

    def delta_rule(self, rows: torch.Tensor, b: _Block) -> torch.Tensor:
        """A linear layer between its projections, the torch reference path: the causal conv and
        its state, the gates, the gated delta rule over the layer's recurrent state, the gated
        output norm. ``rows`` [n, conv | value | 2 heads] from ``in_proj``; returns [n, value]."""
        cfg, n = self.cfg, rows.shape[0]
        c, vd, hv, hk = cfg.conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads, cfg.linear_num_key_heads
        mixed, z, beta_in, a_in = rows.split([c, vd, hv, hv], dim=-1)

        conv_state = self.conv[b.slot]                       # [K-1, C], time-major
        window = torch.cat([conv_state, mixed], dim=0)       # [K-1+n, C]
        conv_state.copy_(window[window.shape[0] - conv_state.shape[0]:])   # not [-0:] when K = 1
        # Depthwise causal conv as K shifted multiply-adds over contiguous rows.
        if n == 1:   # the window is exactly the taps
            mixed = (window * b.conv).sum(0, keepdim=True)
        else:
            mixed = window[:n] * b.conv[0]
            for tap in range(1, b.conv.shape[0]):
                mixed.addcmul_(window[tap:tap + n], b.conv[tap])
        mixed = F.silu(mixed, inplace=True)

        kd, dk = cfg.linear_key_dim, cfg.linear_key_head_dim
        # L2 normalisation is an RMSNorm with eps / dk and a factor dk^-1/2; the queries'
        # own dk^-1/2 joins that factor in the norm's per-head scale.
        qk = rms_norm(mixed[:, :2 * kd].reshape(n, 2 * hk, dk).float(), self.qk_scale, gated_delta.L2_EPS / dk)
        q, k = qk[:, :hk], qk[:, hk:]
        v = mixed[:, 2 * kd:].reshape(n, hv, -1).float()
        beta = beta_in.float().sigmoid()
        g = b.neg_a * F.softplus(a_in.float() + b.dt_bias)
        rule = gated_delta.recurrent_step if n == 1 else gated_delta.chunked
        o = rule(q, k, v, g, beta, self.recurrent[b.slot]).to(rows.dtype)
        o = gated_rms_norm(o, z.reshape(n, hv, -1), b.norm_a, cfg.rms_norm_eps)
        return o.reshape(n, vd)

    def _full_mixer(self, x: torch.Tensor, b: _Block, kv: torch.Tensor, positions: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor] | None, span: Span) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qk, gate, v = b.in_proj(x).split([(hq + hkv) * d, hq * d, hkv * d], dim=-1)
        qk = apply_rope(rms_norm(qk.view(n, hq + hkv, d), b.norm_a, cfg.rms_norm_eps), *rope)
        out = write_and_attend(qk[:, :hq], qk[:, hq:], v.view(n, hkv, d), kv[:, 0], kv[:, 1], positions, span)
        return b.out_proj(out * torch.sigmoid(gate))

    def _block_forward(self, x: torch.Tensor, b: _Block, kv: torch.Tensor | None, positions: torch.Tensor,
                       rope: tuple[torch.Tensor, torch.Tensor] | None, span: Span, decode: bool) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        h = rms_norm(x, b.ln_in, eps)
        if b.kind == FULL:
            h = self._full_mixer(h, b, kv, positions, rope, span)
        else:
            h = self._linear_mixer(h, b)
        x = x + h
        return x + b.mlp(rms_norm(x, b.ln_post, eps), fixed=decode and self.fixed_shapes)

    # ---- one committed boundary ----------------------------------------------------------------
    def advance(self, embeds: torch.Tensor, positions: torch.Tensor, span: Span, decode: bool) -> torch.Tensor:
        """Run n input embeddings [n, H] at ``positions`` through the backbone and the MTP
        layer, then move the boundary: last hidden state and position counter. Returns the
        rows' final hidden states [n, H]."""
        x = embeds
        rope = (self.cos.index_select(0, positions), self.sin.index_select(0, positions))
        for b in self.blocks:
            kv = self.kv[:, b.slot] if b.kind == FULL else None
            x = self._block_forward(x, b, kv, positions, rope, span, decode)
        hidden = rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)
        if self.mtp is not None:
            prev = torch.cat([self.last_hidden[None], hidden[:-1]]) if not decode else self.last_hidden[None]
            self._write_mtp_kv(embeds, prev, positions, rope)
        self.last_hidden.copy_(hidden[-1])
        self.position.add_(embeds.shape[0])
        return hidden

    def _write_mtp_kv(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """MTP K and V rows at ``positions``: the MTP layer pairs token t's embedding with
        the hidden state of token t-1, exactly as its full forward would. Returns the MTP
        layer's input rows (its residual stream, before the input norm), which a draft goes on with."""
        cfg, n, eps = self.cfg, embeds.shape[0], self.cfg.rms_norm_eps
        m = torch.cat([rms_norm(embeds, self.mtp_norm_embed, eps), rms_norm(prev_hidden, self.mtp_norm_hidden, eps)],
                      -1)
        x = self.mtp_fc(m)
        h = rms_norm(x, self.mtp.ln_in, eps)
        k, v = self.mtp_kv_proj(h).view(n, 2, cfg.num_key_value_heads, cfg.head_dim).unbind(1)
        k = apply_rope(rms_norm(k, self.mtp_k_norm, eps), *rope)
        self.mtp_kv[:, 0].index_copy_(0, positions, k)
        self.mtp_kv[:, 1].index_copy_(0, positions, v)
        return x

    # ---- speculative decoding ----------------------------------------------------------------
    def draft(self, token: torch.Tensor, position: int, count: int,
              vocab: torch.Tensor | None = None, head: torch.Tensor | None = None) -> torch.Tensor:
        """``count`` draft tokens [count] that follow ``token`` [1], the main model's choice for
        the row at ``position`` (the position counter), by the MTP layer chained on itself.

        Step i pairs its input token with the hidden state before it (the main model's last
        hidden state for i = 0, then the MTP layer's own output) and writes MTP KV row
        position + i. Row ``position`` is the committed one (see ``__init__``); a verify
        rewrites the later ones from the main model's hidden states. ``vocab`` [V'] and ``head``
        [H, V'] (its lm_head columns): draft over that subset of the vocabulary only."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        hq, d = cfg.num_attention_heads, cfg.head_dim
        b = self.mtp
        prev = self.last_hidden[None]
        out = torch.empty(count, dtype=torch.int64, device=self.device)
        for i in range(count):
            at = position + i
            positions = self.rows[at:at + 1]
            rope = (self.cos[at:at + 1], self.sin[at:at + 1])
            x = self._write_mtp_kv(F.embedding(token, self.embed), prev, positions, rope)
            q, gate = b.in_proj(rms_norm(x, b.ln_in, eps)).split([hq * d, hq * d], dim=-1)
            q = apply_rope(rms_norm(q.view(1, hq, d), self.mtp_q_norm, eps), *rope)
            keys, values = self.mtp_kv[:at + 1, 0], self.mtp_kv[:at + 1, 1]
            attended = attend_one(q, keys, values, None, d ** -0.5)
            x = x + b.out_proj(attended * torch.sigmoid(gate))
            x = x + b.mlp(rms_norm(x, b.ln_post, eps), fixed=self.fixed_shapes)
            prev = rms_norm(x, self.mtp_final_norm, eps)
            if head is None:
                token = self.lm_head(prev).argmax(-1)
            else:
                token = vocab.index_select(0, (prev @ head).argmax(-1))
            out[i] = token[0]
        return out

    def verify(self, tokens: torch.Tensor, position: int, fixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` [n] at rows position .. position + n - 1 (the position counter on) through
        the main model and the MTP layer's KV in one pass over the weights; return the logits
        [n, vocab] that follow each row, and the fixed-size state after each row [n, fixed_bytes]
        (``verify_states``, valid until the next verify), so that a caller that accepts fewer
        rows can step back. The arena ends as after all n rows. Each row is computed exactly as a decode
        step computes it alone: products through ``Projection`` (batch-invariant on the row
        kernel), and per row the attention over its own span (``fixed``: the masked span of
        ``decode_span``) and the linear mixer. Rows are indexed by the device position counter
        (``position`` only sizes eager spans), so a CUDA graph can capture it."""
        n = tokens.shape[0]
        rows = self.position + self.rows[:n]
        self.tokens.index_copy_(0, rows, tokens)
        self.seeds.index_copy_(0, rows, self.rng_seed.expand(n))
        if self.observations is not None:
            self.observations.index_fill_(0, rows, 0.0)
        embeds = F.embedding(tokens, self.embed)
        x = embeds
        rope = (self.cos.index_select(0, rows), self.sin.index_select(0, rows))
        spans = [Span.fixed(self.rows, self.position + i) if fixed else Span.decode(position + i) for i in range(n)]
        eps = self.cfg.rms_norm_eps
        for b in self.blocks:
            h = rms_norm(x, b.ln_in, eps)
            if b.kind == FULL:
                h = self._full_mixer_rows(h, b, rows, rope, spans)
            else:
                h = self._linear_mixer_rows(h, b)
            x = x + h
            x = x + b.mlp(rms_norm(x, b.ln_post, eps), fixed=self.fixed_shapes)
        hidden = rms_norm(x, self.final_norm, eps)
        if self.mtp is not None:
            self._write_mtp_kv(embeds, torch.cat([self.last_hidden[None], hidden[:-1]]), rows, rope)
        for i, image in enumerate(self._row_views[:n]):
            image["meta.last_hidden"].copy_(hidden[i])
            image["meta.position"].copy_(rows[i:i + 1] + 1)
            image["meta.rng"].copy_(self.rng_seed)
        self.last_hidden.copy_(hidden[-1])
        self.position.add_(n)
        return self.lm_head(hidden), self.verify_states[:n]

    def _full_mixer_rows(self, x: torch.Tensor, b: _Block, rows: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor], spans: list[Span]) -> torch.Tensor:
        """``_full_mixer`` for consecutive rows, each attending over its own span as decode does."""
        cfg, n = self.cfg, x.shape[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qk, gate, v = b.in_proj(x).split([(hq + hkv) * d, hq * d, hkv * d], dim=-1)
        qk = apply_rope(rms_norm(qk.view(n, hq + hkv, d), b.norm_a, cfg.rms_norm_eps), *rope)
        v = v.view(n, hkv, d)
        kv = self.kv[:, b.slot]
        out = torch.cat([write_and_attend(qk[i:i + 1, :hq], qk[i:i + 1, hq:], v[i:i + 1], kv[:, 0], kv[:, 1],
                                          rows[i:i + 1], spans[i]) for i in range(n)])
        return b.out_proj(out * torch.sigmoid(gate))

    def _linear_mixer_rows(self, x: torch.Tensor, b: _Block) -> torch.Tensor:
        """``_linear_mixer`` for consecutive rows, one decode-sized mixer step each, keeping the
        conv and recurrent state after each row in that row's ``verify_states``."""
        rows = b.in_proj(x)
        out = []
        for i in range(rows.shape[0]):
            row = rows[i:i + 1]
            # A copy of the kernel's one-row output: the next call reuses its buffer.
            out.append(b.delta(row).clone() if b.delta is not None else self.delta_rule(row, b))
            self._row_views[i]["recurrent"][b.slot].copy_(self.recurrent[b.slot])
            self._row_views[i]["conv"][b.slot].copy_(self.conv[b.slot])
        return b.out_proj(torch.cat(out))

    def logits(self) -> torch.Tensor:
        """Next-token logits [1, vocab], from the last hidden state alone."""
        return self.lm_head(self.last_hidden[None])

    def prefill(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Commit the rows of ``ids`` [n] from row ``start``; returns their final hidden states [n, H]."""
        positions = torch.arange(start, start + ids.shape[0], device=self.device)
        self.tokens[start:start + ids.shape[0]].copy_(ids)
        self.seeds[start:start + ids.shape[0]].copy_(self.rng_seed.expand(ids.shape[0]))
        if self.observations is not None:   # a token row holds no observation (see policy_step)
            self.observations[start:start + ids.shape[0]].zero_()
        return self.advance(F.embedding(ids, self.embed), positions, Span.prefill(start, ids.shape[0], self.device),
                            decode=False)

    def use_sampling(self, how: sampling.Sampling) -> None:
        """Write ``how``'s values where the sampled steps (and their graphs) read them."""
        self.temperature.fill_(how.temperature)
        self.cut[0].fill_(how.top_k)
        self.cut[1].fill_(how.top_p)

    def token_step(self, span: Span, sampled: bool = False, cut: bool = False) -> None:
        """Decode of one token, greedy or drawn at ``self.temperature`` (within ``self.cut``
        when ``cut``) with the arena's RNG state, reading and writing only arena state
        (graph-capturable); the choice's margin goes to ``self.margin``, in logit units (a
        sampled score's gap times the temperature)."""
        logits = self.logits()
        if sampled:
            scores = sampling.scores(logits, self.temperature, self.rng_seed, self.position, self.vocab_index,
                                     self.cut if cut else None)
            token = scores.argmax(-1, keepdim=True)
            self.margin.copy_(sampling.margin(scores) * self.temperature)
        else:
            token = logits.argmax(-1)
            self.margin.copy_(sampling.margin(logits[0]))
        self.commit_token(token, span)

    def commit_token(self, token: torch.Tensor, span: Span) -> None:
        """Append the token [1] at the position counter: what a decode step does once it has chosen
        one, and how a replay re-commits a logged one (it need not draw it again)."""
        self.tokens.index_copy_(0, self.position, token)
        self.seeds.index_copy_(0, self.position, self.rng_seed)
        if self.observations is not None:
            self.observations.index_fill_(0, self.position, 0.0)
        self.advance(F.embedding(token, self.embed), self.position, span, decode=True)

    def policy_step(self, observation: torch.Tensor, action_out: torch.Tensor, span: Span) -> None:
        """One observation [obs_dim] in, one action written to ``action_out`` (graph-capturable).

        Every committed row is written whole, token and observation alike: a row past a
        rollback or restore point may still hold what an abandoned branch put there."""
        self.tokens.index_fill_(0, self.position, -1)
        self.seeds.index_copy_(0, self.position, self.rng_seed)
        self.observations.index_copy_(0, self.position, observation[None])
        embed = torch.addmm(self.obs_bias, observation[None].to(self.dtype), self.obs_proj)
        self.advance(embed, self.position, span, decode=True)
        action_out.copy_(torch.addmm(self.action_bias, self.last_hidden[None], self.action_head)[0])

    def decode_span(self, position: int, fixed: bool) -> Span:
        return Span.fixed(self.rows, self.position) if fixed else Span.decode(position)

    def projections(self) -> list[Projection]:
        """Every weight product a boundary computes, routed experts aside: each decode step streams
        all of them once (and, in an MoE model, its k routed experts per layer)."""
        out = [p for b in self.blocks for p in (b.in_proj, b.out_proj, *b.mlp.projections())]
        if self.mtp is not None:
            out += [self.mtp_fc, self.mtp_kv_proj]
        return out + [self.lm_head]

    def draft_projections(self) -> list[Projection]:
        """The MTP layer's products that only a draft computes (beside ``projections``' MTP ones)."""
        b = self.mtp
        return [] if b is None else [b.in_proj, b.out_proj, *b.mlp.projections()]

    def expert_projections(self) -> list[Projection]:
        """Every routed expert's products (MTP layer's too); a row runs only the k it is routed to."""
        blocks = self.blocks + ([self.mtp] if self.mtp is not None else [])
        return [p for b in blocks for p in b.mlp.expert_projections()]

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (the embedding table: one row only; of the
        experts, the k routed per layer)."""
        routed = sum(b.mlp.routed_bytes() for b in self.blocks)
        tensors = [p.w for p in self.projections()] + [self.final_norm]
        for b in self.blocks:
            tensors += [t for t in (b.ln_in, b.ln_post, b.norm_a, b.conv) if t is not None]
        if self.mtp is not None:
            tensors += [self.mtp_norm_embed, self.mtp_norm_hidden, self.mtp.ln_in, self.mtp_k_norm]
        embed_row = self.embed[0].numel() * self.embed.element_size()
        return routed + sum(t.numel() * t.element_size() for t in tensors) + embed_row

"""The MTP layer as a trainable torch module, over whole sequences at once (teacher forcing).

Row t pairs token t's embedding with the main model's final hidden state of row t - 1 (zeros
before row 0, as the empty state has it), runs one gated full-attention decoder layer over the
MTP rows 0..t, and its final norm and the main model's lm_head give the logits for token t + 1.
That is what ``Qwen35.draft`` computes one row at a time; the parameters carry the checkpoint's
names (``mtp.*``), so ``state()`` is a head file's tensors. The embedding and lm_head are the
main model's, frozen.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgument
from ..runtime.config import ModelConfig
from ..runtime.layers import apply_rope, rope_tables

_ATTN = "mtp.layers.0.self_attn."
_MLP = "mtp.layers.0.mlp."


def _norm(x: torch.Tensor, offset: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm with a weight stored as its offset from one."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + offset)


class MtpLayer(nn.Module):
    """Trainable ``mtp.*`` parameters, keyed by their checkpoint names (dots as '/')."""

    def __init__(self, cfg: ModelConfig, start: dict[str, torch.Tensor], embed: torch.Tensor,
                 lm_head: torch.Tensor, max_len: int) -> None:
        """``start``: the initial ``mtp.*`` tensors (a checkpoint's, or seeded ones); ``embed``
        [V, H] and ``lm_head`` [V, H] the main model's; ``max_len``: the longest sequence."""
        if cfg.moe:   # its MLP below is the dense one; an MoE model's MTP layer is an MoE block
            raise InvalidArgument("distilling the MTP layer of a mixture-of-experts model is not supported: "
                                  "use the checkpoint's own mtp.* weights")
        super().__init__()
        self.cfg = cfg
        self.params = nn.ParameterDict({n.replace(".", "/"): nn.Parameter(t.detach().float().clone())
                                        for n, t in start.items()})
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float(), persistent=False)
        cos, sin = rope_tables(max_len, cfg.rotary_dim, cfg.rope_theta, torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "/")]

    def state(self) -> dict[str, torch.Tensor]:
        """The parameters under their checkpoint names, detached."""
        return {n.replace("/", "."): p.detach().clone() for n, p in self.params.items()}

    def forward(self, tokens: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """``tokens`` [B, T] and the main model's hidden state before each row [B, T, H];
        returns the MTP layer's final hidden states [B, T, H] (logits: ``@ lm_head.T``)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        p = self._p
        b, t = tokens.shape
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        m = torch.cat([_norm(self.embed[tokens], p("mtp.pre_fc_norm_embedding.weight"), eps),
                       _norm(prev_hidden, p("mtp.pre_fc_norm_hidden.weight"), eps)], -1)
        x = m @ p("mtp.fc.weight").t()
        h = _norm(x, p("mtp.layers.0.input_layernorm.weight"), eps)
        q_and_gate = (h @ p(f"{_ATTN}q_proj.weight").t()).view(b, t, hq, 2, d)
        q, gate = q_and_gate[..., 0, :], q_and_gate[..., 1, :].reshape(b, t, hq * d)
        k = (h @ p(f"{_ATTN}k_proj.weight").t()).view(b, t, hkv, d)
        v = (h @ p(f"{_ATTN}v_proj.weight").t()).view(b, t, hkv, d)
        cos, sin = self.cos[:t], self.sin[:t]
        q = apply_rope(_norm(q, p(f"{_ATTN}q_norm.weight"), eps).reshape(b * t, hq, d),
                       cos.repeat(b, 1), sin.repeat(b, 1)).view(b, t, hq, d)
        k = apply_rope(_norm(k, p(f"{_ATTN}k_norm.weight"), eps).reshape(b * t, hkv, d),
                       cos.repeat(b, 1), sin.repeat(b, 1)).view(b, t, hkv, d)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True)
        attended = attended.transpose(1, 2).reshape(b, t, hq * d)
        x = x + (attended * torch.sigmoid(gate)) @ p(f"{_ATTN}o_proj.weight").t()
        y = _norm(x, p("mtp.layers.0.post_attention_layernorm.weight"), eps)
        y = F.silu(y @ p(f"{_MLP}gate_proj.weight").t()) * (y @ p(f"{_MLP}up_proj.weight").t())
        x = x + y @ p(f"{_MLP}down_proj.weight").t()
        return _norm(x, p("mtp.norm.weight"), eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.t()

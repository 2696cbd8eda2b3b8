"""Decoder-style text models as embedders, one builder with per-family switches: Mistral, Llama and
Qwen2 (e5-mistral, Linq-Embed-Mistral, gte-Qwen2, jina-code: causal attention, last-token
pooling), and Gemma3's text model (EmbeddingGemma: bidirectional attention, mean pooling, its
Dense stack). Spelled out from safetensors weights as transformers computes them:

* token embeddings (Gemma: times sqrt(hidden), ``Gemma3TextScaledWordEmbedding``);
* pre-norm blocks with RMSNorm (Gemma: ``x * (1 + weight)``, and a "sandwich": the attention and
  MLP outputs are normed again before their residual adds);
* grouped-query attention with the default RoPE (per layer type for Gemma: its full and sliding
  layers have their own base; ``linear`` and ``llama3`` scaling), optional query/key RMSNorm per
  head (Gemma), projection biases where the checkpoint has them (Qwen2's q/k/v, Llama's
  ``attention_bias``), the score scale ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar``);
* masks: causal, or bidirectional (Gemma's ``use_bidirectional_attention``, a Qwen2 folder's
  ``is_causal: false``); a sliding window of ``sliding_window`` keys where the layer type says so
  (causal: ``q - k < window``; bidirectional: ``|q - k| < window``, transformers' overlay);
* a gated MLP (SiLU; Gemma: tanh GELU), then the final RMSNorm and the embedding head
  (encoder.py ``finish_head``).

Qwen3 (qwen3.py: its embedders, classifier and yes/no reranker) is built here too (``QWEN3``:
query/key RMSNorm); a classifier head on the last state comes from heads.py.

The language-model head (``lm_head``) is not part of an embedding and is left out. Positions are
each token's index in the padded row (what transformers uses without position_ids): rotary
attention depends on q - k only, so left and right padding give the same vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from batchgate.gateway.models.encoder import Head, _Graph, finish_head, key_padding_bias
from batchgate.gateway.models.heads import classify
from batchgate.gateway.models.onnx_graph import GraphBuilder, attend
from batchgate.gateway.models.rotary import blocked_bias, linear, positions, rms_norm

PREFIXES = ("", "model.")
WORD = "embed_tokens.weight"
FULL, SLIDING = "full_attention", "sliding_attention"
ROPE_TYPES = ("default", "linear", "llama3")
# The instruction e5-mistral, Linq-Embed-Mistral and gte-Qwen2 give queries on their cards
# ("Instruct: {task}\nQuery: {query}"); documents get none. Recorded as prompt "query" when the
# folder's config_sentence_transformers.json names no prompts of its own.
WEB_SEARCH_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
}


@dataclass(frozen=True)
class DecoderConfig:
    family: str  # model_type
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_seq_length: int
    rms_eps: float
    layer_types: tuple[str, ...]  # per layer: FULL or SLIDING
    # per layer type: (rope_type, theta, factor, low_freq_factor, high_freq_factor, original max positions)
    rope: tuple[tuple[str, tuple[str, float, float, float, float, int]], ...]
    window: int | None  # keys a sliding layer sees: distance < window
    causal: bool
    gemma: bool  # (1 + w) RMSNorm, scaled embeddings, sandwich norms, tanh GELU
    qk_norm: bool
    score_scale: float

    def inv_freq(self, layer_type: str) -> np.ndarray:
        kind, theta, factor, low, high, original = dict(self.rope)[layer_type]
        dim = self.head_dim
        inv = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(
            np.float32
        )
        if kind == "linear":
            return (inv / np.float32(factor)).astype(np.float32)
        if kind == "llama3":  # transformers' _compute_llama3_parameters, in float32 as it computes
            low_wavelen, high_wavelen = original / low, original / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (original / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv


class DecoderFamily:
    """One model_type's switches, with the module interface hf_model.py reads from a family
    (STEM, ARCHS, PREFIXES, WORD, DEFAULT_POOLING, DEFAULT_PROMPTS, check, position_limit,
    encoder_config, build_model)."""

    PREFIXES = PREFIXES
    WORD = WORD

    def __init__(self, model_type: str, stem: str, archs: tuple[str, ...], *, pooling: str,
                 prompts: dict[str, str], gemma: bool = False, qk_norm: bool = False) -> None:  # fmt: skip
        self.model_type, self.STEM, self.ARCHS = model_type, stem, archs
        self.DEFAULT_POOLING, self.DEFAULT_PROMPTS, self.gemma = pooling, prompts, gemma
        self.qk_norm = qk_norm or gemma

    def check(self, config: dict) -> str | None:
        """What in ``config`` the graph would not compute as transformers does, or None."""
        act = config.get(
            "hidden_activation" if self.gemma else "hidden_act", "gelu_pytorch_tanh" if self.gemma else "silu"
        )
        want = ("gelu_pytorch_tanh", "gelu_tanh") if self.gemma else ("silu",)
        if act not in want:
            key = "hidden_activation" if self.gemma else "hidden_act"
            return f"{key} '{act}' is not supported; supported: {' or '.join(repr(w) for w in want)}"
        if self.gemma and config.get("attn_logit_softcapping") is not None:
            return "attn_logit_softcapping is not supported; supported: none (as Gemma3 ships)"
        for layer_type, rope in _rope_parameters(config, self.gemma).items():
            if rope.get("rope_type", "default") not in ROPE_TYPES:
                return (f"rope_parameters{'.' + layer_type if self.gemma else ''}.rope_type "
                        f"'{rope.get('rope_type')}' is not supported; supported: {', '.join(ROPE_TYPES)}")  # fmt: skip
        return None

    def position_limit(self, config: dict) -> int:
        return int(config.get("max_position_embeddings", 32768))

    def encoder_config(self, config: dict, max_seq_length: int) -> DecoderConfig:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        types = config.get("layer_types")
        window = config.get("sliding_window")
        if self.gemma:
            causal = not config.get("use_bidirectional_attention", False)
            if not causal and window is not None:
                # Gemma3TextConfig reads a bidirectional model's saved window w as w // 2 + 1
                # keys each way, exclusive (EmbeddingGemma's 512: |q - k| < 257).
                window = int(window) // 2 + 1
            if not types:  # transformers 4's Gemma3 configs: every sliding_window_pattern-th layer is full
                pattern = int(config.get("sliding_window_pattern", 6))
                types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
        else:
            # gte-Qwen2 says is_causal false: its own modeling code attends both ways.
            causal = bool(config.get("is_causal", True))
            if self.model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
                window = None  # Qwen2's sliding_window applies only with use_sliding_window
            if not types:
                if self.model_type in ("qwen2", "qwen3") and window is not None:
                    first = int(config.get("max_window_layers", 28))
                    types = [SLIDING if i >= first else FULL for i in range(layers)]
                else:
                    types = [SLIDING if window is not None else FULL] * layers
        types = tuple(SLIDING if t == SLIDING and window is not None else FULL for t in types)
        rope = {}
        for layer_type, params in _rope_parameters(config, self.gemma).items():
            rope[layer_type] = (
                params.get("rope_type", "default"),
                float(params.get("rope_theta", 10_000.0)),
                float(params.get("factor", 1.0)),
                float(params.get("low_freq_factor", 1.0)),
                float(params.get("high_freq_factor", 4.0)),
                int(params.get("original_max_position_embeddings", 8192)),
            )
        if not self.gemma:
            rope = {FULL: rope[FULL], SLIDING: rope[FULL]}
        scalar = config.get("query_pre_attn_scalar") if self.gemma else None
        return DecoderConfig(
            family=self.model_type,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate=int(config["intermediate_size"]),
            max_seq_length=max_seq_length,
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            layer_types=types,
            rope=tuple(sorted(rope.items())),
            window=int(window) if window is not None and SLIDING in types else None,
            causal=causal,
            gemma=self.gemma,
            qk_norm=self.qk_norm,
            score_scale=float(scalar if scalar is not None else head_dim) ** -0.5,
        )

    def build_model(self, weights: dict[str, np.ndarray], cfg: DecoderConfig, head: Head, *, name: str,
                    producer: str) -> onnx.ModelProto:  # fmt: skip
        return build_model(weights, cfg, head, name=name, producer=producer)


def _rope_parameters(config: dict, per_layer_type: bool) -> dict[str, dict]:
    """{layer type: rope parameters}, from transformers 5's ``rope_parameters`` or the released
    checkpoints' ``rope_theta`` / ``rope_scaling`` (Gemma3: ``rope_local_base_freq`` for its
    sliding layers)."""
    saved = config.get("rope_parameters") or {}
    if per_layer_type:
        if FULL in saved or SLIDING in saved:
            return {t: dict(saved.get(t) or {}) for t in (FULL, SLIDING)}
        full = dict(config.get("rope_scaling") or {})
        full.setdefault("rope_type", full.pop("type", "default"))
        full["rope_theta"] = config.get("rope_theta", 1_000_000.0)
        return {
            FULL: full,
            SLIDING: {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)},
        }
    if saved:
        return {FULL: dict(saved)}
    scaling = dict(config.get("rope_scaling") or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = config.get("rope_theta", 10_000.0)
    return {FULL: scaling}


# Qwen3's graph (per-head query/key RMSNorm); qwen3.py holds its architectures and card defaults.
QWEN3 = DecoderFamily(
    "qwen3", "Qwen3", ("Model", "ForCausalLM"), pooling="lasttoken", prompts={}, qk_norm=True
)

FAMILIES = {
    "mistral": DecoderFamily("mistral", "Mistral", ("Model", "ForCausalLM"), pooling="lasttoken",
                             prompts=WEB_SEARCH_PROMPTS),
    "llama": DecoderFamily("llama", "Llama", ("Model", "ForCausalLM"), pooling="lasttoken", prompts=WEB_SEARCH_PROMPTS),
    "qwen2": DecoderFamily("qwen2", "Qwen2", ("Model", "ForCausalLM"), pooling="lasttoken", prompts=WEB_SEARCH_PROMPTS),
    # EmbeddingGemma's folder carries its own prompts (config_sentence_transformers.json).
    "gemma3_text": DecoderFamily("gemma3_text", "Gemma3", ("TextModel", "ForCausalLM"), pooling="mean", prompts={},
                                 gemma=True),
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# the graph


def _norm(g: GraphBuilder, name: str, x: str, weight: np.ndarray, cfg: DecoderConfig) -> str:
    # Gemma3RMSNorm scales by (1 + weight), computed in float32 as transformers does.
    w = (np.float32(1.0) + weight.astype(np.float32)) if cfg.gemma else weight
    return rms_norm(g, name, x, w, cfg.rms_eps)


def _rope(g: GraphBuilder, name: str, pos: str, inv_freq: np.ndarray) -> tuple[str, str]:
    """(cos, sin) [batch, seq, 1, head_dim]: the angles pos * inv_freq, repeated for both halves."""
    both = np.concatenate([inv_freq, inv_freq]).astype(np.float32)
    pos_3d = g.op("Unsqueeze", [pos, g.const(f"{name}.axes", np.array([2, 3], np.int64))], f"{name}.pos")
    angles = g.op("Mul", [pos_3d, g.const(f"{name}.inv_freq", both)], f"{name}.angles")
    return g.op("Cos", [angles], f"{name}.cos"), g.op("Sin", [angles], f"{name}.sin")


def _rotate(g: GraphBuilder, name: str, x: str, cos: str, sin: str) -> str:
    """x * cos + rotate_half(x) * sin on [batch, seq, heads, head_dim]."""
    x1, x2 = g.ops("Split", [x, "rot_halves"], [f"{name}.x1", f"{name}.x2"], axis=-1)
    rotated = g.op("Concat", [g.op("Neg", [x2], f"{name}.neg_x2"), x1], f"{name}.rotated", axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], f"{name}.xcos"), g.op("Mul", [rotated, sin], f"{name}.xsin")],
                f"{name}.roped")  # fmt: skip


def _mask_bias(
    g: GraphBuilder, name: str, pos: str, key_bias: str, *, causal: bool, window: int | None
) -> str:
    """[batch, 1, seq, seq] (or the key padding alone): MASK_PENALTY where query q may not see key
    k — a later key when ``causal``; one ``window`` or more away (causal: before it) when sliding."""
    if not causal and window is None:
        return key_bias
    q = g.op("Unsqueeze", [pos, g.const(f"{name}.q_axes", np.array([2], np.int64))], f"{name}.q")
    k = g.op("Unsqueeze", [pos, g.const(f"{name}.k_axes", np.array([1], np.int64))], f"{name}.k")
    dist = g.op("Sub", [k, q], f"{name}.dist")  # [batch, seq, seq]: k - q
    blocked = None
    if causal:
        blocked = g.op(
            "Greater", [dist, g.const(f"{name}.zero", np.array(0.0, np.float32))], f"{name}.future"
        )
    if window is not None:
        # Causal: k > q - window (the future is already blocked); both ways: |q - k| < window.
        far = g.op("Neg", [dist], f"{name}.back") if causal else g.op("Abs", [dist], f"{name}.abs")
        limit = g.const(f"{name}.window", np.array(float(window), np.float32))
        outside = g.op("GreaterOrEqual", [far, limit], f"{name}.outside")
        blocked = outside if blocked is None else g.op("Or", [blocked, outside], f"{name}.blocked")
    return blocked_bias(g, name, blocked, key_bias)


def _heads(g: GraphBuilder, name: str, x: str, count: int, cfg: DecoderConfig) -> str:
    shape = g.const(f"{name}.shape", np.array([0, 0, count, cfg.head_dim], np.int64))
    return g.op("Reshape", [x, shape], f"{name}.heads")


def _repeat_kv(g: GraphBuilder, name: str, x: str, cfg: DecoderConfig, shape: list[int]) -> str:
    """[batch, kv_heads, a, b] -> [batch, heads, a, b], each kv head serving heads / kv_heads query
    heads in a row (transformers' repeat_kv), by broadcasting instead of copying weights."""
    rep = cfg.heads // cfg.kv_heads
    if rep == 1:
        return x
    x5 = g.op("Unsqueeze", [x, "kv_axis"], f"{name}.x5")
    x5 = g.op(
        "Expand", [x5, g.const(f"{name}.rep", np.array([1, 1, rep, 1, 1], np.int64))], f"{name}.expanded"
    )
    return g.op("Reshape", [x5, g.const(f"{name}.shape", np.array(shape, np.int64))], f"{name}.repeated")


def _gelu_tanh(g: GraphBuilder, name: str, x: str) -> str:
    """torch's gelu(approximate='tanh'): x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x³)))."""
    cube = g.op("Mul", [g.op("Mul", [x, x], f"{name}.sq"), x], f"{name}.cube")
    inner = g.op("Add", [x, g.op("Mul", [cube, "gelu_c"], f"{name}.c_cube")], f"{name}.inner")
    t = g.op("Tanh", [g.op("Mul", [inner, "gelu_k"], f"{name}.scaled")], f"{name}.tanh")
    return g.op("Mul", [g.op("Mul", [x, "half_f"], f"{name}.half_x"), g.op("Add", [t, "one_f"], f"{name}.one_plus")],
                name)  # fmt: skip


def _layer(g: GraphBuilder, i: int, x: str, w: dict[str, np.ndarray], cfg: DecoderConfig,
           rope: dict[str, tuple[str, str]], bias: dict[str, str]) -> str:  # fmt: skip
    p, name = f"layers.{i}", f"layer{i}"
    a = f"{p}.self_attn"
    kind = cfg.layer_types[i]
    h = _norm(g, f"{name}.in_norm", x, w[f"{p}.input_layernorm.weight"], cfg)
    q_weight, q_bias = w[f"{a}.q_proj.weight"], w.get(f"{a}.q_proj.bias")
    scale = np.float32(cfg.score_scale)
    if not cfg.qk_norm:
        # The score scale rides on the query projection (rotary is linear: it commutes).
        q_weight = q_weight * scale
        q_bias = None if q_bias is None else q_bias * scale
    q = _heads(g, f"{name}.q", linear(g, f"{name}.q", h, q_weight, q_bias), cfg.heads, cfg)
    k = _heads(g, f"{name}.k", linear(g, f"{name}.k", h, w[f"{a}.k_proj.weight"], w.get(f"{a}.k_proj.bias")),
               cfg.kv_heads, cfg)  # fmt: skip
    v = _heads(g, f"{name}.v", linear(g, f"{name}.v", h, w[f"{a}.v_proj.weight"], w.get(f"{a}.v_proj.bias")),
               cfg.kv_heads, cfg)  # fmt: skip
    if cfg.qk_norm:
        # Each head's query and key RMSNormed before the rotary embedding; the score scale rides
        # on the query norm's weight.
        qn = w[f"{a}.q_norm.weight"].astype(np.float32)
        qn = ((np.float32(1.0) + qn) if cfg.gemma else qn) * scale
        q = rms_norm(g, f"{name}.q_norm", q, qn, cfg.rms_eps)
        k = _norm(g, f"{name}.k_norm", k, w[f"{a}.k_norm.weight"], cfg)
    cos, sin = rope[kind]
    q = g.op("Transpose", [_rotate(g, f"{name}.q", q, cos, sin)], f"{name}.q_t", perm=[0, 2, 1, 3])
    k = g.op("Transpose", [_rotate(g, f"{name}.k", k, cos, sin)], f"{name}.k_t", perm=[0, 2, 3, 1])
    v = g.op("Transpose", [v], f"{name}.v_t", perm=[0, 2, 1, 3])
    k = _repeat_kv(g, f"{name}.k_rep", k, cfg, [0, cfg.heads, cfg.head_dim, -1])  # K is [.., head_dim, seq]
    v = _repeat_kv(g, f"{name}.v_rep", v, cfg, [0, cfg.heads, -1, cfg.head_dim])
    merged = attend(g, f"{name}.attn", q, k, v, bias[kind])
    attn = linear(g, f"{name}.o", merged, w[f"{a}.o_proj.weight"], w.get(f"{a}.o_proj.bias"))
    if cfg.gemma:
        attn = _norm(g, f"{name}.post_attn_norm", attn, w[f"{p}.post_attention_layernorm.weight"], cfg)
    x = g.op("Add", [x, attn], f"{name}.resid1")
    norm = "pre_feedforward_layernorm" if cfg.gemma else "post_attention_layernorm"
    h = _norm(g, f"{name}.mlp_norm", x, w[f"{p}.{norm}.weight"], cfg)
    # down(act(gate(h)) * up(h)); gate and up in one GEMM.
    gate_up = np.concatenate([w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"]])
    gb, ub = w.get(f"{p}.mlp.gate_proj.bias"), w.get(f"{p}.mlp.up_proj.bias")
    gu = linear(g, f"{name}.gate_up", h, gate_up, None if gb is None else np.concatenate([gb, ub]))
    gate, up = g.ops("Split", [gu, "glu_split"], [f"{name}.gate", f"{name}.up"], axis=-1)
    if cfg.gemma:
        act = _gelu_tanh(g, f"{name}.gelu", gate)
    else:
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{name}.sigmoid")], f"{name}.silu")
    mlp = linear(g, f"{name}.down", g.op("Mul", [act, up], f"{name}.glu"), w[f"{p}.mlp.down_proj.weight"],
                 w.get(f"{p}.mlp.down_proj.bias"))  # fmt: skip
    if cfg.gemma:
        mlp = _norm(g, f"{name}.post_mlp_norm", mlp, w[f"{p}.post_feedforward_layernorm.weight"], cfg)
    return g.op("Add", [x, mlp], f"{name}.resid2")


def build_model(weights: dict[str, np.ndarray], cfg: DecoderConfig, head: Head, *, name: str,
                producer: str, head_weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:  # fmt: skip
    """input_ids, attention_mask (INT64 [batch, seq]) -> the head's outputs (encoder.py Head; a
    classifier head reads ``head_weights``). ``weights`` are named as in the bare model (no
    ``model.`` prefix)."""
    g = _Graph()
    g.const("one_f", np.array(1.0, np.float32))
    g.const("half_f", np.array(0.5, np.float32))
    g.const("gelu_c", np.array(0.044715, np.float32))
    g.const("gelu_k", np.array(math.sqrt(2 / math.pi), np.float32))
    g.const("merge_shape", np.array([0, 0, cfg.heads * cfg.head_dim], np.int64))
    g.const("kv_axis", np.array([2], np.int64))
    g.const("glu_split", np.array([cfg.intermediate] * 2, np.int64))
    g.const("rot_halves", np.array([cfg.head_dim // 2] * 2, np.int64))

    x = g.op("Gather", [g.const("embed_tokens", weights[WORD]), "input_ids"], "embedded", axis=0)
    if cfg.gemma:  # Gemma3TextScaledWordEmbedding: sqrt(hidden) as a float32 scalar
        x = g.op("Mul", [x, g.const("embed_scale", np.array(cfg.hidden**0.5, np.float32))], "embedded_scaled")
    mask, key_bias = key_padding_bias(g)
    pos = positions(g, mask)
    rope, bias = {}, {}
    for kind in sorted(set(cfg.layer_types)):
        rope[kind] = _rope(g, f"rope_{kind}", pos, cfg.inv_freq(kind))
        bias[kind] = _mask_bias(g, f"bias_{kind}", pos, key_bias, causal=cfg.causal,
                                window=cfg.window if kind == SLIDING else None)  # fmt: skip
    for i in range(cfg.layers):
        x = _layer(g, i, x, weights, cfg, rope, bias)
    x = _norm(g, "final_norm", x, weights["norm.weight"], cfg)
    if head.classifier:  # a seq-cls score, or Qwen3-Reranker's yes/no logits
        classify(g, x, mask, head, head_weights or {})
        x = None
    return finish_head(
        g, x, mask, head, cfg.hidden, ["input_ids", "attention_mask"], name=name, producer=producer
    )

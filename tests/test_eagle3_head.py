"""The EAGLE-3 head (spec/eagle3/head.py): vLLM's layer ids, the fc fusion, the d2t mapping, speculators'
config and weights both ways, target checks naming the field, and the forwards against the same arithmetic
written out by hand."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.spec.eagle3.head import (
    Eagle3Config,
    check_target,
    default_layer_ids,
    load_eagle3,
    random_eagle3,
    save_eagle3,
    vocab_maps,
)

CFG = Eagle3Config(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    draft_vocab_size=40,
    target_vocab_size=100,
    target_hidden_size=24,
    target_layer_ids=(1, 3, 5),
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# What speculators writes for a Llama-3.1-8B head (its field layout; legacy rope spelling)
SPECULATORS_CONFIG = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "speculators_version": "0.3.0",
    "draft_vocab_size": 32000,
    "norm_before_residual": True,
    "target_hidden_size": None,
    "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
    "transformer_layer_config": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "hidden_act": "silu",
    },
    "speculators_config": {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": 5,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "verifier": {
            "architectures": ["LlamaForCausalLM"],
            "name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
        },
    },
}


@pytest.mark.parametrize(
    "num_layers, expected", [(4, (2, 2, 1)), (30, (2, 15, 27)), (32, (2, 16, 29)), (36, (2, 18, 33))]
)
def test_default_layer_ids_are_vllms(num_layers, expected):
    assert default_layer_ids(num_layers) == expected


def test_default_layer_ids_refuse_a_shallow_model():
    with pytest.raises(ValueError, match="num_layers"):
        default_layer_ids(3)


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_fc_fuses_the_three_states_in_layer_order(norm_before_fc):
    head = random_eagle3(replace(CFG, norm_before_fc=norm_before_fc), seed=1)
    low, mid, high = (torch.randn(5, CFG.target_hidden_size) for _ in range(3))
    aux = torch.cat([low, mid, high], dim=-1)
    if norm_before_fc:
        w = head.input_norm.weight
        aux = w * aux / torch.sqrt(aux.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps)
    w = head.fc.weight  # [hidden, 3 * target_hidden]: column blocks read low, mid, high
    t = CFG.target_hidden_size
    by_hand = (
        aux[:, :t] @ w[:, :t].T + aux[:, t : 2 * t] @ w[:, t : 2 * t].T + aux[:, 2 * t :] @ w[:, 2 * t :].T
    )
    torch.testing.assert_close(head.fuse(torch.cat([low, mid, high], -1)), by_hand, rtol=1e-5, atol=1e-5)
    assert head.fuse(aux).shape == (5, CFG.hidden_size)


@pytest.mark.parametrize(
    "target_ids, draft, expected",
    [
        ([3, 7, 9], [0, 1, 2], [3, 7, 9]),
        ([9, 3, 7], [2, 0, 1], [9, 3, 7]),  # the draft vocabulary is kept sorted: draft 2 is target 9
        ([0, 1, 2], [1, 1, 0], [1, 1, 0]),  # the identity prefix: d2t all zero
    ],
)
def test_d2t_maps_draft_ids_to_target_ids(target_ids, draft, expected):
    cfg = replace(CFG, draft_vocab_size=3, target_vocab_size=12)
    head = random_eagle3(cfg)
    d2t, t2d = vocab_maps(torch.tensor(target_ids), 12)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    assert head.draft_to_target(torch.tensor(draft)).tolist() == expected
    assert sorted(t2d.nonzero().flatten().tolist()) == sorted(target_ids)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool


def test_target_logits_scatter_through_d2t_and_mask_the_rest():
    head = random_eagle3(CFG, seed=2)
    draft_logits = torch.randn(4, CFG.draft_vocab_size)
    full = head.target_logits(draft_logits)
    assert full.shape == (4, CFG.target_vocab_size)
    targets = head.draft_to_target(torch.arange(CFG.draft_vocab_size))
    torch.testing.assert_close(full[:, targets], draft_logits)
    outside = ~head.t2d
    assert torch.isneginf(full[:, outside]).all()
    assert int(outside.sum()) == CFG.target_vocab_size - CFG.draft_vocab_size
    # the argmax survives the mapping
    assert (full.argmax(-1) == head.draft_to_target(draft_logits.argmax(-1))).all()


@pytest.mark.parametrize(
    "target_ids, message",
    [([1, 1, 2], "draft_ids"), ([0, 5, 12], "draft_ids"), ([-1, 2, 3], "draft_ids")],
)
def test_vocab_maps_refuse_bad_draft_vocabularies(target_ids, message):
    with pytest.raises(ValueError, match=message):
        vocab_maps(torch.tensor(target_ids), 12)


def test_config_round_trips_through_json():
    for cfg in (CFG, replace(CFG, norm_before_residual=True, target_layer_ids=None, speculative_tokens=5)):
        again = Eagle3Config.from_dict(json.loads(cfg.to_json()))
        assert again == cfg


def test_config_reads_a_speculators_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SPECULATORS_CONFIG))
    cfg = Eagle3Config.from_dir(tmp_path)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        4096,
        32,
        8,
        128,
    )
    assert (cfg.draft_vocab_size, cfg.target_vocab_size, cfg.target_hidden_size) == (32000, 128256, 4096)
    assert cfg.target_layer_ids == (2, 16, 29)
    assert cfg.norm_before_residual is True
    assert cfg.rope_theta == 500000.0 and cfg.rope_parameters["rope_type"] == "llama3"
    assert cfg.rope_parameters["factor"] == 8.0
    assert cfg.speculative_tokens == 5
    assert cfg.verifier_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert Eagle3Config.from_dict(cfg.to_dict()) == cfg


def test_config_reads_layer_ids_under_eagle_config():
    raw = json.loads(json.dumps(SPECULATORS_CONFIG))
    del raw["eagle_aux_hidden_state_layer_ids"]
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}
    assert Eagle3Config.from_dict(raw).target_layer_ids == (1, 15, 28)
    del raw["eagle_config"]
    cfg = Eagle3Config.from_dict(raw)
    assert cfg.target_layer_ids is None and cfg.layer_ids(32) == (2, 16, 29)


def _edited(path: str, value):
    raw = json.loads(json.dumps(SPECULATORS_CONFIG))
    node = raw
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return raw


@pytest.mark.parametrize(
    "path, value, field",
    [
        ("speculators_model_type", "eagle", "speculators_model_type"),
        ("speculators_config.algorithm", "mlp_speculator", "speculators_config.algorithm"),
        ("fc_norm", True, "fc_norm"),
        ("norm_output", True, "norm_output"),
        ("transformer_layer_config.model_type", "qwen3", "transformer_layer_config.model_type"),
        ("transformer_layer_config.num_hidden_layers", 2, "transformer_layer_config.num_hidden_layers"),
        ("transformer_layer_config.attention_bias", True, "transformer_layer_config.attention_bias"),
        ("eagle_aux_hidden_state_layer_ids", [2, 16], "eagle_aux_hidden_state_layer_ids"),
        ("transformer_layer_config", None, "transformer_layer_config"),
    ],
)
def test_config_errors_name_the_field(path, value, field):
    with pytest.raises(ValueError) as err:
        Eagle3Config.from_dict(_edited(path, value))
    assert str(err.value).startswith(field + ":")


@pytest.mark.parametrize(
    "shape, field, values",
    [
        (dict(num_layers=8, hidden_size=25, vocab_size=100), "target_hidden_size", ("24", "25")),
        (
            dict(num_layers=8, hidden_size=24, vocab_size=101),
            "transformer_layer_config.vocab_size",
            ("100", "101"),
        ),
        (
            dict(num_layers=5, hidden_size=24, vocab_size=100),
            "eagle_aux_hidden_state_layer_ids",
            ("[1, 3, 5]", "5"),
        ),
    ],
)
def test_check_target_names_the_mismatching_field(shape, field, values):
    check_target(CFG, num_layers=8, hidden_size=24, vocab_size=100)
    with pytest.raises(ValueError) as err:
        check_target(CFG, **shape)
    message = str(err.value)
    assert message.startswith(field + ":")
    assert all(v in message for v in values)


def test_check_target_resolves_default_layer_ids():
    cfg = replace(CFG, target_layer_ids=None)
    check_target(cfg, num_layers=4, hidden_size=24, vocab_size=100)
    with pytest.raises(ValueError, match="num_layers"):
        check_target(cfg, num_layers=3, hidden_size=24, vocab_size=100)


def _inputs(cfg: Eagle3Config, b: int = 2, t: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.target_vocab_size, (b, t), generator=g)
    hidden = torch.randn(b, t, cfg.hidden_size, generator=g)
    positions = (torch.arange(t) + torch.tensor([[0], [5]])[:b]).contiguous()  # rows need not start at 0
    return ids, hidden, positions


def test_save_and_load_round_trip(tmp_path):
    head = random_eagle3(CFG, seed=3)
    out = save_eagle3(
        head, tmp_path / "head", verifier_name="tiny-target", verifier_architectures=("LlamaForCausalLM",)
    )
    names = set(load_file(str(out / "model.safetensors")))
    assert names == {
        "embed_tokens.weight",
        "fc.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_config"]["verifier"] == {
        "name_or_path": "tiny-target",
        "architectures": ["LlamaForCausalLM"],
    }
    loaded = load_eagle3(out)
    assert loaded.cfg == replace(
        CFG, verifier_name="tiny-target", verifier_architectures=("LlamaForCausalLM",)
    )
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids, hidden, positions = _inputs(CFG)
    torch.testing.assert_close(
        loaded.forward_dense(ids, hidden, positions), head.forward_dense(ids, hidden, positions)
    )
    bf16 = load_eagle3(out, dtype=torch.bfloat16)
    assert (
        bf16.fc.weight.dtype == torch.bfloat16
        and bf16.d2t.dtype == torch.int64
        and bf16.t2d.dtype == torch.bool
    )


def test_load_takes_the_target_embedding_when_the_checkpoint_has_none(tmp_path):
    head = random_eagle3(CFG, seed=4)
    out = save_eagle3(head, tmp_path / "head", verifier_name="t", with_embed=False)
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="^embed_tokens.weight:"):
        load_eagle3(out)
    loaded = load_eagle3(out, target_embed=head.embed_tokens.weight.detach())
    assert torch.equal(loaded.embed_tokens.weight, head.embed_tokens.weight)


def test_load_reads_specforge_names_and_derives_t2d(tmp_path):
    head = random_eagle3(CFG, seed=5)
    state = {n.replace("layers.0.", "midlayer."): t for n, t in head.state_dict().items() if n != "t2d"}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(CFG.to_json())
    loaded = load_eagle3(tmp_path)
    assert torch.equal(loaded.t2d, head.t2d)
    assert torch.equal(loaded.layers[0].self_attn.q_proj.weight, head.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda s: s.pop("lm_head.weight"), "lm_head.weight"),
        (lambda s: s.update({"fc.weight": torch.zeros(32, 70)}), "fc.weight"),
        (lambda s: s.update({"mystery.weight": torch.zeros(1)}), "mystery.weight"),
        (lambda s: s.update({"d2t": torch.full((40,), 200, dtype=torch.long)}), "d2t"),
    ],
)
def test_load_errors_name_the_tensor(tmp_path, edit, field):
    state = dict(random_eagle3(CFG, seed=6).state_dict())
    edit(state)
    save_file({n: t.contiguous() for n, t in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(CFG.to_json())
    with pytest.raises(ValueError) as err:
        load_eagle3(tmp_path)
    assert str(err.value).startswith(field + ":")


def test_load_without_d2t_needs_the_full_vocabulary(tmp_path):
    state = {n: t for n, t in random_eagle3(CFG).state_dict().items() if n not in ("d2t", "t2d")}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(CFG.to_json())
    with pytest.raises(ValueError, match="^d2t:"):
        load_eagle3(tmp_path)
    full = replace(CFG, draft_vocab_size=CFG.target_vocab_size)
    head = random_eagle3(full, vocab="first")
    state = {n: t for n, t in head.state_dict().items() if n not in ("d2t", "t2d")}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(full.to_json())
    loaded = load_eagle3(tmp_path)
    assert loaded.t2d.all() and not loaded.d2t.any()


# -- the forward, written out by hand ---------------------------------------------------------------------


def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta):
    """x [T, D] at integer positions: pairs (j, j + D/2) rotated by position * theta^(-2j/D)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * freqs[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()
    a, b = x[:, : d // 2], x[:, d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _reference(head, ids, hidden, positions):
    """One batch row at a time, one head at a time, one query at a time."""
    cfg = head.cfg
    layer = head.layers[0]
    at = layer.self_attn
    logits_rows, out_rows = [], []
    for b in range(ids.shape[0]):
        e = _rms(head.embed_tokens.weight[ids[b]], layer.input_layernorm.weight, cfg.rms_norm_eps)
        hn = _rms(hidden[b], layer.hidden_norm.weight, cfg.rms_norm_eps)
        residual = hn if cfg.norm_before_residual else hidden[b]
        x = torch.cat([e, hn], dim=-1)
        q, k, v = x @ at.q_proj.weight.T, x @ at.k_proj.weight.T, x @ at.v_proj.weight.T
        t, d = ids.shape[1], cfg.head_dim
        heads = []
        for h in range(cfg.num_attention_heads):
            kv = h // (cfg.num_attention_heads // cfg.num_key_value_heads)
            qh = _rope(q[:, h * d : (h + 1) * d], positions[b], cfg.rope_theta)
            kh = _rope(k[:, kv * d : (kv + 1) * d], positions[b], cfg.rope_theta)
            vh = v[:, kv * d : (kv + 1) * d]
            rows = []
            for i in range(t):
                s = (kh[: i + 1] @ qh[i]) / math.sqrt(d)
                rows.append(torch.softmax(s, dim=0) @ vh[: i + 1])
            heads.append(torch.stack(rows))
        h1 = residual + torch.cat(heads, dim=-1) @ at.o_proj.weight.T
        m = layer.mlp
        n = _rms(h1, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        gate = n @ m.gate_proj.weight.T
        out = h1 + (gate * torch.sigmoid(gate) * (n @ m.up_proj.weight.T)) @ m.down_proj.weight.T
        out_rows.append(out)
        logits_rows.append(_rms(out, head.norm.weight, cfg.rms_norm_eps) @ head.lm_head.weight.T)
    return torch.stack(logits_rows), torch.stack(out_rows)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_dense_forward_matches_the_arithmetic_by_hand(norm_before_residual, kv_heads):
    cfg = replace(CFG, norm_before_residual=norm_before_residual, num_key_value_heads=kv_heads)
    head = random_eagle3(cfg, seed=7)
    ids, hidden, positions = _inputs(cfg)
    with torch.no_grad():
        logits, out = head.forward_dense(ids, hidden, positions)
        want_logits, want_out = _reference(head, ids, hidden, positions)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_chain_forward_equals_drafting_with_the_dense_forward(norm_before_residual):
    """Every row of forward_chain's step s is the draft a dense forward over [rows 0..i ; s drafts] makes,
    each draft fed the argmax of the one before (through d2t) and its hidden_out."""
    cfg = replace(CFG, norm_before_residual=norm_before_residual)
    head = random_eagle3(cfg, seed=8)
    ids, hidden, positions = _inputs(cfg, t=7)
    steps = 4
    with torch.no_grad():
        chain = head.forward_chain(ids, hidden, positions, steps)
        for i in range(ids.shape[1]):
            rows_ids, rows_hidden, rows_pos = ids[:, : i + 1], hidden[:, : i + 1], positions[:, : i + 1]
            for s in range(steps):
                logits, out = head.forward_dense(rows_ids, rows_hidden, rows_pos)
                torch.testing.assert_close(chain[s][:, i], logits[:, -1], rtol=1e-4, atol=1e-4)
                token = head.draft_to_target(logits[:, -1].argmax(-1))
                rows_ids = torch.cat([rows_ids, token[:, None]], dim=1)
                rows_hidden = torch.cat([rows_hidden, out[:, -1:]], dim=1)
                rows_pos = torch.cat([rows_pos, rows_pos[:, -1:] + 1], dim=1)


@pytest.mark.parametrize("first_row", [1, 4, 6])
def test_chain_forward_from_a_later_row_keeps_the_earlier_rows_as_context(first_row):
    head = random_eagle3(CFG, seed=10)
    ids, hidden, positions = _inputs(CFG, t=7)
    with torch.no_grad():
        full = head.forward_chain(ids, hidden, positions, 3)
        later = head.forward_chain(ids, hidden, positions, 3, first_row=first_row)
    for a, b in zip(full, later):
        assert b.shape[1] == 7 - first_row
        torch.testing.assert_close(b, a[:, first_row:], rtol=1e-5, atol=1e-5)


def test_rope_scaling_reaches_the_forward():
    scaled = replace(
        CFG,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    plain, llama3 = random_eagle3(CFG, seed=9), random_eagle3(scaled, seed=9)
    ids, hidden, positions = _inputs(CFG)
    with torch.no_grad():
        assert not torch.allclose(
            plain.forward_dense(ids, hidden, positions)[0], llama3.forward_dense(ids, hidden, positions)[0]
        )


def test_speculators_reads_our_config(tmp_path):
    """speculators' own config class parses what save_eagle3 writes (where speculators is installed)."""
    module = pytest.importorskip("speculators.models.eagle3")
    out = save_eagle3(random_eagle3(CFG), tmp_path / "head", verifier_name="tiny-target")
    parsed = module.Eagle3SpeculatorConfig.from_pretrained(str(out))
    assert parsed.draft_vocab_size == CFG.draft_vocab_size
    assert parsed.target_vocab_size == CFG.target_vocab_size
    assert list(parsed.eagle_aux_hidden_state_layer_ids) == list(CFG.target_layer_ids)
    assert parsed.transformer_layer_config.hidden_size == CFG.hidden_size

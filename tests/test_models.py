"""Model chunks: parity with HF transformers, partition independence, tying, init, config errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipetrain.config import GPT2Config, Llama3Config, RopeScalingConfig
from pipetrain.models import (
    GPT2Chunk,
    Llama3Chunk,
    TransformerChunk,
    build_chunk,
    llama3_ffn_hidden_dim,
    stream_seed,
)
from pipetrain.models.llama3 import rope_inv_freq

transformers = pytest.importorskip("transformers")

N_LAYER = 3
SEED = 1234


def gpt2_config(**overrides) -> GPT2Config:
    fields = dict(n_layer=N_LAYER, n_embd=64, n_head=4, vocab_size=256, block_size=64, norm_eps=1e-5)
    return GPT2Config(**{**fields, **overrides})


def llama3_config(**overrides) -> Llama3Config:
    fields = dict(n_layer=N_LAYER, n_embd=64, n_head=4, n_kv_head=2, vocab_size=256, block_size=64, multiple_of=32)
    return Llama3Config(**{**fields, **overrides})


# Small original context, so that at head dim 16 Llama-3.1 scaling leaves the highest frequency
# alone (wavelength 6.3 < 64 / 4), blends the next (32.4) and divides the rest by `factor`.
SCALING = RopeScalingConfig(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def whole(config, seed: int = SEED) -> TransformerChunk:
    return build_chunk(config, layer_range=(0, config.n_layer), has_embedding=True, has_head=True, seed=seed)


def tokens(config, *, batch: int = 2, seq_len: int = 48) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------------------------
# HF parity: the same weights give the same logits, loss and gradients as HF transformers
# --------------------------------------------------------------------------------------------


def hf_gpt2(config: GPT2Config):
    hf_config = transformers.GPT2Config(
        n_layer=config.n_layer,
        n_embd=config.n_embd,
        n_head=config.n_head,
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu_new",
        layer_norm_epsilon=config.norm_eps,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(hf_config).eval()


def gpt2_hf_name(name: str) -> str:
    """Our global parameter name -> GPT2LMHeadModel's."""
    if name.startswith("embed."):
        return "transformer." + name.removeprefix("embed.")
    if name.startswith("layers."):
        return "transformer.h." + name.removeprefix("layers.")
    if name == "head.lm_head.weight":
        return "lm_head.weight"
    return "transformer." + name.removeprefix("head.")  # head.ln_f.*


def gpt2_is_conv1d(name: str) -> bool:
    # HF GPT-2 stores these projections as Conv1D with weight [in, out], the transpose of nn.Linear.
    return name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))


def hf_llama(config: Llama3Config):
    scaling = config.rope_scaling
    rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    if scaling is not None:
        rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=llama3_ffn_hidden_dim(config.n_embd, config.ffn_dim_multiplier, config.multiple_of),
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head,
        max_position_embeddings=2 * config.block_size,
        rms_norm_eps=config.norm_eps,
        rope_parameters=rope_parameters,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_config).eval()


LLAMA_HF_NAMES = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def llama_hf_name(name: str) -> str:
    """Our global parameter name -> LlamaForCausalLM's."""
    if name == "embed.tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "head.norm.weight":
        return "model.norm.weight"
    if name == "head.output.weight":
        return "lm_head.weight"
    _, layer, rest = name.split(".", 2)
    module, param = rest.rsplit(".", 1)
    return f"model.layers.{layer}.{LLAMA_HF_NAMES[module]}.{param}"


def never(name: str) -> bool:
    return False


# family -> (our config, the HF model for it, our name -> HF name, whether HF stores the transpose)
FAMILIES = {
    "gpt2": (gpt2_config, hf_gpt2, gpt2_hf_name, gpt2_is_conv1d),
    "llama3": (llama3_config, hf_llama, llama_hf_name, never),
    "llama3-scaled": (lambda: llama3_config(rope_scaling=SCALING), hf_llama, llama_hf_name, never),
}


def load_from_hf(ours: torch.nn.Module, hf: torch.nn.Module, *, hf_name, is_conv1d) -> None:
    hf_state = hf.state_dict()
    state = {}
    for name in ours.state_dict():
        tensor = hf_state[hf_name(name)]
        state[name] = tensor.t() if is_conv1d(name) else tensor
    ours.load_state_dict(state)  # strict: every one of our tensors is set


def load_into_hf(ours: torch.nn.Module, hf: torch.nn.Module, *, hf_name, is_conv1d) -> None:
    state = {hf_name(n): t.t() if is_conv1d(n) else t for n, t in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not set(missing) & {n for n, _ in hf.named_parameters(remove_duplicate=False)}, missing


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("direction", ["hf_to_ours", "ours_to_hf"])
def test_hf_parity(family: str, direction: str) -> None:
    make_config, make_hf, hf_name, is_conv1d = FAMILIES[family]
    config = make_config()
    ours = whole(config).eval()
    hf = make_hf(config)
    load = load_from_hf if direction == "hf_to_ours" else load_into_hf
    load(ours, hf, hf_name=hf_name, is_conv1d=is_conv1d)

    idx = tokens(config)
    logits = ours(idx)
    hf_out = hf(input_ids=idx, labels=idx)
    torch.testing.assert_close(logits, hf_out.logits, atol=1e-5, rtol=1e-5)

    # Next-token loss and its gradients agree too (HF shifts the labels itself).
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
    torch.testing.assert_close(loss, hf_out.loss, atol=1e-6, rtol=1e-6)
    loss.backward()
    hf_out.loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        hf_grad = hf_params[hf_name(name)].grad
        hf_grad = hf_grad.t() if is_conv1d(name) else hf_grad
        torch.testing.assert_close(param.grad, hf_grad, atol=1e-5, rtol=1e-4, msg=name)


def test_rope_scaling_keeps_blends_and_divides_frequencies() -> None:
    head_dim = 16
    plain = rope_inv_freq(head_dim, theta=500000.0, scaling=None)
    scaled = rope_inv_freq(head_dim, theta=500000.0, scaling=SCALING)
    assert scaled[0] == plain[0]  # wavelength 6.3 < 64 / high_freq_factor: kept
    assert plain[1] / 8 < scaled[1] < plain[1]  # wavelength 32.4 in [16, 64]: blended
    torch.testing.assert_close(scaled[2:], plain[2:] / 8)  # wavelength > 64: divided by factor


def test_llama3_ffn_hidden_dim() -> None:
    assert llama3_ffn_hidden_dim(4096, 1.3, 1024) == 14336  # Llama-3-8B
    assert llama3_ffn_hidden_dim(64, None, 32) == 192  # int(170.67) = 170 -> 192


# --------------------------------------------------------------------------------------------
# partition independence
# --------------------------------------------------------------------------------------------

SPLIT = [((0, 1), True, False), ((1, 3), False, False), ((3, N_LAYER), False, True)]


@pytest.mark.parametrize("make_config", [gpt2_config, llama3_config], ids=["gpt2", "llama3"])
def test_partition_independence(make_config) -> None:
    config = make_config()
    model = whole(config)
    chunks = [build_chunk(config, layer_range=r, has_embedding=e, has_head=h, seed=SEED) for r, e, h in SPLIT]

    whole_params = dict(model.named_parameters(remove_duplicate=False))
    chunk_params = {n: p for c in chunks for n, p in c.named_parameters()}
    assert chunk_params.keys() == whole_params.keys()
    for name, param in chunk_params.items():
        assert torch.equal(param, whole_params[name]), name

    idx = tokens(config)
    h = idx
    for chunk in chunks:
        h = chunk(h)
    torch.testing.assert_close(h, model(idx), atol=1e-6, rtol=1e-6)


def test_empty_chunk_with_embedding_or_head_is_allowed() -> None:
    config = gpt2_config()
    first = build_chunk(config, layer_range=(0, 0), has_embedding=True, has_head=False, seed=SEED)
    last = build_chunk(config, layer_range=(3, 3), has_embedding=False, has_head=True, seed=SEED)
    assert len(first.layers) == 0 and len(last.layers) == 0
    idx = tokens(config)
    torch.testing.assert_close(first(idx), whole(config).embed(idx))
    assert last(torch.zeros(2, 5, config.n_embd)).shape == (2, 5, config.vocab_size)


# --------------------------------------------------------------------------------------------
# tied GPT-2 embedding / head
# --------------------------------------------------------------------------------------------


def test_gpt2_tied_weights() -> None:
    config = gpt2_config()
    assert GPT2Chunk.tied_weights == (("embed.wte.weight", "head.lm_head.weight"),)
    assert Llama3Chunk.tied_weights == ()

    model = whole(config)
    assert model.head.lm_head.weight is model.embed.wte.weight

    first = build_chunk(config, layer_range=(0, 1), has_embedding=True, has_head=False, seed=SEED)
    last = build_chunk(config, layer_range=(1, 3), has_embedding=False, has_head=True, seed=SEED)
    assert last.head.lm_head.weight is not first.embed.wte.weight
    assert torch.equal(last.head.lm_head.weight, first.embed.wte.weight)


def test_llama3_head_is_untied() -> None:
    model = whole(llama3_config())
    assert not torch.equal(model.head.output.weight, model.embed.tok_embeddings.weight)


# --------------------------------------------------------------------------------------------
# init
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_config", [gpt2_config, llama3_config], ids=["gpt2", "llama3"])
def test_init_leaves_global_rng_alone_and_depends_on_seed(make_config) -> None:
    config = make_config()
    torch.manual_seed(7)
    state = torch.random.get_rng_state()
    a = whole(config, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)

    b = whole(config, seed=1)
    c = whole(config, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and "norm" not in name and "ln_" not in name:
            assert not torch.equal(pa, pc), name


def test_init_values() -> None:
    config = gpt2_config(n_layer=8, n_embd=256, init_std=0.05)
    model = build_chunk(config, layer_range=(0, 8), has_embedding=True, has_head=True, seed=SEED)
    residual_std = 0.05 / (2 * 8) ** 0.5
    params = dict(model.named_parameters())
    assert params["embed.wte.weight"].std().item() == pytest.approx(0.05, rel=0.02)
    assert params["layers.5.attn.c_attn.weight"].std().item() == pytest.approx(0.05, rel=0.02)
    assert params["layers.5.attn.c_proj.weight"].std().item() == pytest.approx(residual_std, rel=0.02)
    assert params["layers.5.mlp.c_proj.weight"].std().item() == pytest.approx(residual_std, rel=0.02)
    assert torch.equal(params["layers.5.attn.c_attn.bias"], torch.zeros(3 * 256))
    assert torch.equal(params["layers.5.ln_1.weight"], torch.ones(256))
    assert torch.equal(params["head.ln_f.bias"], torch.zeros(256))
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())

    llama = whole(llama3_config(n_embd=256, init_std=0.05))
    lp = dict(llama.named_parameters())
    llama_residual_std = 0.05 / (2 * N_LAYER) ** 0.5
    assert lp["layers.1.attention.wo.weight"].std().item() == pytest.approx(llama_residual_std, rel=0.03)
    assert lp["layers.1.feed_forward.w2.weight"].std().item() == pytest.approx(llama_residual_std, rel=0.03)
    assert lp["layers.1.attention.wq.weight"].std().item() == pytest.approx(0.05, rel=0.03)
    assert torch.equal(lp["layers.1.ffn_norm.weight"], torch.ones(256))


def test_stream_seed_is_stable() -> None:
    assert stream_seed(1234, "layers.0.attn.c_attn.weight") == stream_seed(1234, "layers.0.attn.c_attn.weight")
    assert stream_seed(1234, "a") != stream_seed(1235, "a") != stream_seed(1234, "b")
    # Pinned: the value must never change across processes, machines or Python versions, or
    # checkpoints and multi-rank runs would disagree about initial weights.
    assert stream_seed(0, "embed") == 464014984771267609


# --------------------------------------------------------------------------------------------
# config errors
# --------------------------------------------------------------------------------------------


def test_unknown_family() -> None:
    with pytest.raises(ValueError, match=r"model\.family='mamba'.*gpt2.*llama3"):
        build_chunk(gpt2_config(family="mamba"), layer_range=(0, 3), has_embedding=True, has_head=True, seed=0)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (gpt2_config(n_embd=66), r"model\.n_embd=66.*model\.n_head=4"),
        (llama3_config(n_embd=66), r"model\.n_embd=66.*model\.n_head=4"),
        (llama3_config(n_kv_head=3), r"model\.n_head=4.*model\.n_kv_head=3"),
        (llama3_config(n_embd=24, n_head=8, n_kv_head=8), r"head dim.*odd"),
    ],
)
def test_bad_config(config, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        whole(config)


def test_bad_layer_range() -> None:
    config = llama3_config()
    with pytest.raises(ValueError, match=r"empty.*model\.n_layer=3"):
        build_chunk(config, layer_range=(1, 1), has_embedding=False, has_head=False, seed=0)
    with pytest.raises(ValueError, match=r"model\.n_layer=3"):
        build_chunk(config, layer_range=(2, 4), has_embedding=False, has_head=True, seed=0)


@pytest.mark.parametrize("make_config", [gpt2_config, llama3_config], ids=["gpt2", "llama3"])
def test_sequence_longer_than_block_size(make_config) -> None:
    config = make_config(block_size=16)
    with pytest.raises(ValueError, match=r"data\.seq_len.*model\.block_size|model\.block_size=16.*data\.seq_len"):
        whole(config)(tokens(config, seq_len=17))

"""AWQ / GPTQ on-disk layouts, checked with an unpacking written here from the documented layout only
(shared/docs/metrics-and-quant-formats.md), in numpy, independent of server.quant.formats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from server.quant.formats import (
    Int4Weights,
    awq_decode,
    awq_encode,
    dequantize,
    gptq_decode,
    gptq_encode,
    quantize_rtn,
)

# Documented: unpacking AWQ in natural column order uses shifts [0, 4, 1, 5, 2, 6, 3, 7] x 4.
AWQ_SHIFTS = np.array([0, 4, 1, 5, 2, 6, 3, 7]) * 4


def indep_unpack_awq(words: np.ndarray) -> np.ndarray:  # [R, C/8] int32 -> [R, C]
    u = words.astype(np.int64) & 0xFFFFFFFF
    cols = [(u >> AWQ_SHIFTS[c]) & 0xF for c in range(8)]  # column c of each 8
    return np.stack(cols, axis=-1).reshape(words.shape[0], -1)


def indep_unpack_natural_cols(words: np.ndarray) -> np.ndarray:  # [R, C/8] -> [R, C], nibble j = column j
    u = words.astype(np.int64) & 0xFFFFFFFF
    return np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=-1).reshape(words.shape[0], -1)


def indep_unpack_gptq_qweight(words: np.ndarray) -> np.ndarray:  # [K/8, N] -> [K, N], nibble j = row 8i+j
    u = words.astype(np.int64) & 0xFFFFFFFF
    return np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=1).reshape(-1, words.shape[1])


def indep_dequant_awq(t: dict[str, np.ndarray], prefix: str, group: int) -> np.ndarray:  # [K, N]
    q = indep_unpack_awq(t[prefix + "qweight"])
    z = indep_unpack_awq(t[prefix + "qzeros"])
    s = t[prefix + "scales"].astype(np.float32)
    g = np.arange(q.shape[0]) // group
    return (q - z[g]).astype(np.float32) * s[g]


def indep_dequant_gptq(t: dict[str, np.ndarray], prefix: str) -> np.ndarray:  # [K, N]
    q = indep_unpack_gptq_qweight(t[prefix + "qweight"])
    z = indep_unpack_natural_cols(t[prefix + "qzeros"]) + 1  # stored as zero - 1
    s = t[prefix + "scales"].astype(np.float32)
    g = t[prefix + "g_idx"].astype(np.int64)
    return (q - z[g]).astype(np.float32) * s[g]


def _random_int4(k: int, n: int, group: int, seed: int, act_order: bool) -> Int4Weights:
    gen = torch.Generator().manual_seed(seed)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return Int4Weights(
        intweight=torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32),
        zeros=torch.randint(1, 16, (k // group, n), generator=gen, dtype=torch.int32),
        scales=(torch.rand(k // group, n, generator=gen) * 0.02 + 1e-3).half(),
        g_idx=g_idx.to(torch.int32),
        group_size=group,
    )


def test_quant_awq_pack_matches_documented_layout() -> None:
    w = _random_int4(128, 48, 32, seed=1, act_order=False)
    a = awq_encode(w)
    assert a.qweight.dtype == torch.int32 and tuple(a.qweight.shape) == (128, 6)
    assert tuple(a.qzeros.shape) == (4, 6) and a.scales.dtype == torch.float16
    t = {"qweight": a.qweight.numpy(), "qzeros": a.qzeros.numpy(), "scales": a.scales.numpy()}
    np.testing.assert_array_equal(indep_unpack_awq(t["qweight"]), w.intweight.numpy())
    np.testing.assert_array_equal(indep_dequant_awq(t, "", 32), dequantize(w).numpy())
    # Nibble j of a word holds column [0, 2, 4, 6, 1, 3, 5, 7][j]: spot-check one word bit by bit.
    word = int(a.qweight[5, 2]) & 0xFFFFFFFF
    for j, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
        assert (word >> (4 * j)) & 0xF == int(w.intweight[5, 16 + col])
    back = awq_decode(a.qweight, a.qzeros, a.scales, 32)
    assert torch.equal(back.intweight, w.intweight) and torch.equal(back.zeros, w.zeros)


@pytest.mark.parametrize("act_order", [False, True])
def test_quant_gptq_pack_matches_documented_layout(act_order: bool) -> None:
    w = _random_int4(128, 48, 32, seed=2, act_order=act_order)
    g = gptq_encode(w)
    assert tuple(g.qweight.shape) == (16, 48) and tuple(g.qzeros.shape) == (4, 6)
    t = {
        "qweight": g.qweight.numpy(),
        "qzeros": g.qzeros.numpy(),
        "scales": g.scales.numpy(),
        "g_idx": g.g_idx.numpy(),
    }
    np.testing.assert_array_equal(indep_unpack_gptq_qweight(t["qweight"]), w.intweight.numpy())
    # Zeros are stored minus one.
    np.testing.assert_array_equal(indep_unpack_natural_cols(t["qzeros"]), w.zeros.numpy() - 1)
    np.testing.assert_array_equal(indep_dequant_gptq(t, ""), dequantize(w).numpy())
    back = gptq_decode(g.qweight, g.qzeros, g.scales, g.g_idx, 32)
    assert torch.equal(back.intweight, w.intweight) and torch.equal(back.zeros, w.zeros)


def test_quant_gptq_v1_wrapped_zero_reads_as_16() -> None:
    """AutoGPTQ stores a zero of 0 as -1 (nibble 15) and loaders add 1 without masking: it reads as 16."""
    w = _random_int4(64, 8, 32, seed=3, act_order=False)
    g = gptq_encode(w)
    qzeros = g.qzeros.clone()
    qzeros[0, 0] = qzeros[0, 0] | 0xF  # column 0 of group 0 now holds nibble 15
    back = gptq_decode(g.qweight, qzeros, g.scales, g.g_idx, 32)
    assert int(back.zeros[0, 0]) == 16
    with pytest.raises(ValueError):
        gptq_encode(Int4Weights(w.intweight, w.zeros * 0, w.scales, w.g_idx, 32))


def test_quant_rtn_error_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 256, generator=gen) * 0.05  # [N, K]
    q = quantize_rtn(weight, 64)
    err = (dequantize(q).t() - weight).abs()  # [N, K]
    step = q.scales.float().t().repeat_interleave(64, dim=1)  # [N, K]
    assert bool((err <= step * 0.5 + 1e-6).all())


# ------------------------------------------------------------------ checkpoints our quantizer writes


@pytest.fixture(scope="module")
def tiny_quantized(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    from server.quantize import QuantizeOptions, quantize_model

    src = tiny_model_factory(arch="qwen2", tie=False)  # Qwen2: q/k/v carry a bias, lm_head untied
    out: dict[str, Path] = {}
    for name, opts in {
        "awq": QuantizeOptions("awq", group_size=32, calib_tokens=64, awq_grid=4),
        "gptq": QuantizeOptions("gptq", group_size=32, sym=False, act_order=True, calib_tokens=64),
        "gptq-sym": QuantizeOptions("gptq", group_size=32, sym=True, calib_tokens=64),
    }.items():
        out[name] = tmp_path_factory.mktemp(f"tiny-{name}")
        quantize_model(str(src), out[name], opts)
    out["src"] = src
    return out


def _load(folder: Path, quantize: str | None = None):  # type: ignore[no-untyped-def]
    from server.models.loader import load_model

    return load_model(folder, torch.float32, torch.device("cpu"), 64, quantize)


def _layer_output(model: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.get_submodule(name)(x).float()


PROJ = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@pytest.mark.parametrize("variant", ["awq", "gptq", "gptq-sym"])
def test_quant_checkpoint_tensors_and_config(tiny_quantized: dict[str, Path], variant: str) -> None:
    folder = tiny_quantized[variant]
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(folder / "model.safetensors"))
    src_cfg = json.loads((tiny_quantized["src"] / "config.json").read_text())
    hidden, inter = src_cfg["hidden_size"], src_cfg["intermediate_size"]
    if variant == "awq":
        assert cfg == {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 32,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    else:
        assert cfg["quant_method"] == "gptq" and cfg["bits"] == 4 and cfg["group_size"] == 32
        assert cfg["sym"] is (variant == "gptq-sym") and cfg["desc_act"] is (variant == "gptq")
        assert cfg["checkpoint_format"] == "gptq"
        assert (folder / "quantize_config.json").is_file()
    p = "model.layers.1.mlp.down_proj."
    if variant == "awq":
        assert set(k for k in tensors if k.startswith(p)) == {p + "qweight", p + "qzeros", p + "scales"}
        assert tensors[p + "qweight"].shape == (inter, hidden // 8)
    else:
        assert set(k for k in tensors if k.startswith(p)) == {
            p + "qweight",
            p + "qzeros",
            p + "scales",
            p + "g_idx",
        }
        assert tensors[p + "qweight"].shape == (inter // 8, hidden)
        assert tensors[p + "g_idx"].dtype == np.int32
    assert tensors[p + "qweight"].dtype == np.int32 and tensors[p + "qzeros"].dtype == np.int32
    assert tensors[p + "scales"].dtype == np.float16 and tensors[p + "scales"].shape == (inter // 32, hidden)
    assert "model.layers.0.self_attn.q_proj.bias" in tensors  # Qwen2's q/k/v bias rides along
    assert "lm_head.weight" in tensors and "model.layers.0.self_attn.q_proj.weight" not in tensors
    if variant == "gptq-sym":
        # Symmetric GPTQ: every zero is 8, stored as 7.
        assert (indep_unpack_natural_cols(tensors[p + "qzeros"]) == 7).all()


@pytest.mark.parametrize("variant", ["awq", "gptq", "gptq-sym"])
def test_quant_checkpoint_decodes_to_what_the_layers_compute(
    tiny_quantized: dict[str, Path], variant: str
) -> None:
    """Independent dequantization of every projection == what the loaded quantized layer computes,
    and close to the full-precision source weights."""
    folder = tiny_quantized[variant]
    tensors = load_file(str(folder / "model.safetensors"))
    loaded = _load(folder)
    src = load_file(str(tiny_quantized["src"] / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    assert loaded.quantization == ("awq" if variant == "awq" else "gptq")
    for layer in range(2):
        for proj in PROJ:
            name = f"model.layers.{layer}.{proj}"
            if variant == "awq":
                w = indep_dequant_awq(tensors, name + ".", 32)
            else:
                w = indep_dequant_gptq(tensors, name + ".")
                if variant == "gptq":
                    g_idx = tensors[name + ".g_idx"]
                    assert sorted(np.bincount(g_idx).tolist()) == [32] * (len(g_idx) // 32)
            x = torch.randn(5, w.shape[0], generator=gen)
            expected = x @ torch.from_numpy(w)
            if name + ".bias" in tensors:
                expected = expected + torch.from_numpy(tensors[name + ".bias"].astype(np.float32))
            got = _layer_output(loaded.model, name, x)
            # The CPU int4 kernel runs in bf16: activations and scales are rounded to 8 bits of mantissa.
            tol = 0.02 * float(expected.abs().max()) + 1e-3
            assert float((got - expected).abs().max()) <= tol, name
            # AWQ folds per-channel scales into the norms, so only GPTQ/RTN weights compare to the source.
            # GPTQ trades weight error for output error, so the bound is on the whole matrix (relative
            # Frobenius error; measured 0.13-0.16 on these random weights with 64 calibration tokens).
            if variant != "awq":
                ref = src[name + ".weight"].T
                rel = float(np.linalg.norm(w - ref) / np.linalg.norm(ref))
                assert rel < 0.2, (name, rel)


def test_quant_awq_checkpoint_preserves_the_function(tiny_quantized: dict[str, Path]) -> None:
    """AWQ moves scales from the norms into the projections: the whole model must still compute about
    the same logits as its source (unlike a wrong-order unpacking, which scrambles columns)."""
    from server.quantize.evaluation import score_sequence

    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(6))
    base = score_sequence(_load(tiny_quantized["src"]).model, ids)
    for variant in ("awq", "gptq"):
        q = score_sequence(_load(tiny_quantized[variant]).model, ids)
        assert abs(float(q.nll.mean()) - float(base.nll.mean())) < 0.15 * float(base.nll.mean()), variant


@pytest.mark.parametrize("per_tensor", [False, True])
def test_quant_fp8_checkpoint_loads(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    per_tensor: bool,
) -> None:
    """An fp8 e4m3 checkpoint (quant_method fp8, weight + weight_scale) loads into Fp8Linear layers that
    compute with exactly the stored weights."""
    import shutil

    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file

    from server.quant.layers import Fp8Linear

    src = tiny_model_factory(arch="llama", tie=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    state = load_torch(str(src / "model.safetensors"))
    for name in [k for k in state if k.endswith("_proj.weight")]:
        w = state[name].float()
        amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)  # [] or [N, 1]
        scale = (amax / 448.0).clamp(min=1e-12)
        state[name] = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        state[name.removesuffix("weight") + "weight_scale"] = scale.reshape(-1) if per_tensor else scale
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    loaded = _load(tmp_path)
    assert loaded.quantization == "fp8"
    name = "model.layers.1.mlp.down_proj"
    layer = loaded.model.get_submodule(name)
    assert isinstance(layer, Fp8Linear)
    w = state[name + ".weight"].float() * state[name + ".weight_scale"].float().reshape(-1, 1)  # [N, K]
    x = torch.randn(3, w.shape[1])
    assert torch.allclose(_layer_output(loaded.model, name, x), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_quant_quantizer_refuses_an_already_quantized_checkpoint(
    tiny_quantized: dict[str, Path], tmp_path: Path
) -> None:
    from server.quantize import QuantizeOptions, quantize_model

    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(str(tiny_quantized["awq"]), tmp_path / "out", QuantizeOptions("gptq", calib_tokens=16))


def test_quant_zero_biases_of_bias_free_layers_are_accepted(
    tiny_quantized: dict[str, Path], tmp_path: Path
) -> None:
    """AutoGPTQ writes a `bias` for every quantized layer, zeros where the model has none: such a
    checkpoint loads and computes the same; a non-zero bias on a bias-free layer is still refused."""
    import shutil

    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file

    from server.models.loader import ModelLoadError
    from server.quantize.evaluation import score_sequence

    src = tiny_quantized["gptq"]
    folder = tmp_path / "with-zero-bias"
    shutil.copytree(src, folder)
    (weights,) = folder.glob("*.safetensors")
    state = load_torch(str(weights))
    added = []
    for key in [k for k in state if k.endswith(".qweight")]:
        layer = key.removesuffix(".qweight")
        if f"{layer}.bias" not in state:  # o/gate/up/down of Qwen2; q/k/v have real biases
            state[f"{layer}.bias"] = torch.zeros(state[f"{layer}.scales"].shape[1], dtype=torch.float16)
            added.append(layer)
    assert any(name.endswith("mlp.down_proj") for name in added)
    save_file(state, str(weights), metadata={"format": "pt"})

    ids = torch.randint(0, 49152, (32,), generator=torch.Generator().manual_seed(3))
    want = score_sequence(_load(src).model, ids).nll
    torch.testing.assert_close(score_sequence(_load(folder).model, ids).nll, want)

    state[f"{added[0]}.bias"][0] = 0.5
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="unexpected tensors"):
        _load(folder)

"""The registered models, checked the way timm checks its own (tests/test_models.py)."""
import pickle
import re
import subprocess
import sys
from copy import deepcopy

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import ROOT, load_script
from timm.optim import create_optimizer_v2

import models
from mhla import LinearAttention, MultiHeadLinearAttention, RMSNorm
from mhla.mixing import mixing_init

MODELS = timm.list_models(module="deit_mhla")
PAPER_SETTING = [n for n in MODELS if n.endswith(("_mhla", "_linear_lepe", "_softmax"))]
RELEASED = [n for n in MODELS if n.endswith(("_mhla_official", "_linear"))]
TINY = ["deit_tiny_mhla", "deit_tiny_linear", "deit_tiny_softmax"]


def test_registered_names():
    assert sorted(MODELS) == sorted(
        [f"deit_{size}_mhla{suffix}" for size in ("tiny", "small", "base") for suffix in ("", "_official")]
        + [f"deit_{size}_{kind}" for size in ("tiny", "small") for kind in ("linear", "linear_lepe", "softmax")])


@pytest.mark.parametrize("name,img_size", [(name, 64) for name in MODELS]  # 4 x 4 tokens: one per block
                         + [(name, 96) for name in MODELS if "_tiny_" in name])  # 6 x 6: unequal blocks
def test_forward_backward(name, img_size):
    model = timm.create_model(name, img_size=img_size, num_classes=7)
    out = model(torch.randn(2, 3, img_size, img_size))
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not no_grad


@pytest.mark.parametrize("name", PAPER_SETTING)
def test_paper_settings(name):
    model = timm.create_model(name)
    assert model.cls_token is None and model.global_pool == "avg" and model.num_prefix_tokens == 0
    attn = model.blocks[0].attn
    assert attn.head_dim == 64 and len(model.blocks) == 12
    if name.endswith("_softmax"):
        assert type(attn).__name__ == "Attention"
        return
    assert isinstance(attn, LinearAttention) and attn.lepe.conv.kernel_size == (5, 5)
    assert isinstance(attn.q_norm, torch.nn.RMSNorm) and attn.qkv.bias is None
    if name.endswith("_mhla"):
        assert isinstance(attn, MultiHeadLinearAttention) and attn.block_grid == (4, 4)
        assert torch.allclose(attn.mixing.weight, mixing_init((4, 4), "linear", "rows").float())


@pytest.mark.parametrize("name", RELEASED)
def test_released_settings(name):
    model = timm.create_model(name)
    attn = model.blocks[0].attn
    assert model.cls_token is None and model.global_pool == "avg" and attn.head_dim == 64 and attn.qkv.bias is None
    if name.endswith("_linear"):  # the released linear baseline
        assert type(attn) is LinearAttention and attn.lepe is None and attn.feature_eps == 0 and attn.eps == 1e-6
        assert isinstance(model.blocks[0].norm1, RMSNorm) and isinstance(model.fc_norm, RMSNorm)  # timm RmsNorm's math
        assert attn.q_norm.eps == 1e-6 and isinstance(attn.input_norm, torch.nn.Identity)
        return
    assert model.img_pad_to == 256 and model.patch_embed.grid_size == (16, 16) and attn.normalizer == "official"
    assert isinstance(attn.input_norm, torch.nn.LayerNorm) and attn.input_norm.eps == 1e-5 and attn.q_norm.eps is None
    assert not attn.mixing.constrain and attn.lepe.conv.kernel_size == (5, 5)
    assert torch.allclose(attn.mixing.weight, mixing_init((4, 4), "linear", "columns").float())


@pytest.mark.parametrize("name", TINY)
def test_timm_feature_api(name):
    model = timm.create_model(name, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    features = model.forward_features(x)
    assert features.shape == (2, 16, 192)
    pooled = model.forward_head(features, pre_logits=True)
    assert pooled.shape == (2, 192)
    torch.testing.assert_close(model.forward_head(features), model(x))
    final, intermediates = model.forward_intermediates(x, indices=2)
    assert [t.shape for t in intermediates] == [(2, 192, 4, 4)] * 2
    torch.testing.assert_close(final, features)
    model.reset_classifier(5)
    assert model(x).shape == (2, 5)


@pytest.mark.parametrize("name", TINY)
def test_grad_checkpointing_gives_the_same_output(name):
    model = timm.create_model(name, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = model(x)
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(model(x), expected)
    model.train()
    model(x).sum().backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None


@pytest.mark.parametrize("name", MODELS)
def test_default_cfg(name):
    cfg = timm.create_model(name).pretrained_cfg
    assert cfg["tag"] == "untrained" and cfg["architecture"] == name
    assert cfg["input_size"] == (3, 224, 224) and cfg["crop_pct"] == 0.875 and cfg["interpolation"] == "bicubic"
    assert cfg["first_conv"] == "patch_embed.proj" and cfg["classifier"] == "head"
    assert cfg["paper_ids"] == "arXiv:2601.07832" and cfg["license"] == "apache-2.0"
    assert cfg["mean"] == (0.485, 0.456, 0.406)


def test_mixing_is_excluded_from_weight_decay():
    model = timm.create_model("deit_tiny_mhla")
    assert {f"blocks.{i}.attn.mixing.weight" for i in range(12)} <= model.no_weight_decay()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(model.blocks[0].attn.mixing.weight) not in decayed
    assert id(model.blocks[0].attn.qkv.weight) in decayed


@pytest.mark.parametrize("img_size,grid", [(224, (14, 14)), (256, (16, 16)), (384, (24, 24)), (512, (32, 32)),
                                           ((224, 288), (14, 18))])
def test_any_resolution(img_size, grid):
    model = timm.create_model("deit_tiny_mhla", img_size=img_size).eval()
    size = img_size if isinstance(img_size, tuple) else (img_size, img_size)
    with torch.no_grad():
        out = model(torch.randn(1, 3, *size))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    assert model.blocks[0].attn.grid_size == grid


def test_dynamic_img_size():
    model = timm.create_model("deit_tiny_mhla", dynamic_img_size=True).eval()
    with torch.no_grad():
        for size, grid in [((224, 224), (14, 14)), ((160, 256), (10, 16))]:
            assert model(torch.randn(1, 3, *size)).shape == (1, 1000)
            assert model.blocks[-1].attn.grid_size == grid


def test_image_padding_like_the_released_code():
    padded = timm.create_model("deit_tiny_mhla", img_pad_to=256).eval()
    plain = timm.create_model("deit_tiny_mhla", img_size=256).eval()
    plain.load_state_dict(padded.state_dict())
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(padded(x), plain(F.pad(x, (16, 16, 16, 16))))  # centred: 16 px on every side
    assert padded.blocks[0].attn.grid_size == (16, 16)


def test_class_token_option():
    model = timm.create_model("deit_tiny_mhla", class_token=True, global_pool="token", img_size=64)
    assert model.blocks[0].attn.num_prefix_tokens == 1
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


@pytest.mark.parametrize("kwargs", [
    dict(block_grid=(2, 2), transform="cos", lepe_kernel=0, qk_norm=False, normalizer="official",
         learnable_mixing=False),
    dict(block_grid=(3, 3), block_mode="pad", mixing_norm="columns", constrain_mixing=False),
])
def test_ablation_kwargs_reach_every_block(kwargs):
    model = timm.create_model("deit_tiny_mhla", img_size=64, **kwargs)
    for block in model.blocks:
        attn = block.attn
        assert attn.block_grid == kwargs["block_grid"]
        assert (attn.lepe is None) == (kwargs.get("lepe_kernel") == 0)
        assert attn.mixing.weight.requires_grad == kwargs.get("learnable_mixing", True)
        assert attn.mixing.constrain == kwargs.get("constrain_mixing", True)
    assert torch.isfinite(model(torch.randn(1, 3, 64, 64))).all()


def test_local_weights_through_pretrained_cfg_overlay_and_checkpoint_path(tmp_path):
    source = timm.create_model("deit_tiny_mhla", img_size=64)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    from_file = timm.create_model("deit_tiny_mhla", img_size=64, pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(path)))
    from_checkpoint = timm.create_model("deit_tiny_mhla", img_size=64, checkpoint_path=str(path))
    for model in (from_file, from_checkpoint):
        for (name, value), expected in zip(model.state_dict().items(), source.state_dict().values(), strict=True):
            assert torch.equal(value, expected), name


def test_pretrained_without_weights_is_an_error():
    with pytest.raises(RuntimeError, match="No pretrained weights exist"):
        timm.create_model("deit_tiny_mhla", pretrained=True)


def _write_random_deit(path):
    source = timm.create_model("deit_tiny_patch16_224")
    torch.save(source.state_dict(), path)
    return source


@pytest.mark.slow  # the conversion script in a subprocess
def test_conversion_from_a_softmax_deit_checkpoint(tmp_path):
    source = _write_random_deit(tmp_path / "deit.pth")
    out = tmp_path / "mhla.pth"
    cmd = [sys.executable, str(ROOT / "scripts" / "convert_deit.py"), "--src", str(tmp_path / "deit.pth"),
           "--model", "deit_tiny_mhla", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "dropped (cls_token, blocks.0.attn.qkv.bias" in proc.stdout
    model = timm.create_model("deit_tiny_mhla", checkpoint_path=str(out))
    assert torch.equal(model.patch_embed.proj.weight, source.patch_embed.proj.weight)
    assert torch.equal(model.blocks[5].attn.qkv.weight, source.blocks[5].attn.qkv.weight)
    assert torch.equal(model.blocks[5].mlp.fc2.weight, source.blocks[5].mlp.fc2.weight)
    assert torch.equal(model.fc_norm.weight, source.norm.weight)
    assert torch.equal(model.pos_embed, source.pos_embed[:, 1:])
    assert torch.allclose(model.blocks[0].attn.mixing.weight, mixing_init((4, 4)).float())
    assert model.cls_token is None


def test_conversion_resamples_positions_to_another_resolution():
    source = timm.create_model("deit_tiny_patch16_224")
    target = timm.create_model("deit_tiny_mhla", img_size=384)
    converted, report = models.convert_softmax_deit({"model": source.state_dict()}, target)
    target.load_state_dict(converted, strict=True)
    assert target.pos_embed.shape == (1, 576, 192)
    assert "cls_token" in report["dropped"] and "blocks.0.attn.mixing.weight" in report["initialised"]


@pytest.mark.parametrize("args,match", [
    (["--src", "missing.pth"], "--src: checkpoint missing.pth does not exist"),
    (["--model", "deit_tiny_nope"], "--model 'deit_tiny_nope' is not a registered model"),
])
def test_conversion_errors(tmp_path, args, match, capsys, monkeypatch):
    _write_random_deit(tmp_path / "deit.pth")
    monkeypatch.chdir(tmp_path)
    base = {"--src": str(tmp_path / "deit.pth"), "--model": "deit_tiny_mhla", "--out": str(tmp_path / "o.pth")}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    assert load_script("convert_deit").main([x for kv in base.items() for x in kv]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "o.pth").exists()


@pytest.mark.parametrize("name,kwargs,error,match", [
    ("deit_tiny_mhla", dict(blok_grid=(2, 2)), TypeError, "blok_grid"),
    ("deit_tiny_mhla", dict(img_size=225), ValueError, "img_size \\(225, 225\\) is not divisible by patch_size"),
    ("deit_tiny_mhla", dict(img_size=64, block_grid=(8, 8)), ValueError,
     "block_grid 8x8 is larger than the token grid 4x4"),
    ("deit_tiny_softmax", dict(block_grid=(2, 2)), ValueError,
     "block_grid=\\(2, 2\\) is not an option of attn_type='softmax'"),
    ("deit_tiny_linear", dict(transform="cos"), ValueError, "transform='cos' is not an option of attn_type='linear'"),
    ("deit_tiny_mhla", dict(transform="sine"), ValueError, "unknown mixing transform 'sine'"),
    ("deit_tiny_mhla", dict(num_heads=0), ValueError, "^num_heads must be an integer >= 1, got 0$"),
    ("deit_tiny_mhla", dict(patch_size=(16, 0)), ValueError, "^patch_size must be an integer >= 1, got \\(16, 0\\)$"),
    ("deit_tiny_softmax", dict(depth="2"), ValueError, "^depth must be an integer >= 0, got '2'$"),
])
def test_bad_model_arguments(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        timm.create_model(name, **kwargs)


@pytest.mark.slow  # torch.compile
def test_compiles_on_cpu_without_graph_breaks():
    model = timm.create_model("deit_tiny_mhla", img_size=64, depth=2)
    x = torch.randn(2, 3, 64, 64)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    expected = model(x)
    expected.sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = torch.compile(model)(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    out.sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-3, atol=1e-4, msg=name)


NAME = re.compile(r"\b(deit_(?:tiny|small|base)_[a-z0-9_]+|vit_[a-z0-9_]+)\b")


def test_every_model_name_in_configs_docs_and_scripts_is_registered():
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("configs/**/*.yaml"),
             *ROOT.glob("scripts/**/*.py")]
    names = {name for f in files for name in NAME.findall(f.read_text())}
    released = {name for name, _ in load_script("model_sizes").RELEASED.values()}  # the released code's names
    assert "deit_tiny_mhla" in names and "deit_tiny_pla_1d_v6_6" in released
    assert [n for n in sorted(names - released) if not timm.is_model(n)] == []


@pytest.mark.parametrize("name", ["deit_tiny_mhla", "deit_tiny_linear"])
def test_whole_model_prints_its_attention_class_pickles_and_deep_copies(name, tmp_path):
    attn_cls, options = (MultiHeadLinearAttention, dict(block_grid=(2, 2))) if name.endswith("_mhla") else (
        LinearAttention, {})
    model = timm.create_model(name, img_size=32, patch_size=8, depth=2, **options).eval()
    assert type(model.blocks[0].attn) is attn_cls
    assert f"(attn): {attn_cls.__name__}(" in repr(model)
    x = torch.randn(2, 3, 32, 32)
    expected = model(x)
    torch.save(model, tmp_path / "model.pth")
    for copy in (torch.load(tmp_path / "model.pth", weights_only=False), pickle.loads(pickle.dumps(model)),
                 deepcopy(model)):
        assert torch.equal(copy(x), expected)


def test_models_take_norm_eps():
    model = timm.create_model("deit_tiny_mhla", img_size=32, patch_size=8, depth=1, block_grid=(2, 2), eps=1e-3,
                              norm_eps=1e-5)
    attn = model.blocks[0].attn
    assert attn.eps == 1e-3 and attn.q_norm.eps == attn.k_norm.eps == 1e-5

"""The ViT family: sizes against the paper's figures, FLOPs against a real counter, stochastic
depth, the pre-logits layer and the fine-tuning head swap."""
import pytest
import torch

from pretrain.config import ConfigError, ModelConfig
from pretrain.model import (PatchConv2d, count_parameters, create_model, measure_train_flops,
                            resolve_spec)

L16, H14 = "vit_large_patch16_224", "vit_huge_patch14_224"


def meta(name, **kw):
    return create_model(ModelConfig(name=name, **kw), device="meta")


def test_backbone_sizes_match_the_published_figures():
    large, huge = meta(L16, num_classes=0), meta(H14, num_classes=0)
    assert all(p.is_meta for p in large.parameters())  # sizing allocates nothing
    l_backbone = count_parameters(large)["backbone"]
    h_backbone = count_parameters(huge)["backbone"]
    assert h_backbone / 1e6 == pytest.approx(630.8, abs=0.1)
    # ViT-L/16 is 303.3 M without any head; the often-quoted 304.3 M (timm's model card)
    # includes timm's 1000-class ImageNet head: 1024 x 1000 weights + 1000 biases.
    assert l_backbone / 1e6 == pytest.approx(303.3, abs=0.1)
    assert (l_backbone + 1024 * 1000 + 1000) / 1e6 == pytest.approx(304.3, abs=0.1)


@pytest.mark.parametrize("name,width,total", [(L16, 1024, 326.7), (H14, 1280, 660.4)])
def test_pretraining_model_with_pre_logits_and_21k_head(name, width, total):
    params = count_parameters(meta(name, representation_size=width, num_classes=21843))
    assert params["pre_logits"] == width * width + width
    assert params["head"] == width * 21843 + 21843
    assert params["total"] / 1e6 == pytest.approx(total, abs=0.1)


@pytest.mark.parametrize("name,tflop", [(L16, 0.37), (H14, 1.00)])
def test_training_flops_per_image_at_224(name, tflop):
    spec = resolve_spec(ModelConfig(name=name, representation_size=None, num_classes=0))
    assert spec.train_flops_per_image() / 1e12 == pytest.approx(tflop, rel=0.03)


def test_flop_formula_agrees_with_pytorchs_counter_on_a_real_model():
    cfg = ModelConfig(name="vit_small_patch16_224", img_size=64, depth=3,
                      representation_size=384, num_classes=100)
    model = create_model(cfg)
    counted = measure_train_flops(model, img_size=64, batch=2) / 2
    assert model.spec.train_flops_per_image() == pytest.approx(counted, rel=0.03)


def test_flop_formula_agrees_with_the_counter_for_vit_large_on_meta():
    model = meta(L16, representation_size=1024, num_classes=21843)
    assert model.spec.train_flops_per_image() == pytest.approx(
        measure_train_flops(model, img_size=224), rel=0.03)


@pytest.mark.parametrize("patch, img", [(16, 64), (14, 56)])
def test_patch_embedding_trains_as_a_matmul_with_timms_parameters(patch, img):
    """Training runs the patch embedding as a matmul (faster than cuDNN's convolution on an
    H100) with timm's parameters: the same function and gradients as timm's model, to rounding;
    in eval mode it is timm's convolution, bit for bit."""
    import timm

    arch = dict(img_size=img, patch_size=patch, embed_dim=64, depth=2, num_heads=2)
    ours = create_model(ModelConfig(name="vit_tiny_patch16_224", num_classes=0,
                                    drop_path_rate=0.0, **arch))
    proj = ours.backbone.patch_embed.proj
    assert type(proj) is PatchConv2d
    stock = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0,
                              global_pool="token", **arch)
    stock.load_state_dict(ours.backbone.state_dict())  # strict: the same keys and shapes
    x = torch.randn(3, 3, img, img)
    trained = proj(x)  # training mode: the matmul
    conv = stock.patch_embed.proj(x)
    assert not torch.equal(trained, conv)  # not the convolution, yet the same to rounding
    torch.testing.assert_close(trained, conv, rtol=1e-4, atol=1e-5)
    feats, ref = ours.backbone(x), stock(x)  # training mode, no dropout or drop path
    torch.testing.assert_close(feats, ref, rtol=1e-4, atol=1e-5)
    feats.square().sum().backward()
    ref.square().sum().backward()
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(proj, name).grad,
                                   getattr(stock.patch_embed.proj, name).grad,
                                   rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(ours.backbone.eval()(x), stock.eval()(x))
        # a size the patches do not tile goes through the convolution (timm refuses it first)
        odd = torch.randn(1, 3, img + 3, img)
        assert torch.equal(proj.train()(odd), stock.patch_embed.proj(odd))


def tiny(**kw):
    base = dict(name="vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=32, depth=4,
                num_heads=2, num_classes=5)
    return create_model(ModelConfig(**{**base, **kw}))


def _branch_drop_fractions(model, x):
    """Per block: the share of samples whose residual branches contributed exactly nothing."""
    dropped = {}

    def hook(name):
        def record(_module, _inputs, out):
            per_sample = out.flatten(1).abs().sum(1) == 0
            dropped.setdefault(name, []).append(per_sample.float().mean().item())
        return record

    handles = [getattr(blk, f"drop_path{i}").register_forward_hook(hook((b, i)))
               for b, blk in enumerate(model.backbone.blocks) for i in (1, 2)]
    with torch.no_grad():
        out = model(x)
    for h in handles:
        h.remove()
    return {k: v[0] for k, v in dropped.items()}, out


def test_stochastic_depth_drops_each_block_at_its_linear_rate():
    torch.manual_seed(0)
    model = tiny(drop_path_rate=0.3).train()
    n = 4000
    fractions, _ = _branch_drop_fractions(model, torch.randn(n, 3, 16, 16))
    expected = torch.linspace(0, 0.3, 4).tolist()  # rates grow linearly over depth
    for (block, _branch), frac in fractions.items():
        rate = expected[block]
        tolerance = 5 * (rate * (1 - rate) / n) ** 0.5 + 1e-9
        assert abs(frac - rate) <= tolerance, (block, frac, rate)


def test_eval_mode_is_deterministic_and_drops_nothing():
    model = tiny(drop_path_rate=0.3).eval()
    x = torch.randn(256, 3, 16, 16)
    fractions, first = _branch_drop_fractions(model, x)
    assert all(f == 0 for f in fractions.values())
    with torch.no_grad():
        assert torch.equal(first, model(x))


def test_pre_logits_are_tanh_bounded_and_head_bias_is_configurable():
    model = tiny(representation_size=48, head_bias_init=-10.0).eval()
    x = 50 * torch.randn(64, 3, 16, 16)
    with torch.no_grad():
        feats = model.forward_pre_logits(x)
        logits = model(x)
    assert feats.shape == (64, 48)
    assert feats.abs().max() <= 1.0 and feats.abs().max() > 0.5  # bounded, not collapsed
    # zero-initialised kernel: every logit starts at the bias (sigmoid loss: p ~ 4.5e-5)
    assert torch.equal(logits, torch.full_like(logits, -10.0))


def test_head_swap_drops_pre_logits_and_starts_from_zero_logits():
    model = tiny(representation_size=48, head_zero_init=False, head_bias_init=-10.0)
    model.swap_head(num_classes=7)
    assert not any("pre_logits" in name for name, _ in model.named_parameters())
    assert model.spec.representation_size is None and model.spec.num_classes == 7
    x = torch.randn(8, 3, 16, 16)
    logits = model.eval()(x)
    assert logits.shape == (8, 7) and torch.equal(logits, torch.zeros_like(logits))
    # the new head learns: one SGD step moves the logits off zero
    model.train()
    loss = torch.nn.functional.cross_entropy(model(x), torch.arange(8) % 7)
    loss.backward()
    assert model.head.weight.grad.abs().sum() > 0


def test_any_timm_vit_with_overrides():
    model = create_model(ModelConfig(name="vit_small_patch16_224", img_size=32, patch_size=4,
                                     depth=2, num_classes=3))
    assert model.spec.seq_len == 65 and model.spec.embed_dim == 384
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize("kw,key", [
    (dict(num_heads=5), "model.num_heads"),
    (dict(img_size=100), "model.img_size': 100 is not divisible by the patch size 16; use 96 "
                         "or 112"),
    (dict(name="vit_huge_patch14_224", img_size=384), "use 378 or 392"),
    (dict(name="resnet50"), "model.name"),
    (dict(name="vit_larg_patch16_224"), "did you mean 'vit_large_patch16_224'"),
    (dict(mlp_ratio=0.0005), "model.mlp_ratio': 0.0005 gives width 1024 an MLP of width 0"),
])
def test_impossible_architectures_are_rejected(kw, key):
    with pytest.raises(ConfigError, match=key):
        resolve_spec(ModelConfig(**kw))


@pytest.mark.parametrize("sets", [[], ["train.activation_checkpointing=true"],
                                  ["train.activation_checkpointing=true",
                                   "train.checkpointed_blocks=1"]])
def test_torch_compile_sees_the_whole_training_model_as_one_graph(sets):
    """A graph break splits the compiled step and leaves the pieces between to eager mode
    (an MFU loss on a GPU): the pretraining model -- stochastic depth, dropout, pre-logits, the
    21k-style head, activation checkpointing of all blocks, some or none -- compiles whole."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.engine import apply_train_options

    model = create_model(ModelConfig(name=L16, img_size=32, depth=2, representation_size=64,
                                     num_classes=100, drop_path_rate=0.1, dropout=0.1)).train()
    apply_train_options(model, load_config(PretrainConfig, None, [
        "data.root=/x", "train.total_steps=1", *sets]))
    explained = torch._dynamo.explain(model)(torch.randn(2, 3, 32, 32))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [str(b.reason) for b in explained.break_reasons]


def _saved_bytes_and_grads(model, x):
    """Bytes autograd keeps for the backward pass, and the gradients it then computes."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    torch.manual_seed(1)  # the same dropout / drop-path draws on every call
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().square().mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointed", [None, 2, 3])
def test_selective_activation_checkpointing_trades_memory_for_the_same_gradients(checkpointed):
    """train.checkpointed_blocks=N: N of the blocks, spread over the depth, keep only their
    input for backward and recompute the rest there -- fewer saved activations, the very same
    gradients (stochastic depth and dropout replayed), state-dict keys untouched."""
    import copy

    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.engine import apply_train_options

    def build(*sets):
        cfg = load_config(PretrainConfig, None, ["data.root=/nonexistent", "train.total_steps=1",
                                                 *sets])
        torch.manual_seed(0)
        model = tiny(depth=6, drop_path_rate=0.2, dropout=0.1).train()
        apply_train_options(model, cfg)
        return model

    x = torch.randn(4, 3, 16, 16)
    plain_bytes, plain_grads = _saved_bytes_and_grads(build(), x)
    sets = ["train.activation_checkpointing=true"]
    if checkpointed:
        sets.append(f"train.checkpointed_blocks={checkpointed}")
    model = build(*sets)
    saved, grads = _saved_bytes_and_grads(model, x)
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    # each checkpointed block keeps its input only: the saved bytes fall with their number
    # (what one block saves, measured on its own; all six blocks when no number is given)
    one = build("train.activation_checkpointing=true", "train.checkpointed_blocks=1")
    per_block = plain_bytes - _saved_bytes_and_grads(one, x)[0]
    assert per_block > 0
    assert saved == pytest.approx(plain_bytes - (checkpointed or 6) * per_block, rel=0.02)
    assert set(model.state_dict()) == set(build().state_dict())
    # the EMA is a deep copy: its checkpointed blocks run its own weights, not the live ones
    ema = copy.deepcopy(model).eval()
    with torch.no_grad():
        before = ema(x)
        for p in model.parameters():
            p.add_(1.0)
        assert torch.equal(ema(x), before)


def test_checkpointed_blocks_beyond_the_depth_or_without_checkpointing_are_refused():
    from pretrain.config import ConfigError, PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.engine import apply_train_options

    with pytest.raises(ConfigError, match="train.checkpointed_blocks needs "
                                          "train.activation_checkpointing=true"):
        load_config(PretrainConfig, None, ["data.root=/x", "train.total_steps=1",
                                           "train.checkpointed_blocks=2"])
    cfg = load_config(PretrainConfig, None, ["data.root=/x", "train.total_steps=1",
                                             "train.activation_checkpointing=true",
                                             "train.checkpointed_blocks=5"])
    with pytest.raises(ConfigError, match="'train.checkpointed_blocks': 5 is more than the "
                                          "model's 4 blocks"):
        apply_train_options(tiny(), cfg)

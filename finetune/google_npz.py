"""Google ViT checkpoints (``.npz``) in this project's key layout, for ``finetune.weights``.

Two layouts are read: vision_transformer's (the released ViT-B_16.npz & co: ``Transformer/
posembed_input``, ``MultiHeadDotProductAttention_1``; ``opt/target/`` prefix allowed) and
big_vision's (``params/`` prefix, ``pos_embedding``, ``MultiHeadDotProductAttention_0``, blocks
either one per ``encoderblock_i`` or scanned into one stacked ``encoderblock``). Their
``pre_logits`` and ``head`` come along; ``finetune.weights`` decides what is copied.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import torch

from finetune.weights import InitError, InitSource
from pretrain.export import BACKBONE_PREFIX


_NPZ_PREFIXES = ("", "opt/target/", "params/", "params/img/")


def google_npz_state(w: Mapping, path: str = "npz") -> tuple[dict, str, Optional[int]]:
    """Arrays of a Google ViT ``.npz`` -> (ViTClassifier-keyed tensors, layout name, attention
    heads).

    Flax stores Dense kernels (in, out), the patch conv HWIO and attention as
    (D, heads, head_dim) / (heads, head_dim, D); PyTorch wants (out, in), OIHW and one fused
    qkv (3D, D). vision_transformer's position table includes the class token's row; big_vision
    adds positions before prepending the class token, i.e. the class row is zero.
    """
    import numpy as np

    prefix = next((p for p in _NPZ_PREFIXES if f"{p}embedding/kernel" in w), None)
    if prefix is None:
        raise InitError(f"init '{path}' is not a Google ViT checkpoint (no 'embedding/kernel' "
                        f"under any of the prefixes {[p or '/' for p in _NPZ_PREFIXES]})")
    if f"{prefix}cls" not in w or f"{prefix}MAPHead_0/probe" in w:
        raise InitError(f"init '{path}' pools without a class token (big_vision pool_type "
                        f"gap/map); this project's ViT reads the class token")
    scanned = f"{prefix}Transformer/encoderblock/LayerNorm_0/scale" in w
    big_vision = prefix.startswith("params/") or f"{prefix}pos_embedding" in w or scanned
    layout = "big_vision" if big_vision else "vision_transformer"

    def t(name: str, idx: Optional[int] = None) -> Optional[torch.Tensor]:
        key = prefix + name
        if key not in w:
            return None
        a = w[key]
        if a.dtype.kind not in "fiu":
            raise InitError(f"init '{path}': array '{key}' has dtype {a.dtype}, not a number")
        a = a[idx] if idx is not None else a
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    out: dict = {}

    def put(key: str, value: Optional[torch.Tensor]) -> None:
        if value is not None:
            out[key] = value.contiguous()

    b = BACKBONE_PREFIX
    kernel = t("embedding/kernel")
    put(b + "patch_embed.proj.weight", kernel.permute(3, 2, 0, 1))  # HWIO -> OIHW
    put(b + "patch_embed.proj.bias", t("embedding/bias"))
    put(b + "cls_token", t("cls"))
    if big_vision:
        pos = t("pos_embedding")
        if pos is not None:
            pos = pos.reshape(1, -1, pos.shape[-1])  # (1, h*w, D) or (1, h, w, D)
            pos = torch.cat([torch.zeros_like(pos[:, :1]), pos], dim=1)
    else:
        pos = t("Transformer/posembed_input/pos_embedding")
    put(b + "pos_embed", pos)
    put(b + "norm.weight", t("Transformer/encoder_norm/scale"))
    put(b + "norm.bias", t("Transformer/encoder_norm/bias"))

    attn, ln2, mlp = ("MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0") \
        if big_vision else ("MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")
    if scanned:
        depth = w[f"{prefix}Transformer/encoderblock/LayerNorm_0/scale"].shape[0]
    else:
        depth = 0
        while f"{prefix}Transformer/encoderblock_{depth}/LayerNorm_0/scale" in w:
            depth += 1
    heads = None
    for i in range(depth):
        blk, idx = (("Transformer/encoderblock/", i) if scanned
                    else (f"Transformer/encoderblock_{i}/", None))
        o = f"{b}blocks.{i}."

        def g(name: str) -> Optional[torch.Tensor]:
            return t(blk + name, idx)

        put(o + "norm1.weight", g("LayerNorm_0/scale"))
        put(o + "norm1.bias", g("LayerNorm_0/bias"))
        qkv = [g(f"{attn}/{n}/kernel") for n in ("query", "key", "value")]
        if qkv[0] is not None and qkv[0].ndim == 3:
            heads = qkv[0].shape[1]  # (what the shapes of our fused tensors no longer show)
        if all(k is not None for k in qkv):  # (D, heads, head_dim) each -> (3D, D)
            put(o + "attn.qkv.weight", torch.cat([k.flatten(1).T for k in qkv]))
        qkv_b = [g(f"{attn}/{n}/bias") for n in ("query", "key", "value")]
        if all(k is not None for k in qkv_b):
            put(o + "attn.qkv.bias", torch.cat([k.flatten() for k in qkv_b]))
        proj = g(f"{attn}/out/kernel")  # (heads, head_dim, D) -> (D, D)
        put(o + "attn.proj.weight", proj.flatten(0, 1).T if proj is not None else None)
        put(o + "attn.proj.bias", g(f"{attn}/out/bias"))
        put(o + "norm2.weight", g(f"{ln2}/scale"))
        put(o + "norm2.bias", g(f"{ln2}/bias"))
        for r in range(2):
            k = g(f"{mlp}/Dense_{r}/kernel")
            put(o + f"mlp.fc{r + 1}.weight", k.T if k is not None else None)
            put(o + f"mlp.fc{r + 1}.bias", g(f"{mlp}/Dense_{r}/bias"))
    for name, ours in (("pre_logits", "pre_logits.fc"), ("head", "head")):
        k = t(f"{name}/kernel")
        if k is not None and k.numel():
            put(f"{ours}.weight", k.T)
            put(f"{ours}.bias", t(f"{name}/bias"))
    return out, layout, heads


def read_npz(path: Path) -> InitSource:
    """A Google ``.npz`` as an init: no pickled object arrays, one-line errors."""
    import numpy as np
    import zipfile

    try:
        w = np.load(path, allow_pickle=False)  # object arrays would need pickle: refused
        if isinstance(w, np.lib.npyio.NpzFile):
            with w:
                state, layout, heads = google_npz_state(w, str(path))
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:  # EOF: an empty file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InitError(f"init '{path}' is not a readable .npz ({first})") from None
    if not isinstance(w, np.lib.npyio.NpzFile):
        raise InitError(f"init '{path}' holds one array (a .npy file), not the .npz archive of "
                        f"a Google checkpoint")
    # Google's ViT and big_vision both train on pixels scaled to [-1, 1]
    return InitSource("npz", str(path), state, extra={"layout": layout},
                      normalize="minus_one_one", spec={"num_heads": heads} if heads else None)

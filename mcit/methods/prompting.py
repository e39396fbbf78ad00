"""Shared pieces of the prompt-tuning methods on ViT (prompt insertion, heads, initialisers)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from mcit.models.base import LayerPrompt


def insert_prompts(backbone: nn.Module, pixel_values: torch.Tensor, prompts: torch.Tensor,
                   position: str = "cls") -> torch.Tensor:
    """Run the frozen ViT with ``prompts`` (B, P, D) inserted between [CLS] and the patch tokens.

    The position embeddings of [CLS] and the patches are the pre-trained ones (added by the model's
    own embedding layer). ``position="cls"``: every prompt token also gets the [CLS] position embedding,
    as in the official L2P code, whose resized position table repeats the [CLS] entry over the prompt
    slots (l2p-pytorch ``resize_pos_embed``). The table is frozen, so this is a fixed offset of the
    learned prompts: the same function class, but another starting point and another forward for the
    same prompt values. ``"none"``: the prompts enter as they are. Returns the final hidden states
    (B, 1 + P + N, D).
    """
    tokens = backbone.embed(pixel_values)
    prompts = prompts.to(tokens.dtype)
    pos = backbone.cls_position_embedding() if position == "cls" else None
    if pos is not None:
        prompts = prompts + pos.to(tokens.dtype)
    tokens = torch.cat([tokens[:, :1], prompts, tokens[:, 1:]], dim=1)
    return backbone.encode(tokens)


def pool(hidden: torch.Tensor, num_prompts: int, head_type: str) -> torch.Tensor:
    """The head's input: mean of the prompt outputs (L2P's "prompt" head) or the [CLS] output."""
    if head_type == "prompt":
        return hidden[:, 1 : 1 + num_prompts].mean(dim=1)
    if head_type == "token":
        return hidden[:, 0]
    if head_type == "token+prompt":
        return hidden[:, : 1 + num_prompts].mean(dim=1)
    raise ValueError(f"unknown head_type {head_type!r}")


HeadInit = Literal["timm", "torch"]
HEAD_INIT_DOC = ("the classifier head's initial weights: timm's ViT init (weight N(0, 0.02) truncated at +-2, bias 0; "
                 "the official code) or PyTorch's nn.Linear default (uniform +-1/sqrt(d), bias included)")


def classifier_head(d: int, num_classes: int, init: HeadInit) -> nn.Linear:
    """The linear head over all classes, initialised as the official code's ViT does (``init_weights_vit_timm``).

    Why it matters: with the logits outside the current task masked, the loss never moves the part of a task's
    head rows they share (its gradient sums to zero over the task's classes, and Adam's update of two rows with
    opposite gradients is opposite too), so that part stays at its initial value and decides how the tasks'
    logits compare at test time. PyTorch's default draws the bias uniformly in +-1/sqrt(d), a random offset
    between tasks that changes with the seed; timm's starts every bias at 0 and the weights small.
    """
    head = nn.Linear(d, num_classes)
    if init == "timm":
        with torch.no_grad():
            nn.init.trunc_normal_(head.weight, std=0.02, a=-2.0, b=2.0)
            nn.init.zeros_(head.bias)
    return head


def uniform_(shape: tuple[int, ...], low: float = -1.0, high: float = 1.0) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape).uniform_(low, high))


def majority_vote(idx: torch.Tensor, top_k: int, pool_size: int) -> torch.Tensor:
    """The official ``batchwise_prompt`` (L2P, DualPrompt): the k most frequent prompt ids of the batch, for
    every sample. As the official code (a port of jnp.unique with ``size``): the distinct ids are padded to
    ``pool_size`` with the smallest selected id at count 0 before the top-k over the counts, which fixes
    the order of tied ids and what fills the set when fewer than k ids were selected."""
    ids, counts = torch.unique(idx, return_counts=True, sorted=True)
    if ids.numel() < pool_size:
        pad = pool_size - ids.numel()
        ids = torch.cat([ids, ids.new_full((pad,), int(idx.min()))])
        counts = torch.cat([counts, counts.new_zeros(pad)])
    major = ids[counts.topk(top_k).indices]
    return major.unsqueeze(0).expand(idx.shape[0], -1)


def mask_to_classes(logits: torch.Tensor, classes: tuple[int, ...]) -> torch.Tensor:
    """Set every logit outside ``classes`` to -inf (training-time masking of other tasks' classes)."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[list(classes)] = True
    return logits.masked_fill(~keep, float("-inf"))


def per_head(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, L, D) tokens -> (B, H, L, D / H), the layout of a block's per-head keys and values."""
    b, length, d = x.shape
    return x.reshape(b, length, num_heads, d // num_heads).transpose(1, 2)


def gather_prefix(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per-sample prefixes from a prefix pool.

    ``pool``: (layers, 2, M, L, H, hd) -- for each prompted layer a key half and a value half of M
    prompts; ``idx``: (B, k) the prompts each sample uses. Returns (layers, B, 2, k * L, H, hd).

    The public DualPrompt / HiDe-Prompt ports index ``pool[:, :, idx]`` -> (layers, 2, B, k, L, H, hd)
    and then ``reshape`` to (layers, B, 2, ...), which interleaves the key/value axis with the batch
    axis: with B > 1 sample b gets another sample's prompt (or a value half as its key half). The
    batch axis must be moved with a permute first, as here (pinned in tests/unit/test_cil_methods.py).
    """
    sel = pool[:, :, idx]  # (layers, 2, B, k, L, H, hd)
    n_layers, dual, b, k, length, h, hd = sel.shape
    return sel.permute(0, 2, 1, 3, 4, 5, 6).reshape(n_layers, b, dual, k * length, h, hd)


def prefix_prompt(prefix: torch.Tensor) -> LayerPrompt:
    """One layer's (B, 2, P, H, hd) prefix as the LayerPrompt the backbone's attention reads."""
    p = prefix.transpose(2, 3)  # (B, 2, H, P, hd)
    return LayerPrompt(key=p[:, 0], value=p[:, 1])


def cosine(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, M) cosine similarities of queries (B, D) with keys (M, D)."""
    import torch.nn.functional as F

    return F.normalize(query.float(), dim=-1) @ F.normalize(keys.float(), dim=-1).t()

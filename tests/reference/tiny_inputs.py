"""The fixed small inputs every reference number was produced on, and how a test compares with them.

The official code was fed exactly these: the tiny seeded ViT below (its weights copied into the official
repository's own ViT class: ``qkv`` = concat(q, k, v), the rest one to one, LayerNorm eps 1e-6 as in timm),
the seeded images, and the method's parameters as ``method()`` initialises them (copied into the
official modules). Each ``official/<method>.json`` holds the official numbers and a ``source`` record:
repository, commit, the functions that ran, and what was compared. The official code ran in a scratch
folder outside this repository (timm 0.6.7 / 0.9.12 as its requirements pin, with the same CPU torch);
only its numbers are here (rounded to 9 significant digits, beyond float32 precision).

Tolerance: 1e-5, relative to the largest official magnitude where that exceeds 1 (``assert_close``), where the
measured noise floor allows it, else the fixture's own entry in ``TOLERANCE`` (how they were measured: there).
Gradients are compared rather than Adam's first step (which is lr * sign(g) up to eps and would hide a
wrong gradient magnitude); where a method rewrites the update itself (projection) the rewritten update
is compared.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
OFFICIAL = HERE / "official"
TOL = 1e-5
# The noise floor of a fixture: the largest difference of its numbers from the official ones over the CPU kernel sets of
# ``tests/numerics.py`` (MKL held to SSE4.2 / AVX2 / AVX-512 or its reproducible path, ATen's default / AVX2 / AVX-512
# kernels, oneDNN capped at AVX2, 1 and 2 threads), in units of the scale each comparison uses. A tolerance sits at
# least 10x above its fixture's floor (a CPU none of those emulate moved the same quantities by up to 2x what they
# did), and is the smallest of 1, 2, 5 x 10^k that does: 1e-5 for the fixtures whose floor is at most 1e-6 (one pass
# over the inputs), these for the rest (measured 2026-11-27, torch 2.13.0 + MKL 2024.2, an AVX-512 AMD EPYC). Training
# carries each step's rounding into the next, and a few inputs are ill-conditioned (a residual stream that nearly
# cancels at one position): those floors are larger. `make test-numerics` re-measures them; the wrong variants of
# ``tests/reference/variants.py`` move every fixture far beyond its tolerance.
TOLERANCE = {
    # floor 1.5e-4: task 1's gradients (MKL_CBWR=COMPATIBLE), downstream of one ill-conditioned position of sample 0
    # whose logits (teacher's and student's alike) move 3.5e-5 of their scale where the trained adapters move 7e-7
    "lwf": 2e-3,
    "hide_llava": 2e-4,  # floor 1.7e-5: the LLM's output after task 1 (ATEN_CPU_CAPABILITY=default)
    "disco": 2e-4,  # floor 1.1e-5: the LLM's output after task 1 (ATen default)
    "ewc": 1e-4,  # floor 7.5e-6: task 1's first-step gradients, after task 0's four steps (ATen default)
    "sefe": 1e-4,  # floor 5.0e-6: task 0's first-step gradient of q_proj's A (ATen default)
    "norga": 5e-5,  # floor 2.2e-6: the gradient of e_prompt (ATen default)
    "moelora": 2e-5,  # floor 1.4e-6: the output after task 1 (ATen default)
    "olora": 2e-5,  # floor 1.2e-6: the output before task 2, after two tasks' training (ATen default)
    "star_prompt": 2e-5,  # floor 1.1e-6: the gradient of the first level's context tokens (ATen default)
    "modal_prompt": 2e-5,  # floor 1.3e-6: the next-token logits after task 3 (ATEN_CPU_CAPABILITY=avx2)
    # HiDe-Prompt's quantities are small (the prompt's gradient 1.8e-3, covariances 7e-4): each against its own
    # scale (``assert_rel_close``), not 1e-5 absolute, which was a fifth of a covariance's largest entry
    "hide_prompt": 5e-6,  # floor 4.0e-7: the training logits (ATen default)
    # a variance is a difference of second moments: it rounds at their scale (about 1), not its own (1e-4 - 7e-4)
    "hide_prompt variances": 1e-3,  # floor 5.3e-5: task 0's cluster variances (ATen default)
}
CLASSES = [[0, 1, 2], [3, 4, 5]]


def vit(layers: int = 6):
    """A seeded random ViTBackbone: 24 wide, 2 heads, MLP 48, 16 px images in 4 px patches (16 + 1 tokens)."""
    from transformers import ViTConfig, ViTModel

    from mcit.models.vit import ViTBackbone

    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=24, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=48,
                    image_size=16, patch_size=4, layer_norm_eps=1e-6, hidden_act="gelu")
    model = ViTModel(cfg, add_pooling_layer=False)
    with torch.no_grad():  # the random init leaves LayerNorms at 1/0 and biases at 0: make every weight count
        g = torch.Generator().manual_seed(10)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return ViTBackbone(model, [0.5] * 3, [0.5] * 3)


def clip(layers: int = 4):
    """A seeded random CLIPBackbone (vision 24 wide, 2 heads, quick-GELU, LayerNorm eps 1e-5 as CLIP; projection 16).

    Its class-name text features are fixed seeded unit vectors (what the official code caches from CLIP's text
    encoder is an input of the methods compared here, not part of them), so no tokenizer is needed."""
    from transformers import CLIPConfig, CLIPModel

    from mcit.models.clip import CLIPBackbone

    torch.manual_seed(0)
    cfg = CLIPConfig(text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 16,
                                  "bos_token_id": 62, "eos_token_id": 63, "pad_token_id": 63},
                     vision_config={"hidden_size": 24, "num_hidden_layers": layers, "num_attention_heads": 2,
                                    "intermediate_size": 48, "image_size": 16, "patch_size": 4,
                                    "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
                     projection_dim=16)
    model = CLIPModel(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(10)
        for name, p in model.vision_model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name or "layrnorm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    bb = CLIPBackbone(model, [0.5] * 3, [0.5] * 3, tokenizer=_word_tokenizer())

    def class_text_features(names: list[str], templates: list[str]) -> torch.Tensor:
        g = torch.Generator().manual_seed(11)
        return torch.nn.functional.normalize(torch.randn(len(names), 16, generator=g), dim=-1)

    bb.class_text_features = class_text_features
    return bb


def _word_tokenizer():
    """A word-level tokenizer for the tiny CLIP's 64-token vocabulary ("X", ".", digits). As in OpenAI's
    vocabulary, end-of-text has the largest id (63), so pooling at the argmax of the ids (the official
    CLIP code) and at the first end-of-text token (transformers') pick the same position."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 62, "<eos>": 63, "<unk>": 2, "X": 3, ".": 4, **{str(i): 5 + i for i in range(10)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                       special_tokens=[("<bos>", 62), ("<eos>", 63)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>",
                                   unk_token="<unk>")


def sequence():
    """Two tasks of three classes (indices 0-2 and 3-5)."""
    from mcit.data.types import TaskSequence

    return TaskSequence.from_label_spaces(["t0", "t1"], CLASSES)


def images(n: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 16, 16, generator=g)


def labels(task: int, n: int = 4) -> torch.Tensor:
    return torch.tensor([CLASSES[task][i % 3] for i in range(n)])


def batch(task: int, n: int = 4):
    from mcit.data.types import Batch

    return Batch(images(n), labels(task, n), torch.ones(n), task)


def method(name: str, backbone, seq=None, seed: int = 2, **params: Any):
    """The project's ``name`` with ``params``, its parameters drawn after ``torch.manual_seed(seed)``. The official
    numbers were produced from these parameters copied into the official modules, the heads drawn by nn.Linear's
    default init (``head_init: torch``): the draws stay those, whatever a method's default init."""
    from mcit.core.registry import METHODS

    cls = METHODS.get(name)
    if "head_init" in cls.Params.model_fields:
        params = {"head_init": "torch", **params}
    torch.manual_seed(seed)
    return cls(cls.Params(**params), backbone, seq or sequence())


def train_loss(m, b) -> torch.Tensor:
    """The scalar the engine minimises for one batch: mean of the per-sample terms plus the regularizer."""
    terms = m(b)
    loss = terms.per_sample.mean()
    return loss + terms.regularizer if terms.regularizer is not None else loss


def grads(m) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def check_gradients(m, ref: dict, names: list[str], tol: float = TOL, relative: bool = False) -> None:
    """Each parameter's gradient against ``ref["grad.<name>"]`` (``relative``: ``assert_rel_close``)."""
    g = grads(m)
    close = assert_rel_close if relative else assert_close
    for name in names:
        close(g[name], ref[f"grad.{name}"], f"gradient of {name}", tol)


def check_train_step(m, b, ref: dict, names: list[str], logits: str = "train_logits") -> dict:
    """The training forward's logits, the loss the engine minimises and the gradients of ``names``."""
    out = m.train_outputs(b)
    assert_close(out["logits"], ref[logits], "train logits")
    loss = train_loss(m, b)
    assert_close(loss, ref["loss"], "loss")
    loss.backward()
    check_gradients(m, ref, names)
    return out


def check_wtp_step(m, b, ref: dict, names: list[str], tol: float = TOL) -> None:
    """HiDe-Prompt: the within-task loss the official engine minimises (cross-entropy plus the contrastive term;
    our TII head's cross-entropy, trained in the same pass, is left out: it reaches none of the compared
    gradients) and the gradients of ``names``, each within ``tol`` of its own scale."""
    out = m.train_outputs(b)
    assert_rel_close(out["logits"], ref["train_logits"], "train logits", tol)
    terms = m.loss(b, out)
    assert_rel_close(terms.regularizer, ref["orth"], "contrastive loss", tol)
    loss = terms.task.mean() + terms.regularizer
    assert_rel_close(loss, ref["loss"], "loss", tol)
    loss.backward()
    check_gradients(m, ref, names, tol, relative=True)


def llama_lm():
    """The LLM of the LoRA-family references: a LlamaModel 8 wide, 2 layers, 2 heads, MLP 12, every weight
    0.3 * randn (norm weights 1 + 0.3 * randn) from Generator seed 0 in sorted name order, so the official
    peft code and ours adapt the same model."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=12, vocab_size=32)
    lm = LlamaModel(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(lm.named_parameters()):
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return lm


class LanguageModelHolder:
    """What an MCIT method reads of its backbone when it only adapts the LLM: the LLM itself, that it
    generates (``task_type``) and its depth. The references feed the LLM hidden states directly."""

    task_type = "generation"

    def __init__(self, lm) -> None:
        self.language_model = lm
        self.num_layers = lm.config.num_hidden_layers


def official(name: str) -> dict[str, Any]:
    return json.loads((OFFICIAL / f"{name}.json").read_text())


def as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.tensor(x, dtype=torch.float64)


def max_diff(ours: torch.Tensor, ref: Any) -> float:
    ref_t = as_tensor(ref)
    ours = ours.detach().double().reshape(ref_t.shape)
    return float((ours - ref_t).abs().max()) if ref_t.numel() else 0.0


def assert_close(ours: torch.Tensor, ref: Any, what: str, tol: float = TOL) -> float:
    """Max abs difference at most ``tol``, times the largest official magnitude where that exceeds 1
    (float32 carries about 7 significant digits: a gradient entry of 17 cannot agree to 1e-5 absolute)."""
    scale = max(1.0, float(as_tensor(ref).abs().max())) if as_tensor(ref).numel() else 1.0
    return compare(ours, ref, what, tol, scale)


def distinct_vit(layers: int = 6):
    """``vit()`` re-weighted so that its [CLS] feature depends on the image (``vit()``'s 0.02-std weights give
    near-uniform attention and features of pairwise cosine > 0.9999, which no contrastive term can tell apart).

    Every weight matrix (patch projection, q, k, v, o, MLP) redrawn as randn / sqrt(fan_in) and the [CLS] token
    and position embeddings as 0.3 * randn (Generator seed 12, sorted name order; biases and norms as in
    ``vit()``), the final LayerNorm's weight and bias halved: on ``images(4)`` the features' pairwise cosines are
    0.3-0.8 and their squared norms about 6, so the contrastive logits (|f|^2 / 0.8) sit where the softmax, and
    so the temperature, matter. The official code was fed this model's state dict."""
    bb = vit(layers)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in sorted(bb.model.named_parameters()):
            if name.endswith("weight") and p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif name in ("embeddings.cls_token", "embeddings.position_embeddings"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        bb.model.layernorm.weight.mul_(0.5)
        bb.model.layernorm.bias.mul_(0.5)
    return bb


def assert_rel_close(ours: torch.Tensor, ref: Any, what: str, tol: float = TOL) -> float:
    """Max abs difference at most ``tol`` times the quantity's own scale (the largest official magnitude, with
    no floor: a gradient of 1e-3 is held to 1e-8, not to 1e-5). The scale must be non-zero."""
    scale = float(as_tensor(ref).abs().max())
    assert scale > 0, f"{what}: the official value is 0, no scale to compare against"
    return compare(ours, ref, what, tol, scale)


def compare(ours: Any, ref: Any, what: str, tol: float, scale: float) -> float:
    """The one comparison every reference test makes: max abs difference at most ``tol * scale``.

    With MCIT_REFERENCE_REPORT set, each call appends a JSON line (test, quantity, difference, scale, allowed, and
    our values when small) to that file: ``tests/numerics.py`` reads them from runs under several BLAS / ATen
    kernel sets and thread counts to measure each fixture's noise floor against its tolerance. With
    MCIT_REFERENCE_CONTINUE set as well, a difference beyond the tolerance is recorded and the test goes on (it
    fails at its end, ``conftest.py``): how far a wrong variant moves every quantity, not only the first."""
    ours_t = as_tensor(ours)
    d = max_diff(ours_t, ref)
    message = (f"{what}: max abs difference {d:.3g} from the official value (tolerance {tol:.3g} x {scale:.3g})"
               if not d <= tol * scale else "")
    report = os.environ.get("MCIT_REFERENCE_REPORT")
    if report:
        row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "what": what, "d": d,
               "scale": scale, "allowed": tol * scale,
               "values": ours_t.reshape(-1).tolist() if ours_t.numel() <= 4096 else None}
        with open(report, "a") as f:
            f.write(json.dumps(row) + "\n")
        if message and os.environ.get("MCIT_REFERENCE_CONTINUE"):
            FAILED.append(message)
            return d
    assert not message, message
    return d


FAILED: list[str] = []  # MCIT_REFERENCE_CONTINUE: the comparisons beyond tolerance of the running test

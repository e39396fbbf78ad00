"""Adding a backbone and a method is one file each: both are registered here, in a test module, and run
through the real pipeline (pre-flight, DeepSpeed train stage, subspace stage, eval, commit, metrics) in
this process, with no edit anywhere else. The method records every hook call, which pins the lifecycle
order written in ``Method``'s docstring.

A multimodal LLM family is one file too: ViP-LLaVA (transformers' ``VipLlavaForConditionalGeneration``, whose
projector reads several tower layers at once) is registered here, loads through pre-flight's checks, trains
prompts, and, because this module is collected before tests/unit/test_families.py, also goes through every
family test there (its logits and generation against transformers' own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcit.core.registry import BACKBONES, METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LossTerms, Method, MethodParams
from mcit.models.base import Backbone
from mcit.models.mllm import MLLMBackbone

CALLS: list[tuple] = []  # (hook, task, phase) over every build of the method in this process


@BACKBONES.register("test_resnet")
class ResNetBackbone(Backbone):
    """A frozen transformers ResNetModel (a CNN: nothing like the ViT the prompt methods know)."""

    task_type = "classification"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.requires_grad_(False).eval()
        self.hidden_size = int(model.config.hidden_sizes[-1])

    @classmethod
    def from_path(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ResNetBackbone":
        from transformers import ResNetModel

        cls.check(path)
        return cls(ResNetModel.from_pretrained(str(path), dtype=dtype))

    def preprocess(self, images: list) -> torch.Tensor:
        import numpy as np

        arrs = [np.asarray(im.convert("RGB").resize((16, 16)), dtype=np.float32) / 255.0 for im in images]
        return torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).contiguous()

    def make_collate(self, split: Any, task: int, *, train: bool, label_index: dict[int, int]) -> Callable:
        from mcit.data.loader import classification_collate

        return classification_collate(self.preprocess, label_index, task, split)

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values).pooler_output.flatten(1)


class MeansParams(MethodParams):
    temperature: float = 1.0


@METHODS.register("test_class_means")
class ClassMeans(Method):
    """A linear head trained per task, and a nearest-class-mean classifier whose means the subspace
    stage computes from the statistics of every rank."""

    name = "test_class_means"
    Params = MeansParams
    has_subspace_stage = True

    def __init__(self, params: MeansParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self.head = nn.Linear(backbone.hidden_size, sequence.num_classes)
        self.register_buffer("means", torch.zeros(sequence.num_classes, backbone.hidden_size))
        CALLS.append(("build", None, None))

    def set_task(self, task: int) -> None:
        super().set_task(task)
        CALLS.append(("set_task", task, None))

    def set_phase(self, phase: str) -> None:
        super().set_phase(phase)
        CALLS.append(("set_phase", None, phase))

    def before_task(self, task: int) -> None:
        super().before_task(task)
        CALLS.append(("before_task", task, None))

    def after_task(self, task: int) -> None:
        CALLS.append(("after_task", task, None))

    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.backbone.features(batch.pixel_values))}

    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        ce = F.cross_entropy(outputs["logits"], batch.labels, reduction="none")
        return LossTerms(per_sample=ce)

    def statistics(self, batch: Batch) -> dict[str, torch.Tensor]:
        CALLS.append(("statistics", self.current_task, None))
        f = self.backbone.features(batch.pixel_values) * batch.valid[:, None]
        onehot = F.one_hot(batch.labels, self.sequence.num_classes).to(f.dtype) * batch.valid[:, None]
        return {"sums": onehot.T @ f, "counts": onehot.sum(0)}

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        seen = reduced["counts"] > 0
        self.means[seen] = (reduced["sums"][seen] / reduced["counts"][seen, None]).to(self.means.dtype)

    def predict(self, batch: Batch) -> torch.Tensor:
        CALLS.append(("predict", self.current_task, None))
        f = F.normalize(self.backbone.features(batch.pixel_values), dim=-1)
        scores = f @ F.normalize(self.means, dim=-1).T / self.params.temperature
        return self.restrict(scores, batch).argmax(dim=-1)


@pytest.fixture(scope="module")
def resnet_dir(tmp_path_factory) -> Path:
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("resnet") / "resnet"
    ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                             layer_type="basic")).save_pretrained(out)
    return out


def test_a_backbone_and_a_method_from_a_test_module_run_through_the_pipeline(assets, resnet_dir, tmp_path):
    from conftest import tiny_config

    from mcit.core import distributed as dist
    from mcit.core.config import ConfigError, load_config
    from mcit.run.pipeline import Pipeline
    from mcit.run.preflight import preflight

    path = tiny_config(assets, tmp_path, "extend", data={"tasks": ["task0", "task1"]},
                       backbone={"kind": "test_resnet", "path": str(resnet_dir), "tag": "resnet_toy",
                                 "cache_dir": str(tmp_path / "cache")},
                       method={"name": "test_class_means", "temperature": 0.5},
                       train={"epochs": 1, "deepspeed_config": "deepspeed_configs/zero2.json"},
                       eval={"batch_size": 50, "zero_shot": False, "first_task_loss": False})
    dist.init()
    CALLS.clear()
    # tiny_config asks for l2p's augmentation, which this backbone's make_collate does not take
    with pytest.raises(ConfigError,
                       match="data.train_transform: backbone kind test_resnet takes no augmentation preset"):
        preflight(load_config(path))
    plan = preflight(load_config(path, ["data.train_transform=backbone", "data.eval_transform=backbone"]))
    assert plan.backbone.record["tag"] == "resnet_toy" and len(plan.backbone.record["sha256"]) == 64
    metrics = Pipeline(plan).run()

    run = tmp_path / "runs" / "extend"
    assert metrics["complete"] and len(metrics["acc_matrix"]) == 2
    assert metrics["acc_matrix"][1][0] > 50 and metrics["acc_matrix"][1][1] > 50  # class means of both tasks
    assert json.loads((run / "backbone.json").read_text())["sha256"] == plan.backbone.record["sha256"]
    log = [json.loads(line) for line in (run / "logs" / "train.jsonl").read_text().splitlines()]
    assert [r["task"] for r in log if r.get("event") == "subspace"] == [0, 1]
    state = json.loads((run / "state.json").read_text())
    assert state["finished"] and state["completed"] == ["0/train", "0/subspace", "0/eval", "0/commit",
                                                        "1/train", "1/subspace", "1/eval", "1/commit"]

    # The lifecycle, as Method's docstring writes it (one phase ""; predict once per test batch).
    hooks = [c for i, c in enumerate(CALLS) if not (c[0] in ("statistics", "predict") and CALLS[i - 1] == c)]
    task = [("set_task", 0, None), ("set_phase", None, ""), ("before_task", 0, None),
            ("build", None, None), ("set_task", 0, None), ("set_phase", None, ""), ("after_task", 0, None),
            ("set_task", 0, None), ("set_phase", None, ""), ("statistics", 0, None),
            ("set_task", 0, None), ("set_phase", None, ""), ("predict", 0, None)]
    assert hooks[:1] == [("build", None, None)]
    assert hooks[1:1 + len(task)] == task
    second = [(h, None if t is None else 1, p) for h, t, p in task]
    assert hooks[1 + len(task):] == second


@BACKBONES.register("test_vipllava")
class VipLlavaBackbone(MLLMBackbone):
    """ViP-LLaVA: LLaVA's processor and conversation; the projector reads the concatenated patch tokens of several
    tower layers (``vision_feature_layers``), so its own ``vision``."""

    kind = "test_vipllava"
    model_class = "VipLlavaForConditionalGeneration"
    model_types = ("vipllava",)
    unquantized = ("lm_head", ".*vision_tower", ".*multi_modal_projector")

    @classmethod
    def tiny(cls, texts: list[str], seed: int = 0) -> tuple[nn.Module, Any]:
        from transformers import CLIPVisionConfig, LlamaConfig, VipLlavaConfig, VipLlavaForConditionalGeneration

        from mcit.models.tiny_llava import SPECIAL, build_processor, train_tokenizer

        tok = train_tokenizer(texts)
        cfg = VipLlavaConfig(
            vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=32, patch_size=8),
            text_config=LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, pad_token_id=tok.pad_token_id,
                                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
            image_token_index=tok.convert_tokens_to_ids(SPECIAL["image"]), vision_feature_layers=[-2, 1],
            image_seq_length=16, pad_token_id=tok.pad_token_id)
        torch.manual_seed(seed)
        model = VipLlavaForConditionalGeneration(cfg)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        return model, build_processor(tok, image_size=32, patch_size=8)

    def vision(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' multi-layer image features of the image rows; CLIP's pooled [CLS] of every row."""
        out = self.model.model.get_image_features(batch.pixel_values.to(self.dtype),
                                                  vision_feature_layer=self.model.config.vision_feature_layers,
                                                  return_dict=True)
        pooled = self.model.model.vision_tower.post_layernorm(out.last_hidden_state[:, 0])
        return out.pooler_output[self.image_rows(batch)], pooled


def test_a_multimodal_family_from_a_test_module_loads_and_trains_prompts(mcit_assets, tmp_path):
    from conftest import mcit_config

    from mcit.core.config import load_config
    from mcit.data import tiny_mcit as B
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.base import load_backbone
    from mcit.run.preflight import preflight

    assert VipLlavaBackbone in MLLMBackbone.families()
    model, processor = VipLlavaBackbone.tiny(B.corpus())
    model.save_pretrained(tmp_path / "vip")
    processor.save_pretrained(tmp_path / "vip")
    plan = preflight(load_config(mcit_config(mcit_assets, tmp_path, "vip", backbone={
        "kind": "test_vipllava", "path": str(tmp_path / "vip"), "tag": "tiny_vipllava"})))
    assert plan.backbone.record["sha256"]
    bb = load_backbone("test_vipllava", str(tmp_path / "vip"))
    assert type(bb) is VipLlavaBackbone and MLLMBackbone.wrap(bb.model, bb.processor).kind == "test_vipllava"
    split = open_split(mcit_assets["shards"] / "colour" / "train")
    batch = bb.make_collate(split, 0, train=True)(list(iter_samples(split, 0, 1, policy="sample"))[:4])
    with torch.no_grad():
        embeds, pooled = bb.input_embeddings(batch)
        mask = batch.inputs["attention_mask"]
        ours = bb.logits(embeds, mask)[mask.bool()]
        theirs = bb.model(**bb.model_inputs(batch)).logits[mask.bool()]
    assert pooled.shape == (4, 32) and float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    cls = METHODS.get("prompt_tuning")
    m = cls(cls.Params(prompt_length=2), bb, TaskSequence.from_label_spaces(["c"], [[]]))
    m(batch).per_sample.mean().backward()
    assert m.prompt.grad is not None and float(m.prompt.grad.abs().sum()) > 0

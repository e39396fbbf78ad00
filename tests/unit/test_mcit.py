"""MCIT in-process: scorers, streaming subspaces, the multimodal LLM wrappers' batches and generation,
Fwd-Prompt's ablations, LoRA rebuilds, quantized backbones. (Launched: tests/launch/test_mcit_pipeline.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, mcit_config, run_main
from raw_formats import convert

from mcit.core import scorers as S
from mcit.core.subspace import energy_basis, project_out, token_covariance


# -- scorers ----------------------------------------------------------------------------------------
def test_scorers():
    assert S.exact_match("Three.", {"answer": "3"}) == 1.0
    assert S.exact_match("the red", {"answer": "red"}) == 1.0
    assert S.exact_match("red circle", {"answer": "red"}) == 0.0
    ten = ["yes"] * 2 + ["no"] * 8
    assert S.vqa_accuracy("yes", {"answer": "no", "answers": ten}) == pytest.approx(
        (8 * (2 / 3) + 2 * (1 / 3)) / 10)  # leave-one-out average of min(n/3, 1)
    assert S.vqa_accuracy("no", {"answer": "no", "answers": ten}) == 1.0
    assert S.multiple_choice("(B) a cat", {"answer": "B"}) == 1.0
    assert S.multiple_choice("Answer: C", {"answer": "B"}) == 0.0
    assert S.contains("it is a red circle", {"answer": "red"}) == 1.0
    assert S.contains("reddish", {"answer": "red"}) == 0.0
    assert S.grounding_iou("[0.1, 0.1, 0.5, 0.5]", {"answer": "", "box": [0.1, 0.1, 0.5, 0.6]}) == 1.0
    assert S.grounding_iou("[0.1, 0.1, 0.3, 0.3]", {"answer": "", "box": [0.1, 0.1, 0.5, 0.6]}) == 0.0
    with pytest.raises(KeyError):
        S.get("bleu")


# -- subspaces --------------------------------------------------------------------------------------
def test_streamed_covariance_equals_one_svd_of_all_embeddings():
    g = torch.Generator().manual_seed(0)
    d = 24
    mix = torch.randn(d, d, generator=g) * torch.logspace(0, -3, d)  # a decaying spectrum
    x = torch.randn(3, 50, d, generator=g) @ mix.T
    mask = torch.ones(3, 50)
    mask[1, 40:] = 0
    cov = sum(token_covariance(x[i : i + 1], mask[i : i + 1])[0] for i in range(3))
    rows = x.reshape(-1, d)[mask.reshape(-1).bool()].double()
    assert torch.allclose(cov, rows.T @ rows, rtol=1e-10, atol=1e-8)
    U, s, _ = torch.linalg.svd(rows.T, full_matrices=False)
    basis = energy_basis(cov, 0.95)
    k = int((torch.cumsum(s**2, 0) / (s**2).sum() < 0.95).sum()) + 1
    assert basis.shape[1] == k
    assert torch.allclose(basis @ basis.T, U[:, :k] @ U[:, :k].T, atol=1e-6)  # same subspace
    more = energy_basis(cov, 0.99, basis)  # only the missing energy, orthogonal to what exists
    assert more.shape[1] > 0 and (basis.T @ more).abs().max() < 1e-8
    assert energy_basis(cov, 0.9, basis).shape[1] == 0
    delta = torch.randn(5, d, generator=g, dtype=torch.float64)
    assert (project_out(delta, basis) @ basis).abs().max() < 1e-10


# -- the LLaVA wrapper --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llava(mcit_assets):
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))
    split = open_split(mcit_assets["shards"] / "count" / "test")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:8]
    return bb, split, samples


def test_collate_trains_on_answer_tokens_only_and_pads_left_to_generate(llava):
    bb, split, samples = llava
    from mcit.data.instructions import decode_instruction

    tr = bb.make_collate(split, 0, train=True)(samples)
    tok = bb.tokenizer
    for i, meta in enumerate(tr.meta):
        target = tr.labels[i][tr.labels[i] != -100].tolist()
        # the answer and </s>, nothing of the prompt
        assert target == tok(meta["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert tr.inputs["attention_mask"][i, 0] == 1  # right padding
        # the whole sample is what the checkpoint's own processor makes of its chat template
        image, rec, _ = decode_instruction(samples[i])
        msgs = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": rec["question"].replace("<image>", "").strip()}]},
                {"role": "assistant", "content": [{"type": "text", "text": rec["answer"]}]}]
        own = bb.processor(text=[bb.processor.apply_chat_template(msgs, tokenize=False)],
                           images=[image])["input_ids"][0]
        n = int(tr.inputs["attention_mask"][i].sum())
        assert tr.inputs["input_ids"][i, :n].tolist() == list(own)
    assert int((tr.inputs["input_ids"] == bb.image_token_id).sum()) == len(samples) * bb.model.config.image_seq_length
    ev = bb.make_collate(split, 0, train=False)(samples)
    assert (ev.labels == -100).all() and (ev.inputs["attention_mask"][:, -1] == 1).all()  # left padding


def test_the_collate_travels_to_persistent_workers_without_the_model(llava, backbone, tmp_path):
    """A backbone's collate is bound to its ``collation_view``: it pickles in kilobytes (no weights) and
    collates the same batch after the trip, so the loader's persistent workers can take it (mcit.data.loader)."""
    import pickle

    from mcit.data.loader import WorkerPool
    from mcit.data.shards import write_split

    bb, split, samples = llava
    pool = WorkerPool(1, False, 600.0)
    for train in (True, False):
        collate = bb.make_collate(split, 0, train=train)
        blob = pickle.dumps(collate)
        assert len(blob) < 200_000 and pool.register([collate]) is not None
        a, b = collate(samples), pickle.loads(blob)(samples)
        assert a.keys == b.keys and a.meta == b.meta and torch.equal(a.pixel_values, b.pixel_values)
        assert all(torch.equal(a.inputs[k], b.inputs[k]) for k in a.inputs) and torch.equal(a.labels, b.labels)
    assert sum(p.numel() for p in bb.parameters()) > 0 and bb.model is not None  # the backbone itself keeps its model
    import io

    from PIL import Image

    def png(i):
        buf = io.BytesIO()
        Image.new("RGB", (20, 20), (i * 40, 9, 200)).save(buf, format="PNG")
        return buf.getvalue()

    write_split(tmp_path / "cls", [{"__key__": f"k{i}", "png": png(i), "cls": i % 2} for i in range(4)], shard_size=4,
                label_space=[0, 1])
    from mcit.data.shards import iter_samples, open_split

    cls_split = open_split(tmp_path / "cls")
    vit_collate = backbone.make_collate(cls_split, 0, train=False, label_index={0: 0, 1: 1})
    blob = pickle.dumps(vit_collate)
    rows = list(iter_samples(cls_split, 0, 1))
    assert len(blob) < 20_000 and pool.register([vit_collate]) is not None
    assert torch.equal(vit_collate(rows).pixel_values, pickle.loads(blob)(rows).pixel_values)


def test_generation_does_not_depend_on_the_batch(llava):
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence

    bb, split, samples = llava
    cls = METHODS.get("fwd_prompt")
    torch.manual_seed(0)
    m = cls(cls.Params(pool_size=4, top_n=2, prompt_length=3), bb, TaskSequence.from_label_spaces(["c"], [[]]))
    collate = bb.make_collate(split, 0, train=False)
    together = m.generate(collate(samples), 4)
    alone = [m.generate(collate([s]), 4)[0] for s in samples]
    assert together == alone


def test_fwd_prompt_ablations_project_onto_or_out_of_the_pretrained_space(llava):
    """``combine: pretrained_only`` keeps every update inside the pre-trained core space (reuse only);
    the default keeps updates out of the old tasks' spaces; ``project: false`` leaves them alone."""
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence

    bb, _, _ = llava
    cls = METHODS.get("fwd_prompt")
    seq = TaskSequence.from_label_spaces(["c"], [[]])
    d = bb.hidden_size
    basis = torch.linalg.qr(torch.randn(d, 3, generator=torch.Generator().manual_seed(0)))[0]
    delta = torch.randn(4, 2, d, generator=torch.Generator().manual_seed(1))
    out = {}
    for combine in ("pretrained_only", "reuse_pretrained"):
        m = cls(cls.Params(pool_size=4, top_n=2, prompt_length=2, combine=combine), bb, seq)
        assert cls.reference_required(m.params)
        m.pre_basis[:, :3] = basis
        m.pre_rank.fill_(3)
        m.task_basis[:, :3] = basis
        m.task_rank.fill_(3)
        out[combine] = m.project_update("prompts", delta.clone())
    inside = out["pretrained_only"]
    assert (inside - inside @ basis @ basis.T).abs().max() < 1e-5 and inside.abs().max() > 0
    assert (out["reuse_pretrained"] @ basis).abs().max() < 1e-5
    off = cls(cls.Params(pool_size=4, top_n=2, prompt_length=2, project=False), bb, seq)
    assert off.project_update("prompts", delta) is None


def test_lora_rebuild_reuses_injected_adapters(llava):
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence

    bb, split, samples = llava
    cls = METHODS.get("lora")
    seq = TaskSequence.from_label_spaces(["c"], [[]])
    a = cls(cls.Params(r=2), bb, seq)
    n = sum(p.numel() for p in a.trainable_parameters())
    batch = bb.make_collate(split, 0, train=True)(samples[:4])
    opt = torch.optim.Adam(a.trainable_parameters(), lr=0.01)
    loss = a(batch).per_sample.mean()
    loss.backward()
    opt.step()
    assert a.merged_delta_norm() > 0
    b = cls(cls.Params(r=2), bb, seq)  # a rebuild (as after every stage): same adapters, re-initialised
    assert sum(p.numel() for p in b.trainable_parameters()) == n and b.merged_delta_norm() == 0
    b.load_state_dict(a.state_dict())
    assert b.merged_delta_norm() == pytest.approx(a.merged_delta_norm())


@pytest.mark.parametrize("name,params", [("olora", {"r": 2, "lamda_2": 0.1}),
                                         ("moelora", {"r": 4, "experts": 2, "alpha": 8})])
def test_lora_family_starts_as_the_pretrained_model_and_rebuilds_from_its_state(mcit_assets, llava, name, params):
    """O-LoRA and MoELoRA add nothing before training (B = 0: the zero-shot row is the pre-trained model's);
    after training, a rebuilt method that loads the state computes the same loss. O-LoRA trains only the
    current task's pair, and from the second task on its orthogonality term is positive."""
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence
    from mcit.models.mllm import MLLMBackbone

    _, split, samples = llava
    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))  # its own: each method injects its own layers
    batch = bb.make_collate(split, 0, train=True)(samples[:4])
    seq = TaskSequence.from_label_spaces(["a", "b"], [[], []])
    plain = METHODS.get("prompt_tuning")(METHODS.get("prompt_tuning").Params(), bb, seq).eval()
    with torch.no_grad(), plain.zero_shot():
        pretrained = plain(batch).per_sample
    cls = METHODS.get(name)
    torch.manual_seed(0)
    m = cls(cls.Params(**params), bb, seq).eval()
    with torch.no_grad():
        assert torch.equal(m(batch).per_sample, pretrained)
    opt = torch.optim.Adam(m.trainable_parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        terms = m(batch)
        (terms.per_sample.mean() + (terms.regularizer if terms.regularizer is not None else 0)).backward()
        opt.step()
    with torch.no_grad():
        trained = m(batch).per_sample
    assert not torch.allclose(trained, pretrained)
    torch.manual_seed(1)  # a different initialisation: the loaded state must replace all of it
    again = cls(cls.Params(**params), bb, seq).eval()
    again.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert torch.equal(again(batch).per_sample, trained)
    if name == "olora":
        again.set_task(1)
        mine = {id(p) for p in again.trainable_parameters()} - {id(p) for p in again.projector_parameters()}
        assert mine == {id(p) for n, p in again.named_parameters() if n.endswith(".task1")}
        assert all(p.requires_grad == (id(p) in mine) for n, p in again.named_parameters()
                   if not n.startswith("projector."))
        terms = again(batch)  # with gradients: the regulariser of task 1's pair against task 0's
        assert terms.logs["orthogonal_loss"] > 0 and terms.logs["l2_loss"] > 0
        assert torch.equal(terms.per_sample.detach(), trained)  # task 1's B is still zero


@pytest.mark.parametrize("name", ["lora", "olora", "moelora"])
def test_lora_family_trains_the_projector_at_its_own_rate(mcit_assets, llava, name):
    """``train_projector`` (the default, as CoIN's and MCITlib's scripts): each build puts a fresh copy of the
    pre-trained projector into the backbone, the engine gives it ``projector_lr`` (adapters: train.lr), training
    moves it and the loss follows, a rebuild loads it from the state; ``train_projector: false`` puts the
    pre-trained projector back and trains none of it."""
    from mcit.core.config import load_config
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence
    from mcit.models.mllm import MLLMBackbone
    from mcit.run.engine import optimizer_groups

    _, split, samples = llava
    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))
    pretrained = bb.projector()
    before = {k: v.clone() for k, v in pretrained.state_dict().items()}
    batch = bb.make_collate(split, 0, train=True)(samples[:4])
    seq = TaskSequence.from_label_spaces(["a", "b"], [[], []])
    cls = METHODS.get(name)
    small = {"r": 4, "experts": 2} if name == "moelora" else {"r": 2}
    m = cls(cls.Params(**small), bb, seq)
    assert bb.projector() is m.projector and m.params.projector_lr == 2e-5
    cfg = load_config("configs/tiny_mcit_lora.yaml")
    groups = optimizer_groups(cfg, m)
    assert [g["lr"] for g in groups] == [cfg.train.lr, 2e-5]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in m.projector.parameters()} != set()
    opt = torch.optim.SGD(m.projector.parameters(), lr=1.0)  # the projector alone: the adapters stay at zero
    with torch.no_grad():
        start = m(batch).per_sample
    m(batch).per_sample.mean().backward()
    opt.step()
    with torch.no_grad():
        moved = m(batch).per_sample
    assert not torch.allclose(moved, start)  # the backbone computes with the method's projector
    assert all(torch.equal(v, before[k]) for k, v in pretrained.state_dict().items())  # the original is kept
    again = cls(cls.Params(**small), bb, seq)
    with torch.no_grad():
        assert torch.equal(again(batch).per_sample, start)  # a fresh build starts from the pre-trained projector
        again.load_state_dict(m.state_dict())
        assert torch.equal(again(batch).per_sample, moved)
    again.projector.to(torch.bfloat16)  # what DeepSpeed's bf16 does to the method's weights
    with torch.no_grad():
        assert torch.isfinite(again(batch).per_sample).all()
    frozen = cls(cls.Params(**small, train_projector=False), bb, seq)
    assert bb.projector() is pretrained and frozen.projector_parameters() == []
    assert len(optimizer_groups(cfg, frozen)) == 1


def test_every_shipped_config_validates():
    from mcit.core.config import load_config

    names = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert {"tiny_mcit_fwd_prompt.yaml", "coin_llava7b_fwd_prompt.yaml", "ucit_llava7b_fwd_prompt.yaml"} <= set(names)
    for name in names:
        cfg = load_config(ROOT / "configs" / name)
        if cfg.backbone.kind == "llava":
            from mcit.core import caption_metrics, scorers

            assert all(t.scorer in scorers.SCORERS or t.scorer in caption_metrics.CORPUS
                       for t in cfg.data.tasks if not isinstance(t, str) and t.scorer)


def test_llava_15_7b_architecture_builds_without_weights():
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence
    from mcit.models.mllm import build_empty

    bb = build_empty("llava-1.5-7b")
    total = sum(p.numel() for p in bb.model.parameters())
    assert 7.0e9 < total < 7.1e9 and all(p.is_meta for p in bb.model.parameters())
    cls = METHODS.get("fwd_prompt")
    m = cls(cls.Params(pool_size=10, top_n=2, prompt_length=4), bb, TaskSequence.from_label_spaces(["t"], [[]]))
    assert sum(p.numel() for p in m.trainable_parameters()) == 10 * (4 * 4096 + 1024 + 4096)


def test_llava_json_converter(tmp_path):
    from PIL import Image

    from mcit.data.instructions import decode_instruction
    from mcit.data.shards import iter_samples, open_split

    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 8), (200, 0, 0)).save(tmp_path / "img" / "a.png")
    items = [{"id": "q1", "image": "a.png", "answers": ["red"] * 10,
              "conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "red"},
                                {"from": "human", "value": "Shape?"}, {"from": "gpt", "value": "square"}]}]
    (tmp_path / "d.json").write_text(json.dumps(items))
    args = ["--json", tmp_path / "d.json", "--images", tmp_path / "img", "--out", tmp_path / "split", "--scorer",
            "vqa_accuracy"]
    r = convert("llava_json", *args)
    assert r.returncode == 0, r.stderr
    split = open_split(tmp_path / "split")
    assert split.manifest["kind"] == "instruction" and split.manifest["scorer"] == "vqa_accuracy"
    decoded = [decode_instruction(s) for s in iter_samples(split, 0, 1, policy="sample")]
    # one sample per conversation: the history stays; the question scored is the last one
    assert [d[1]["turns"] for d in decoded] == [[("<image>\nColour?", "red"), ("Shape?", "square")]]
    assert (decoded[0][1]["question"], decoded[0][1]["answer"]) == ("Shape?", "square")
    assert decoded[0][1]["answers"] == ["red"] * 10 and decoded[0][0].getpixel((0, 0)) == (200, 0, 0)
    items[0]["image"] = "missing.png"
    (tmp_path / "d.json").write_text(json.dumps(items))
    args[args.index("--out") + 1] = tmp_path / "split2"
    r = convert("llava_json", *args)
    assert r.returncode == 2 and "record 'q1'" in r.stderr and "image file not found" in r.stderr
    assert str(tmp_path / "d.json") in r.stderr and not (tmp_path / "split2").exists()


def _batch_rows_equal_one_sample_batches(bb, mcit_assets) -> None:
    """The processor runs once over a batch's images (MLLMBackbone.encode_batch); each row of the batch -- its
    tokens, pixel values (``real_pixels``: Qwen2-VL's patches, InternVL's tiles, LLaVA-OneVision's anyres patches,
    without the batch's padding, and their counts), Q-Former instruction -- is what the sample collated alone
    gives. Samples from two tasks, and one with a larger image and a longer question (another
    Qwen2-VL grid, another Q-Former length)."""
    import io
    import json

    from PIL import Image

    from mcit.data.shards import iter_samples, open_split

    split = open_split(mcit_assets["shards"] / "colour" / "test")
    other = open_split(mcit_assets["shards"] / "count" / "test")
    samples = [*list(iter_samples(split, 0, 1, policy="sample"))[:2], *list(iter_samples(other, 0, 1))[:2]]
    big, rec = dict(samples[1]), json.loads(samples[1]["json"])
    image = Image.open(io.BytesIO(big["png"]))
    buf = io.BytesIO()
    image.resize((image.width * 2, image.height * 3)).save(buf, format="PNG")
    rec["conversations"][0]["value"] += " Say the colour of the shape in the picture, please."
    samples.append({**big, "__key__": "big", "png": buf.getvalue(), "json": json.dumps(rec).encode()})
    for train in (True, False):
        collate = bb.make_collate(split, 0, train=train)
        batch = collate(samples)
        assert not torch.equal(batch.pixel_values[0], batch.pixel_values[2])
        for i, s in enumerate(samples):
            one = collate([s])
            row = batch.inputs["attention_mask"][i].bool()
            assert batch.inputs["input_ids"][i][row].tolist() == one.inputs["input_ids"][0].tolist()
            assert torch.equal(bb.real_pixels(batch, i), bb.real_pixels(one, 0))  # the batch's padding aside
            for key in ("image_grid_thw", "num_tiles", "image_patches", "image_sizes"):
                if key in one.inputs:
                    assert torch.equal(batch.inputs[key][i], one.inputs[key][0]), key
            if "qformer_input_ids" in one.inputs:
                q = batch.inputs["qformer_attention_mask"][i].bool()
                assert batch.inputs["qformer_input_ids"][i][q].tolist() == one.inputs["qformer_input_ids"][0].tolist()


def test_llava_batch_rows_equal_one_sample_batches(llava, mcit_assets):
    _batch_rows_equal_one_sample_batches(llava[0], mcit_assets)


def test_llava_images_alone_encode_equals_the_full_processor(llava, mcit_assets):
    """LLaVA's collate runs the image processor alone and counts an image's tokens once per pixel shape
    (``images_alone``: the processor's text pass was a fifth of an evaluation's collation); the batch equals the
    one the full processor (text and images) gives, for images of several sizes and a text-only sample."""
    import copy
    import io
    import json

    from PIL import Image

    from mcit.data.shards import iter_samples, open_split

    bb = llava[0]
    assert type(bb).images_alone
    split = open_split(mcit_assets["shards"] / "count" / "test")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:4]
    rec = json.loads(samples[0]["json"])
    for n, size in enumerate(((64, 96), (20, 50), (33, 33))):
        buf = io.BytesIO()
        Image.open(io.BytesIO(samples[n]["png"])).resize(size).save(buf, format="PNG")
        samples.append({**samples[n], "__key__": f"sized{n}", "png": buf.getvalue()})
    samples.append({"__key__": "text", "json": json.dumps({**rec, "text_only": True}).encode()})
    full = copy.copy(bb)
    full.__dict__.pop("_image_counts", None)
    full.images_alone = False
    for train in (True, False):
        got, ref = bb.make_collate(split, 0, train=train)(samples), full.make_collate(split, 0, train=train)(samples)
        assert "_image_counts" not in full.__dict__
        for k in ("input_ids", "attention_mask", "has_image"):
            assert torch.equal(got.inputs[k], ref.inputs[k]), k
        assert torch.equal(got.labels, ref.labels) and torch.equal(got.pixel_values, ref.pixel_values)
        assert int((got.inputs["input_ids"] == bb.image_token_id).sum()) == 7 * 16  # 7 images of (32/8)^2 patches each


def test_instructblip_backbone_trains_prompts_and_generates_per_sample(mcit_assets, tmp_path):
    from mcit.core.registry import METHODS
    from mcit.data import tiny_mcit as B
    from mcit.data.shards import iter_samples, open_split
    from mcit.data.types import TaskSequence
    from mcit.models.base import load_backbone
    from mcit.models.tiny_llava import build_instructblip, train_tokenizer

    model, proc = build_instructblip(train_tokenizer(B.corpus(), image_token_attribute=False))
    model.save_pretrained(tmp_path / "iblip")
    proc.save_pretrained(tmp_path / "iblip")
    bb = load_backbone("instructblip", str(tmp_path / "iblip"))
    assert bb.kind == "instructblip"
    _batch_rows_equal_one_sample_batches(bb, mcit_assets)
    split = open_split(mcit_assets["shards"] / "colour" / "test")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:5]
    batch = bb.make_collate(split, 0, train=True)(samples)
    assert int((batch.inputs["input_ids"] == bb.image_token_id).sum()) == 5 * model.config.num_query_tokens
    cls = METHODS.get("fwd_prompt")
    torch.manual_seed(0)
    m = cls(cls.Params(pool_size=4, top_n=2, prompt_length=2), bb, TaskSequence.from_label_spaces(["c"], [[]]))
    terms = m(batch)
    terms.per_sample.mean().backward()
    assert torch.isfinite(terms.per_sample).all() and m.prompts.grad.abs().sum() > 0
    collate = bb.make_collate(split, 0, train=False)
    assert m.generate(collate(samples), 3) == [m.generate(collate([s]), 3)[0] for s in samples]


@pytest.mark.parametrize("mode,layer", [("4bit", "Linear4bit"), ("8bit", "Linear8bitLt")])
def test_quantized_frozen_backbone(mcit_assets, mode, layer):
    from mcit.core.registry import METHODS
    from mcit.data.shards import iter_samples, open_split
    from mcit.data.types import TaskSequence
    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]), quantization=mode)
    assert type(bb.language_model.layers[0].self_attn.q_proj).__name__ == layer
    # the language model is quantized; the vision tower, the projector and the output head are not
    kept = [n for n, mod in bb.model.named_modules() if type(mod).__name__ == "Linear"]
    assert kept and all(n == "lm_head" or ".vision_tower." in n or ".multi_modal_projector." in n for n in kept), kept
    assert any(".vision_tower." in n for n in kept) and any(".multi_modal_projector." in n for n in kept)
    split = open_split(mcit_assets["shards"] / "count" / "train")
    batch = bb.make_collate(split, 0, train=True)(list(iter_samples(split, 0, 1, policy="sample"))[:4])
    cls = METHODS.get("prompt_tuning")
    m = cls(cls.Params(prompt_length=2), bb, TaskSequence.from_label_spaces(["c"], [[]]))
    loss = m(batch).per_sample.mean()
    loss.backward()
    assert torch.isfinite(loss) and m.prompt.grad.abs().sum() > 0


def test_qwen2_vl_backbone_mrope_prompts_and_own_greedy_loop(mcit_assets, tmp_path):
    from mcit.core.registry import METHODS
    from mcit.data import tiny_mcit as B
    from mcit.data.shards import iter_samples, open_split
    from mcit.data.types import TaskSequence
    from mcit.models.base import load_backbone
    from mcit.models.tiny_llava import build_qwen2_vl, train_tokenizer

    model, proc = build_qwen2_vl(train_tokenizer(B.corpus()))
    model.save_pretrained(tmp_path / "qwen")
    proc.save_pretrained(tmp_path / "qwen")
    bb = load_backbone("qwen2_vl", str(tmp_path / "qwen"))
    _batch_rows_equal_one_sample_batches(bb, mcit_assets)
    split = open_split(mcit_assets["shards"] / "colour" / "test")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:5]
    ev = bb.make_collate(split, 0, train=False)(samples[:3])
    pos = bb.positions(ev)
    img = ev.inputs["input_ids"][0] == bb.image_token_id
    assert pos.shape[0] == 3 and len(set(pos[1, 0][img].tolist())) > 1  # 2-D positions on the image grid
    # Without prompts, the wrapper's greedy loop with explicit positions equals transformers' generate.
    e, _ = bb.input_embeddings(ev)
    mine = bb.generate(e, ev.inputs["attention_mask"], 4, pos)
    ids = ev.inputs["input_ids"]
    hf = bb.model.generate(input_ids=ids, attention_mask=ev.inputs["attention_mask"],
                           pixel_values=torch.cat([ev.pixel_values[i] for i in range(3)]),
                           image_grid_thw=ev.inputs["image_grid_thw"],
                           mm_token_type_ids=(ids == bb.image_token_id).int(), max_new_tokens=4, do_sample=False)
    assert mine == [t.strip() for t in bb.tokenizer.batch_decode(hf[:, ids.shape[1]:], skip_special_tokens=True)]
    cls = METHODS.get("fwd_prompt")
    torch.manual_seed(0)
    m = cls(cls.Params(pool_size=4, top_n=2, prompt_length=2), bb, TaskSequence.from_label_spaces(["c"], [[]]))
    terms = m(bb.make_collate(split, 0, train=True)(samples))
    terms.per_sample.mean().backward()
    assert torch.isfinite(terms.per_sample).all() and m.prompts.grad.abs().sum() > 0
    collate = bb.make_collate(split, 0, train=False)
    assert m.generate(collate(samples), 3) == [m.generate(collate([s]), 3)[0] for s in samples]


def test_bad_mcit_inputs_fail_fast_with_one_line(mcit_assets, assets, tmp_path):
    """Through the entry point's main (in-process: these stop in pre-flight, before any process group)."""
    cfg = mcit_config(mcit_assets, tmp_path, "noref", data={"reference": None})
    r = run_main(["--config", str(cfg)])
    assert r.returncode == 2 and "data.reference" in r.stderr.strip().splitlines()[-1]
    cfg = mcit_config(mcit_assets, tmp_path, "wrongdata", data={"root": str(assets["shards"]), "tasks": ["task0"]})
    r = run_main(["--config", str(cfg)])
    assert r.returncode == 2 and "classification samples" in r.stderr.strip().splitlines()[-1]
    cfg = mcit_config(mcit_assets, tmp_path, "badscorer", data={"tasks": [
        {"name": "colour", "train": str(mcit_assets["shards"] / "colour" / "train"),
         "test": str(mcit_assets["shards"] / "colour" / "test"), "scorer": "bleu"}]})
    r = run_main(["--config", str(cfg)])
    assert r.returncode == 2 and "unknown scorer 'bleu'" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_preflight_refuses_a_split_without_what_its_scorer_reads(mcit_assets, tmp_path):
    """CoIN's TextVQA scorer (m4c) needs the ten annotator answers: converted without the annotation file a
    split holds one answer and would score 0 for every exact match, so pre-flight stops, naming the file to
    pass. Likewise CoIN's grounding without image sizes and MCITlib's caption score without its COCO file.
    The same splits converted with what they need pass pre-flight."""
    from raw_formats import coin_raw, ucit_json_raw

    from mcit.core.config import load_config
    from mcit.run.preflight import preflight

    raw = coin_raw(tmp_path / "raw")
    ins = raw / "Instructions_Original"
    gt = json.loads((ins / "Grounding" / "test.json").read_text())
    (ins / "Grounding" / "test.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "size"} for r in gt]))
    uj = ucit_json_raw(tmp_path / "uj", raw / "images")
    for args in (("coin", "--task", "textvqa", "grounding", "--out", tmp_path / "bare"),
                 ("ucit", "--instructions", uj, "--images", uj / "datasets", "--task", "vizwiz_caption", "--out",
                  tmp_path / "bare"),
                 ("coin", "--task", "textvqa", "--annotations", f"textvqa={raw / 'TextVQA_val.json'}", "--out",
                  tmp_path / "full"),
                 ("ucit", "--instructions", uj, "--images", uj / "datasets", "--task", "vizwiz_caption",
                  "--annotations", f"vizwiz_caption={uj / 'VizWiz' / 'test_captions_coco.json'}", "--out",
                  tmp_path / "full")):
        base = [] if "--instructions" in args else ["--instructions", ins, "--images", raw / "images"]
        r = convert(args[0], *base, *args[1:])
        assert r.returncode == 0, r.stderr

    def config(root, task):
        split = tmp_path / root / task
        return mcit_config(mcit_assets, tmp_path, f"{root}_{task}", data={"tasks": [
            {"name": task, "train": str(split / "train"), "test": str(split / "test")}]})

    expect = {"textvqa": "--annotations textvqa=TextVQA_0.5.1_val.json", "grounding": "have no 'size'",
              "vizwiz_caption": "--annotations vizwiz_caption=<the COCO caption file>"}
    for task, text in expect.items():
        r = run_main(["--config", str(config("bare", task))])
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and text in lines[0], r.stderr
        assert f"task {task!r}" in lines[0] and str(tmp_path / "bare" / task / "test") in lines[0]
    for task in ("textvqa", "vizwiz_caption"):
        plan = preflight(load_config(config("full", task)))
        assert plan.scorers == [{"textvqa": "coin_textvqa", "vizwiz_caption": "ucit_caption"}[task]]
    assert not (tmp_path / "runs").exists()


def test_answer_rows_carry_coin_fields_and_the_record_reaches_the_scorer(llava, tmp_path):
    """A CoIN ScienceQA test record ({question_id, image, text, answer index, choices}) converted, collated for
    evaluation: its id is the answer row's question_id, CoIN's model_vqa fields are there, and the number of
    choices reaches coin_scienceqa (a letter beyond them scores 0, as in CoIN's eval_science_qa.py)."""
    from PIL import Image

    from mcit.data.shards import iter_samples, open_split
    from mcit.run.evaluation import answer_row

    bb = llava[0]
    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 8), (0, 0, 200)).save(tmp_path / "img" / "a.png")
    items = [{"question_id": "sqa7", "image": "a.png", "text": "Which is blue?\nA. sky\nB. grass", "answer": 0,
              "choices": ["sky", "grass"]}]
    (tmp_path / "test.json").write_text(json.dumps(items))
    r = convert("llava_json", "--json", tmp_path / "test.json", "--images", tmp_path / "img", "--out",
                tmp_path / "split", "--scorer", "coin_scienceqa")
    assert r.returncode == 0, r.stderr
    split = open_split(tmp_path / "split")
    batch = bb.make_collate(split, 0, train=False)(list(iter_samples(split, 0, 1, policy="sample")))
    ref = batch.meta[0]
    assert ref["question_id"] == "sqa7" and ref["answer"] == "A" and ref["choices"] == ["sky", "grass"]
    row = answer_row(ref, "The answer is A.", S.get("coin_scienceqa")("The answer is A.", ref), "llava-1.5-7b")
    assert row["score"] == 1.0
    assert {k: row[k] for k in ("question_id", "prompt", "text", "answer_id", "model_id", "metadata")} == {
        "question_id": "sqa7", "prompt": "Which is blue?\nA. sky\nB. grass", "text": "The answer is A.",
        "answer_id": ref["key"], "model_id": "llava-1.5-7b", "metadata": {}}
    assert S.get("coin_scienceqa")("C", {**ref, "answer": "C"}) == 0.0  # two choices: C is not an option
    assert S.get("coin_scienceqa")("C", {"answer": "C"}) == 1.0  # without choices every letter A-E counts


def test_energy_basis_thresholds_are_inclusive_and_count_captured_energy():
    """A diagonal covariance with energies 4, 3, 2, 1 (total 10), so every count is exact.
    * eps 0.7 needs 7: the first two directions hold exactly 7, so 2 directions (not 3: reaching the
      threshold is enough).
    * an existing basis e1 holds 4 = 0.4 x 10: at eps 0.4 nothing new is needed.
    * with e1 kept, eps 0.7 still needs 7 - 4 = 3, which e2 alone holds: exactly one new direction, e2
      (not counting e1's energy would ask the residual 3 + 2 + 1 for all 7 and take every direction).
    * all of it again at 1/1024 of the scale (trace 0.0098): energy fractions do not depend on units, so a
      constant anywhere (an eigenvalue floor, a "nothing to do" threshold on the trace) shows here."""
    from mcit.core.subspace import energy_basis

    for scale in (1.0, 2.0 ** -10):  # a power of two: the scaled sums stay exact
        cov = torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)) * scale
        assert energy_basis(cov, 0.7).shape == (4, 2)
        e1 = torch.eye(4, dtype=torch.float64)[:, :1]
        assert energy_basis(cov, 0.4, e1).shape == (4, 0)
        new = energy_basis(cov, 0.7, e1)
        assert new.shape == (4, 1) and torch.allclose(new[:, 0].abs(), torch.eye(4, dtype=torch.float64)[:, 1])
        assert energy_basis(cov, 0.71, e1).shape == (4, 2)
    # isotropic statistics: 99% of the energy needs every direction, the last one included (a cap of d - 1
    # directions when there is no basis yet, or d - m - 1 with one, would leave part of the space open)
    iso = torch.eye(4, dtype=torch.float64)
    full = energy_basis(iso, 0.99)
    assert full.shape == (4, 4) and torch.allclose(full.T @ full, iso)
    assert energy_basis(iso, 0.99, iso[:, :2]).shape == (4, 2)


def test_energy_basis_stays_inside_the_residual_when_round_off_asks_for_more():
    """eps 1.0 with an existing basis of m directions: the residual's eigenvalues sum to what is needed only up
    to round-off, so the search may ask for more than the d - m directions the residual has (it does in about
    a third of these rotations); the cap keeps exactly d - m. A float32 basis (what a checkpoint stores) is
    orthonormal only to ~1e-7, so the residual's eigenvectors lean on it by that much: the new directions are
    re-orthogonalised against it, to round-off in float64, even when it has one column."""
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        Q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
        cov = Q @ torch.diag(torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.5], dtype=torch.float64)) @ Q.T
        new = energy_basis(cov, 1.0, Q[:, :2])
        assert new.shape == (6, 4), seed
        assert torch.allclose(new.T @ new, torch.eye(4, dtype=torch.float64), atol=1e-10)
        assert (Q[:, :2].T @ new).abs().max() < 1e-10
    g = torch.Generator().manual_seed(0)
    for m in (1, 3):
        Q32, _ = torch.linalg.qr(torch.randn(8, 8, generator=g))
        A = torch.randn(8, 8, generator=g, dtype=torch.float64)
        new = energy_basis(A @ A.T, 0.95, Q32[:, :m])
        assert new.shape[1] > 0 and (Q32[:, :m].double().T @ new).abs().max() < 1e-12, m


def test_the_tiny_tokenizer_knows_every_word_the_benchmark_asks_or_answers():
    """The embedded benchmark's tokenizer is word-level, trained on ``corpus()``: a word missing there (a plural
    caption such as "three crosses", a question word) becomes <unk>, and the model can never answer it."""
    from mcit.data import tiny_mcit as B
    from mcit.models.tiny_llava import SPECIAL, train_tokenizer

    tok = train_tokenizer(B.corpus())
    unk = tok.convert_tokens_to_ids(SPECIAL["unk"])
    samples = B.base_mix(300, 0) + [s for t in B.CONTINUAL_TASKS for s in B.task_samples(t, 60, 0, train=False)]
    texts = {turn["value"].replace("<image>", "") for s in samples for turn in s["conversations"]}
    assert any("crosses" in t for t in texts) and any("circles" in t for t in texts)  # plurals are asked for
    chat = tok.apply_chat_template([{"role": "user", "content": "what colour"}], tokenize=False,
                                   add_generation_prompt=True)  # the template's own words too
    missing = sorted({t for t in texts | {chat} if unk in tok(t, add_special_tokens=False)["input_ids"]})
    assert not missing, missing[:5]


def test_continual_tasks_ask_in_many_phrasings_the_base_mix_never_uses():
    """The benchmark's design (issue 51): each continual task's questions come in many variants (with one phrasing
    an old task flipped as a whole and a method's number moved by 15 points between seeds), none of them a phrasing
    the base mix pre-trains on (the tasks must be new instructions for skills the model has), and the base mix asks
    every skill, not only captions."""
    import collections

    from mcit.data import tiny_mcit as B

    def question(s):
        return s["conversations"][0]["value"].replace("<image>", "").strip()

    base = B.base_mix(2000, 0)
    base_questions = {question(s) for s in base}
    skills = collections.Counter(next((k for k, v in B.SKILL_QUESTIONS.items() if any(c in question(s) for c in v)),
                                      "caption") for s in base)
    assert set(skills) == {"caption", *B.SKILL_QUESTIONS} and min(skills.values()) > 150, skills
    for task in B.CONTINUAL_TASKS:
        qs = collections.Counter(question(s) for s in B.task_samples(task, 600, 0, train=False))
        assert len(qs) >= 60 and max(qs.values()) < 0.05 * 600, (task, len(qs), qs.most_common(1))
        assert not set(qs) & base_questions, task
        assert {c for c in B.PARAPHRASES[task] if any(c in q for q in qs)} == set(B.PARAPHRASES[task])


def test_scorers_at_their_edges():
    """grounding_iou counts IoU >= 0.5 (a box of exactly half the union scores, 0.45 does not); exact_match
    accepts any reference answer, not only the first; a decimal point is kept ("3.5" is neither "3 5"
    nor "35")."""
    ref = {"answer": "[0, 0, 10, 10]"}
    assert S.grounding_iou("[0, 0, 10, 5]", ref) == 1.0  # IoU 50 / 100 = 0.5
    assert S.grounding_iou("[0, 0, 10, 4.5]", ref) == 0.0  # IoU 0.45
    assert S.grounding_iou("[0, 0, 10, 4.6]", ref) == 0.0  # 0.46: still below, a 0.4 threshold would pass it
    both = {"answer": "red", "answers": ["crimson", "red"]}
    assert S.exact_match("red", both) == 1.0 and S.exact_match("crimson", both) == 1.0
    assert S.exact_match("blue", both) == 0.0
    assert S.normalize("3.5") == "3.5" and S.normalize("It is 3.5.") == "it is 3.5"
    assert S.exact_match("3 5", {"answer": "3.5"}) == 0.0 and S.exact_match("35", {"answer": "3.5"}) == 0.0
    assert S.exact_match("3.5", {"answer": "3.5"}) == 1.0
    assert S.exact_match("A red, round ball!", {"answer": "red round ball"}) == 1.0  # punctuation, articles, case
    # EvalAI's answer processor (CoIN's TextVQA): "?" and "," dropped, "'s" split off as a lower-case word
    assert [S.evalai_normalise(t) for t in ("Yes?", "1,000", "John's cat")] == ["yes", "1000", "john 's cat"]


def test_coin_grounding_reads_a_box_reference_before_the_answer_text():
    """A reference with a ``box`` list scores against it (the answer text may be a sentence); without one, the
    ``answer_bbox`` text wins over ``answer``. Scored as eval_grounding.py: the prediction read after its
    ``[1:-1]`` cut, both boxes times max(size), IoU strictly above 0.5; the parsed variant reads brackets."""
    g, parsed = S.get("coin_grounding"), S.get("coin_grounding_parsed")
    box_ref = {"answer": "the cup on the left", "box": [0, 0, 0.5, 0.5], "size": [4, 3]}
    assert g("(0, 0, 0.5, 0.3)", box_ref) == 1.0  # IoU 0.6
    assert g("(0, 0, 0.5, 0.25)", box_ref) == 0.0  # IoU exactly 0.5
    assert g("no box", box_ref) == 0.0
    assert g("[0, 0, 0.5, 0.3]", box_ref) == 0.0 and parsed("[0, 0, 0.5, 0.3]", box_ref) == 1.0  # the cut
    both = {"answer": "[0.5, 0.5, 0.9, 0.9]", "answer_bbox": "[0, 0, 0.5, 0.5]", "size": [4, 3]}
    assert g("(0, 0, 0.5, 0.5)", both) == 1.0
    assert g("(0.5, 0.5, 0.9, 0.9)", both) == 0.0
    assert g("(0, 0, 0.5, 0.3)", {"answer": "[0, 0, 0.5, 0.5]", "size": [4, 3]}) == 1.0  # neither: the answer text
    with pytest.raises(ValueError, match="size"):
        g("(0, 0, 0.5, 0.3)", {"box": [0, 0, 0.5, 0.5]})


def test_box_iou_on_boxes_that_are_not_squares_at_the_origin():
    """Every coordinate differs (x0 1, y0 2, x1 5, y1 10 against 3, 0, 9, 6), so reading one index for another
    changes the value. By hand: the overlap is x 3..5 by y 2..6 = 8, the areas 4 x 8 = 32 and 6 x 6 = 36, the
    union 60: IoU 8/60. Disjoint boxes give 0, a box with itself 1, two empty boxes (no union) 0."""
    from mcit.core import scorers as S

    a, b = [1.0, 2.0, 5.0, 10.0], [3.0, 0.0, 9.0, 6.0]
    for iou in (S.box_iou, S.coin_iou):
        assert iou(a, b) == pytest.approx(8 / 60) and iou(b, a) == pytest.approx(8 / 60)
        assert iou(a, [6.0, 11.0, 7.0, 12.0]) == 0.0 and iou(a, a) == 1.0
        assert iou([2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]) == 0.0


def test_answer_normalisation_and_option_letters_at_their_edges():
    """EvalAI's processing lower-cases, drops commas and question marks and splits "'s" off ("The Dog's ball,
    ok?" is "dog 's ball ok"); newlines and tabs are spaces; "an" is an article like "a" and "the". An option
    letter is read from "B. text", from a bare "B", from the first one-letter word, else "FAILED"."""
    from mcit.core import scorers as S

    assert S.evalai_normalise("The Dog's ball,\tok?\n") == "dog 's ball ok"
    assert S.evalai_normalise("an apple") == S.evalai_normalise("apple") == "apple"
    assert S.normalize("Two\ncats") == S.normalize("two cats")
    assert S.coin_option_letter("B. a tree") == "B" and S.coin_option_letter("B") == "B"
    assert S.coin_option_letter("B.") == "B"  # three characters are needed for "X. ": the word rule reads it
    assert S.coin_option_letter("so c it is") == "C" and S.coin_option_letter("none of them") == "FAILED"


def test_vqa_and_evalai_normalisation_keep_the_official_code_paths():
    """vqaEval.py's punctuation rule: a mark is deleted outright when the text has it next to a space on
    either side ("e-mail- yes": "email yes"; "e-mail -yes" too), else it becomes a space ("e-mail" alone:
    "e mail"); at most 32 full stops go (``re.UNICODE`` passed as the count). Ten identical annotators are
    compared after only newline/tab clean-up, so "two\tdogs" matches "two dogs". EvalAI's processor drops
    commas and question marks before that rule, so "a,b" is "ab" (the rule alone would say "a b").
    ``parse_box`` keeps the first four numbers; an unknown scorer's error lists the known ones."""
    assert S.vqa_normalise("e-mail- yes") == "email yes" and S.vqa_normalise("e-mail -yes") == "email yes"
    assert S.vqa_normalise("e-mail") == "e mail"
    assert S.vqa_normalise("." * 40) == "." * 8
    ten = {"answers": ["two dogs"] * 10}
    assert S.vqa_accuracy("two\tdogs", ten) == 1.0 and S.vqa_accuracy("two\ndogs", ten) == 1.0
    assert [S.evalai_normalise(t) for t in ("a,b", "what?yes")] == ["ab", "whatyes"]
    assert S.parse_box("[1, 2, 3, 4] (5)") == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(KeyError, match=r"unknown scorer 'nope'; known: .*coin_scienceqa, .*exact_match, "):
        S.get("nope")


def test_stream_statistics_sums_every_batch_and_concatenates_rows_in_order():
    """One process, three batches (the middle one yields no statistic): the sums cover every batch, not the
    last; "cat:" rows are concatenated in batch order, not summed; finalize_statistics gets the task; the
    report carries the per-rank state digest."""
    from mcit.core import distributed as dist
    from mcit.run.subspace_stage import state_digest, stream_statistics

    class _B:
        def __init__(self, x: torch.Tensor | None) -> None:
            self.x = x

        def to(self, device):
            return self

    class _M:
        def __init__(self) -> None:
            self.state: dict[str, torch.Tensor] = {}
            self.task = None

        def statistics(self, b):
            return None if b.x is None else {"s": b.x.sum(0), "cat:rows": b.x[:, :1]}

        def finalize_statistics(self, sums, task):
            self.state, self.task = {"s": sums["s"], "rows": sums["cat:rows"]}, task

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = dict(state)

        def subspace_report(self):
            return {"dims": 1}

    dist.init()
    xs = [torch.arange(6.0).reshape(3, 2), None, torch.tensor([[10.0, 20.0]])]
    m = _M()
    report = stream_statistics(m, [_B(x) for x in xs], task=4)
    assert m.task == 4 and m.state["s"].tolist() == [16.0, 29.0]
    assert m.state["rows"][:, 0].tolist() == [0.0, 2.0, 4.0, 10.0]
    assert report == {"dims": 1, "state_sha256_per_rank": [state_digest(m.state)]}
    # no batch yields a statistic: nothing is finalised and there is no report
    m = _M()
    assert stream_statistics(m, [_B(None)], task=1) is None and m.task is None
    # only "cat:" rows (no summed key): they still reach finalize_statistics

    class _RowsOnly(_M):
        def statistics(self, b):
            return {"cat:rows": b.x[:, :1]}

        def finalize_statistics(self, sums, task):
            self.state, self.task = {"rows": sums["cat:rows"]}, task

    m = _RowsOnly()
    assert stream_statistics(m, [_B(xs[0]), _B(xs[2])], task=2) is not None
    assert m.task == 2 and m.state["rows"][:, 0].tolist() == [0.0, 2.0, 4.0, 10.0]


def test_state_digest_sees_every_byte_and_token_covariance_counts_tokens():
    """The subspace stage compares ranks' state digests to catch a diverged rank: one changed value must change
    the digest. The token count is the number of valid tokens (rows), not the embedding width."""
    from mcit.core.subspace import token_covariance
    from mcit.run.subspace_stage import state_digest

    a = {"w": torch.zeros(3), "b": torch.ones(2)}
    assert state_digest(a) == state_digest({k: v.clone() for k, v in a.items()})
    assert state_digest(a) != state_digest({"w": torch.tensor([0.0, 0.0, 1e-7]), "b": torch.ones(2)})
    x = torch.arange(30, dtype=torch.float32).reshape(2, 5, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    cov, n = token_covariance(x, mask)
    rows = torch.cat([x[0, :3], x[1, :2]]).double()
    assert float(n) == 5.0 and torch.equal(cov, rows.T @ rows)
    # counts are summed over batches and ranks: past 2^24 tokens (a few thousand LLaVA samples) a float32 count
    # would stop counting single tokens
    assert float(n + 2.0 ** 24) == 2 ** 24 + 5


def test_batch_to_keeps_the_allowed_classes():
    """Evaluation sets the seen-class mask, then moves the batch to the device: the mask must travel with it
    (dropping it lets a class of a task not yet trained be predicted)."""
    from mcit.data.types import Batch

    allowed = torch.tensor([True, False, True])
    b = Batch(torch.zeros(2, 3, 4, 4), torch.tensor([0, 2]), torch.ones(2), 0, ["a", "b"], allowed)
    moved = b.to(torch.device("cpu"))
    assert moved.allowed_classes is not None and torch.equal(moved.allowed_classes, allowed)
    # every tensor goes to the device (the meta device stands in for a GPU) and nothing else is lost
    full = Batch(torch.zeros(2, 3, 4, 4), torch.tensor([0, 2]), torch.ones(2), 3, ["a", "b"], allowed,
                 {"input_ids": torch.ones(2, 5, dtype=torch.long)}, [{"answer": "x"}, {"answer": "y"}])
    for nb in (False, True):
        m = full.to(torch.device("meta"), non_blocking=nb)
        tensors = [m.pixel_values, m.labels, m.valid, m.allowed_classes, *m.inputs.values()]
        assert all(t.device.type == "meta" for t in tensors) and list(m.inputs) == ["input_ids"]
        assert (m.task, m.keys, m.meta) == (3, ["a", "b"], [{"answer": "x"}, {"answer": "y"}])
    picked = full.select(torch.tensor([1, 1]))  # rows of a batch (what padding copies) keep every field
    assert (picked.task, picked.keys, picked.meta) == (3, ["b", "b"], [{"answer": "y"}, {"answer": "y"}])
    assert torch.equal(picked.allowed_classes, allowed) and picked.labels.tolist() == [2, 2]


def test_joint_schedule_and_validation_carve_plan_one_stage_on_every_tasks_fit_part(mcit_assets, tmp_path):
    from mcit.core.config import load_config
    from mcit.run.pipeline import stage_keys
    from mcit.run.preflight import preflight

    path = mcit_config(mcit_assets, tmp_path)
    seq = preflight(load_config(path))
    plan = preflight(load_config(path, ["data.schedule=joint", "data.validation=0.25"]))
    assert plan.num_stages == 1 and plan.stage_names == ["joint"] and plan.names == ["colour", "count"]
    assert [k for k in stage_keys(plan) if k.startswith("1/")] == [] and "0/commit" in stage_keys(plan)
    # the one training stage reads every task's fit part; evaluation reads the carved-off validation parts
    assert plan.train[0].num_samples + sum(t.num_samples for t in plan.test) == sum(t.num_samples for t in seq.train)
    assert all(0 < t.num_samples < s.num_samples for t, s in zip(plan.test, seq.train))
    assert {t.location for t in plan.test}.isdisjoint({t.location for t in seq.test})
    assert seq.num_stages == 2 and seq.stage_names == seq.names


def test_the_lm_loss_is_llava_s_token_mean_over_the_window_and_the_ranks(llava):
    """LLaVA's trainer (``LlavaLlamaForCausalLM.forward``; MCITlib's, CoIN's and SEFE's are the same) averages the
    cross-entropy over every answer token of the batch: transformers' ``LlavaForConditionalGeneration.forward``
    with ``labels`` computes it so. With answers of 1 to 9 words in one batch, the engine's objective (``step_loss``
    with the window's answer tokens, summed over micro-batches and ranks as DeepSpeed averages them) equals that
    loss for one micro-batch, for two accumulation steps and for two ranks x two steps; ``train.lm_loss_mean:
    sample`` (each sample's mean, averaged) is another objective, and one the split into micro-batches does not
    move either. The gradients agree as the values do."""
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence
    from mcit.run.engine import step_loss

    bb, split, samples = llava
    mixed = []
    for i, s in enumerate(samples[:6]):
        rec = json.loads(s["json"])
        rec["conversations"][1]["value"] = " ".join([rec["answers"][0]] * (1, 9, 2, 5, 1, 3)[i])
        mixed.append({**s, "json": json.dumps(rec).encode()})
    collate = bb.make_collate(split, 0, train=True)
    cls = METHODS.get("lora")
    m = cls(cls.Params(r=2), bb, TaskSequence.from_label_spaces(["c"], [[]]))  # B = 0: the pre-trained model
    torch.manual_seed(0)
    for p in m.trainable_parameters():  # non-zero adapters, so that the gradients say something
        torch.nn.init.normal_(p, std=0.05)
    full = collate(mixed)
    counts = full.labels[:, 1:].ne(-100).sum(1)
    assert len(set(counts.tolist())) >= 4, counts  # the answers' lengths differ

    def objective(parts: list[list[int]], world: int, mode: str) -> tuple[float, list[torch.Tensor]]:
        """``parts``: each rank's micro-batches (sample indices), as the engine runs one accumulation window."""
        gas = len(parts) // world
        batches = [collate([mixed[i] for i in p]) for p in parts]
        n_samples = sum(len(p) for p in parts)
        n_tokens = sum(m.answer_tokens(b) for b in batches)  # window_tokens' all-reduce
        for p in m.trainable_parameters():
            p.grad = None
        total = 0.0
        for b in batches:
            loss = step_loss(m(b), b.valid, world * gas / n_samples,
                             world * gas / n_tokens if mode == "token" else None) / (world * gas)
            loss.backward()  # DeepSpeed: 1 / gas per micro-batch, the mean over ranks
            total += float(loss)
        return total, [p.grad.clone() for p in m.trainable_parameters()]

    ref = bb.model(input_ids=full.inputs["input_ids"], attention_mask=full.inputs["attention_mask"],
                   pixel_values=full.pixel_values, labels=full.labels).loss
    per_sample = float(m(full).per_sample.detach().mean())
    one, g_one = objective([[0, 1, 2, 3, 4, 5]], 1, "token")
    gas2, g_gas2 = objective([[0, 1, 2], [3, 4, 5]], 1, "token")
    ranks, g_ranks = objective([[0], [1, 2], [3, 4], [5]], 2, "token")
    assert abs(one - float(ref)) < 1e-5 and abs(gas2 - one) < 1e-5 and abs(ranks - one) < 1e-5, (ref, gas2, ranks)
    for a, b, c in zip(g_one, g_gas2, g_ranks):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4) and torch.allclose(a, c, atol=1e-6, rtol=1e-4)
    sample_one, _ = objective([[0, 1, 2, 3, 4, 5]], 1, "sample")
    sample_gas2, _ = objective([[0, 1, 2], [3, 4, 5]], 1, "sample")
    assert abs(sample_one - per_sample) < 1e-5 and abs(sample_gas2 - sample_one) < 1e-5
    assert abs(sample_one - float(ref)) > 100 * 1e-5, (sample_one, float(ref))  # another objective
